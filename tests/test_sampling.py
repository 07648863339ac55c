"""gpuhub's own GPU readings (spawner/broker/sampling.py, spawner/cli/sampler.py): which nodes the
broker samples itself, how readings reach allocations, and the node samplers' API on a real hub,
with `gpuhub sampler` run as a real process and a user's token refused."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from types import SimpleNamespace

import pytest

from spawner.broker.sampling import by_holder, own_nodes
from spawner.broker.utilization import Sample, Utilization
from spawner.cli.sampler import make_report

from .hubtools import Hub, wait_for


@pytest.mark.parametrize(
    "readings, inventory, local, expected",
    [
        ("sampler", "simulated", {"n1", "n2"}, {"n1", "n2"}),
        ("sampler", "nvml", {"gpu-server"}, {"gpu-server"}),
        ("sampler", "slurm", {"gpu-node1", "gpu-node2"}, set()),  # other machines: their samplers
        ("owners", "simulated", {"n1"}, set()),
        ("owners", "nvml", {"gpu-server"}, set()),
    ],
)
def test_which_nodes_the_broker_samples_itself(readings, inventory, local, expected):
    assert own_nodes(readings, inventory, local) == frozenset(expected)


def alloc(ident):
    return SimpleNamespace(id=ident)


def test_readings_go_to_the_allocation_that_holds_each_gpu():
    a, b = alloc(1), alloc(2)
    c = alloc(3)
    holders = {("n", 0): (a,), ("n", 1): (b,), ("n", 2): (a,), ("n", 4): (b, c)}  # GPU 4 in slices
    samples = [Sample("n", i, 10.0 * i, 0, None) for i in range(5)]
    got = by_holder(samples, holders)
    assert [(x and x.id, [s.index for s in ss]) for x, ss in got] == [
        (1, [0, 2]),
        (2, [1, 4]),
        (None, [3]),
        (3, [4]),  # each slice's holder has its GPU's reading on its own idle clock
    ]
    assert by_holder([], holders) == []


def info(ident=1):
    from datetime import datetime

    return SimpleNamespace(
        id=ident,
        user="alice",
        purpose="server",
        gpu_count=1,
        gpus=(),
        started=datetime(2026, 1, 1),
        created=None,
    )


def test_only_decisive_readings_move_the_idle_clock_and_each_kind_is_kept_apart():
    now = [1767225600.0 + 100]
    util = Utilization(clock=lambda: now[0])
    a = info()
    busy = [Sample("n", 0, 100.0, 9000, None)]
    w = util.add_samples(a, busy, threshold=5, stale_after=60, decisive=False)
    assert w == util.watch(a)  # the clock as it was: an owner's word decides nothing
    assert util.latest("n", 0, 60) is None and util.latest("n", 0, 60, reported=True).utilization == 100.0
    before = util.watches[a.id]
    util.add_samples(a, [Sample("n", 0, 0.0, 0, None)], threshold=5, stale_after=60)
    assert util.watches[a.id] != before  # the decisive one moved it
    assert util.latest("n", 0, 60).utilization == 0.0
    assert util.latest("n", 0, 60, reported=True).utilization == 100.0  # hers, apart


def test_a_report_is_the_api_body():
    s = SimpleNamespace(
        node="gpu-node1", index=3, utilization=42.5, memory_used_mib=100, memory_total_mib=None
    )
    assert make_report([s]) == {
        "source": "gpuhub-sampler",
        "gpus": [{"node": "gpu-node1", "index": 3, "utilization": 42.5, "memory_used_mib": 100}],
    }


@pytest.fixture(scope="module")
def sampled_hub(tmp_path_factory):
    """A hub whose nodes' samplers may report (a sampler token), and whose broker samples
    nothing itself, so what the grid shows of a node came from its sampler (as on a Slurm
    cluster; with readings = "owners" the broker runs no sampler of its own)."""
    token = secrets.token_hex(32)
    hub = Hub(
        tmp_path_factory.mktemp("sampled"),
        extra_config='c.GpuHub.simulated_gpus = [{"node": "far-node", "count": 2}]\n'
        'c.GpuReclaim.readings = "owners"\n',
        sampler_token=token,
    ).start()
    hub.wait_for_broker()
    try:
        yield hub, token
    finally:
        hub.stop()


def far_gpus(hub):
    grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
    return {g["index"]: g for g in grid["gpus"] if g["node"] == "far-node"}


@pytest.mark.hub
def test_a_node_sampler_reports_and_nobody_else_may(sampled_hub, tmp_path):
    hub, token = sampled_hub
    body = {"gpus": [{"node": "far-node", "index": 0, "utilization": 64, "memory_used_mib": 10}]}
    # a user's own token, even an admin's, is not the sampler's
    for who in ("alice", "admin"):
        r = hub.broker("POST", "nodes/far-node/samples", hub.user_token(who), json=body)
        assert r.status_code == 403 and "custom:gpuhub:sample" in r.text, r.text
    assert far_gpus(hub)[0]["utilization"] is None  # nothing was stored
    # the sampler's own: only its node's GPUs, only GPUs gpuhub knows
    r = hub.broker("POST", "nodes/other-node/samples", token, json=body)
    assert r.status_code == 400 and "only that node's GPUs" in r.json()["message"], r.text
    bad = {"gpus": [{**body["gpus"][0], "index": 7}]}
    r = hub.broker("POST", "nodes/far-node/samples", token, json=bad)
    assert r.status_code == 400 and r.json()["reason"] == "not_a_gpu", r.text

    # the real command, once, as the admin would run it on the node
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"far-node:0": {"utilization": 64, "memory_used_mib": 10}}))
    token_file = tmp_path / "sampler.token"
    token_file.write_text(token)
    command = [
        sys.executable, "-m", "spawner.cli.sampler", "--broker-url", f"http://127.0.0.1:{hub.broker_port}"
        "/services/gpuhub/api/v1/", "--token-file", str(token_file), "--node", "far-node", "--gpus", "2",
        "--source", "simulated", "--simulated-file", str(stats), "--once",
    ]  # fmt: skip
    os.chmod(token_file, 0o644)
    refused = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "chmod 600" in refused.stderr, refused.stderr  # a token others read
    os.chmod(token_file, 0o600)
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    wait_for(lambda: far_gpus(hub)[0]["utilization"] == 64.0, 10, "the node's reading in the grid")
    assert far_gpus(hub)[1]["utilization"] == 0.0  # a GPU not in the file reads as idle


@pytest.mark.hub
def test_on_slurm_the_nodes_samplers_decide_and_an_owners_busy_reports_do_not(tmp_path):
    """The same forgery on the test cluster: alice's server runs on a node, gpuhub's sampler on
    each node (root) reads its GPU idle, and her own 100 % reports keep nothing."""
    from . import slurmtools

    policy = (
        "c.GpuReclaim.check_seconds = 0.5\nc.GpuReclaim.warn_after_seconds = 3\n"
        "c.GpuReclaim.reclaim_after_seconds = 600\nc.GpuReclaim.stale_seconds = 4\n"
    )
    # the cluster's fake readings are another test run's too until this one has its turn
    with slurmtools.cluster_turn():
        slurmtools.UTIL_FILE.write_text("{}")  # every fake GPU idle
        with slurmtools.slurm_hub(tmp_path / "hub", policy) as hub:
            _alice_is_warned_whatever_she_reports(hub)


def _alice_is_warned_whatever_she_reports(hub):
    """Her own 100 % reports are taken, and she is warned of her idle GPU all the same."""
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice", timeout=120)
    token = hub.user_token("alice")
    [row] = hub.broker("GET", "utilization", token).json()["gpus"]
    gpu, allocation = row, row["holder"]["allocation_id"]
    # her own report: 100 % busy, at 1500 W
    body = {"gpus": [{"node": gpu["node"], "index": gpu["index"], "utilization": 100, "power_watts": 1500}]}

    def warned():
        r = hub.broker("POST", f"allocations/{allocation}/samples", token, json=body)
        assert r.status_code == 200, r.text  # her report is taken...
        return r.json()["idle"]["state"] == "warned"  # ...and she is warned all the same

    wait_for(warned, 60, "alice warned while she reports her idle GPU busy", interval=0.5)
    [row] = hub.broker("GET", "utilization", token).json()["gpus"]
    assert row["utilization"] == 0.0 and row["reported"] is not None, row

    # her energy is gpuhub's sampler's too: an idle simulated GPU's 60 W, not her 1500 W. The API
    # gives GPU-hours to 4 decimals (0.36 s) and kWh to 6: over 20 s measured, the watts read
    # from them are within 1.1 % of the meter's
    def energy():
        me = hub.broker("GET", "me", token).json()
        [mine] = [a for a in me["allocations"] if a["id"] == allocation]
        e = mine["energy"]
        return e if e and e["measured_gpu_hours"] * 3600 >= 20 else None

    e = wait_for(energy, 90, "alice's energy measured by gpuhub's sampler")
    watts = e["gpu_kwh"] * 3.6e6 / (e["measured_gpu_hours"] * 3600)
    assert watts == pytest.approx(60.0, rel=0.02) and e["idle_share"] == 1.0, e
    hub.stop_server("alice")
