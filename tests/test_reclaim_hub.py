"""Idle reclaim end to end: a real hub, proxy, broker and single-user servers on simulated
GPUs. Each server's own reporter (the Jupyter server extension the spawner enables) reads
the simulated NVML file the test writes and posts to the broker, exactly as it posts NVML
readings on a GPU machine; the broker judges, warns and reclaims."""

from __future__ import annotations

import json
import re
import socket
import threading
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest

from spawner.ledger import Ledger

from .hubtools import Hub, tidy, wait_for

pytestmark = pytest.mark.hub

POLICY = """
c.GpuHub.report_seconds = 0.5
c.GpuHub.simulated_utilization_file = {util_file!r}
c.GpuReclaim.check_seconds = 0.5
c.GpuReclaim.warn_after_seconds = 4
c.GpuReclaim.reclaim_after_seconds = 12
c.GpuReclaim.stale_seconds = 4
c.GpuReclaim.exempt_groups = {{"students"}}
c.GpuHub.user_limits = {{"alice": 2, "dave": 2}}
"""


# the demo's 4 simulated GPUs (on this machine's name)
ALL_BUSY = {f"{socket.gethostname()}:{i}": 50.0 for i in range(4)}


def set_utilization(path, table: dict[str, float]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps({k: {"utilization": v, "memory_used_mib": int(v * 100)} for k, v in table.items()})
    )
    tmp.replace(path)  # atomic: a reporter never reads half a file


def idle_state(hub: Hub, allocation_id: int) -> dict:
    grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
    [row] = [a for a in grid["allocations"] if a["id"] == allocation_id] or [{"idle": {"state": "gone"}}]
    return row["idle"]


@contextmanager
def reclaim_hub_in(workdir, extra_config: str = ""):
    """A hub with the short POLICY (plus ``extra_config``), its ledger and its utilization file."""
    util_file = workdir / "utilization.json"
    set_utilization(util_file, ALL_BUSY)  # nothing idles while the servers start
    config = POLICY.format(util_file=str(util_file)) + extra_config
    hub = Hub(workdir, extra_config=config).start().wait_for_broker()
    ledger = Ledger(hub.ledger_url)
    try:
        yield hub, ledger, util_file
    finally:
        hub.stop()
        ledger.close()


@pytest.fixture(scope="module")
def shared_reclaim_hub(tmp_path_factory):
    with reclaim_hub_in(tmp_path_factory.mktemp("reclaim")) as found:
        yield found


@pytest.fixture
def reclaim_hub(shared_reclaim_hub):
    """The module's hub, as a fresh one would be for what a test looks at: every GPU busy in
    the file, and afterwards no server, burst or waiting request left (reclaim records and
    GPU histories stay: the tests look at their own, and a new holder never sees the last
    holder's readings)."""
    hub, _ledger, util_file = shared_reclaim_hub
    set_utilization(util_file, ALL_BUSY)
    yield shared_reclaim_hub
    set_utilization(util_file, ALL_BUSY)
    tidy(hub, stop_servers=True)


def new_reclaims(hub, token, before: list[dict]) -> list[dict]:
    """The reclaim records the caller sees now that were not in ``before``."""
    seen = {r["id"] for r in before}
    return [r for r in hub.broker("GET", "reclaims", token).json()["reclaims"] if r["id"] not in seen]


def reclaims_counted(metrics: str) -> float:
    m = re.search(r'^gpuhub_reclaims_total{purpose="server"} ([0-9.]+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_an_idle_server_is_warned_then_stopped_a_busy_and_an_exempt_one_kept(reclaim_hub):
    hub, ledger, util_file = reclaim_hub
    admin = hub.user_token("admin")
    before = hub.broker("GET", "reclaims", admin).json()
    counted = reclaims_counted(hub.broker("GET", "../../metrics", admin).text)
    for user in ("alice", "dave", "bob"):  # bob is in "students": exempt
        assert hub.spawn(user, {"gpus": 1}).status_code in (201, 202)
    for user in ("alice", "dave", "bob"):
        hub.wait_ready(user)
    alloc = {user: ledger.active(user=user)[0] for user in ("alice", "dave", "bob")}
    busy_gpu = alloc["dave"].gpus[0].label
    set_utilization(util_file, {busy_gpu: 85.0})

    # the broker hears every server, from the server's own reports
    def reported():
        grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
        by_label = {f"{g['node']}:{g['index']}": g for g in grid["gpus"]}
        return by_label[busy_gpu]["utilization"] == 85.0 and all(
            by_label[a.gpus[0].label]["utilization"] is not None for a in alloc.values()
        )

    wait_for(reported, 30, "the servers' first reports")

    wait_for(lambda: idle_state(hub, alloc["alice"].id)["state"] == "warned", 30, "alice warned")
    warned = idle_state(hub, alloc["alice"].id)
    assert 0 < warned["reclaim_in_seconds"] <= 12 and "below 5% utilization" in warned["reason"]
    assert warned["since"].endswith("Z") and idle_state(hub, alloc["alice"].id)["since"] == warned["since"]
    # the owner sees the warning on /me (what %gpus and the user page show)
    me = hub.broker("GET", "me", hub.user_token("alice")).json()
    assert me["allocations"][0]["idle"]["state"] == "warned"
    # ... and the server's log says it
    wait_for(
        lambda: re.search(
            rf"allocation {alloc['alice'].id}: .* it will be reclaimed", hub.log_path.read_text()
        ),
        10,
        "log",
    )

    wait_for(lambda: ledger.get(alloc["alice"].id).state == "released", 40, "alice's server reclaimed")
    wait_for(lambda: hub.server("alice") is None, 30, "alice's server gone from the hub")
    assert idle_state(hub, alloc["dave"].id)["state"] == "active"  # busy GPU
    assert idle_state(hub, alloc["bob"].id)["state"] == "exempt"
    assert ledger.get(alloc["dave"].id).state == "running" and ledger.get(alloc["bob"].id).state == "running"

    # the reclaim is recorded (once) with its reason and the idle GPU-hours it ended
    recs = hub.broker("GET", "reclaims", admin).json()
    [rec] = new_reclaims(hub, admin, before["reclaims"])
    assert (rec["user"], rec["allocation_id"], rec["purpose"], rec["gpus"]) == (
        "alice",
        alloc["alice"].id,
        "server",
        1,
    )
    assert rec["idle_seconds"] >= 12 and rec["gpu_hours"] == pytest.approx(
        rec["idle_seconds"] / 3600, abs=1e-4
    )
    alice_before = before["users"].get("alice", {}).get("reclaims", 0)
    assert recs["users"]["alice"]["reclaims"] == alice_before + 1
    assert recs["total"]["reclaims"] == before["total"]["reclaims"] + 1
    # what it saved, estimated from its GPU's measured idle draw (a simulated idle GPU: 60 W),
    # for as long again as it had been idle (no time limit), never past now
    reclaimed = datetime.fromisoformat(rec["created"].rstrip("Z")).replace(tzinfo=UTC)
    after = (datetime.now(UTC) - reclaimed).total_seconds()
    ran_on = min(rec["idle_seconds"], after)
    assert rec["saved_kwh_estimate"] == pytest.approx(60.0 * ran_on / 3.6e6, rel=0.05, abs=2 * 60 / 3.6e6)
    [same] = [r for r in recs["reclaims"] if r["id"] == rec["id"]]  # one answer: one "now"
    assert recs["total"]["saved_kwh_estimate"] >= same["saved_kwh_estimate"] > 0
    # another user sees only their own
    assert hub.broker("GET", "reclaims", hub.user_token("dave")).json()["reclaims"] == []

    # the hub's home page tells alice why
    session = hub.login("alice")
    home = session.get(f"{hub.url}/hub/home").text
    assert "was stopped by gpuhub" in home and "stayed below 5% utilization" in home
    assert "was stopped by gpuhub" not in hub.login("dave").get(f"{hub.url}/hub/home").text
    # Prometheus
    metrics = hub.broker("GET", "../../metrics", hub.user_token("admin")).text
    assert re.search(r'gpuhub_gpu_utilization_percent{[^}]*user="dave"[^}]*} 85\.0', metrics)
    assert re.search(r'gpuhub_reclaimed_gpu_hours{user="alice"} [0-9.]+', metrics)
    assert reclaims_counted(metrics) == counted + 1

    # starting again clears the notice
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    wait_for(  # the notice is cached for 10 s per user
        lambda: "was stopped by gpuhub" not in session.get(f"{hub.url}/hub/home").text, 20, "the notice gone"
    )
    for user in ("alice", "dave", "bob"):
        hub.stop_server(user)


def test_use_resets_the_idle_clock_and_clears_the_warning(reclaim_hub):
    hub, ledger, util_file = reclaim_hub
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [a] = ledger.active(user="alice")
    assert idle_state(hub, a.id)["state"] in ("unknown", "active")
    set_utilization(util_file, {})
    wait_for(lambda: idle_state(hub, a.id)["state"] == "warned", 30, "alice warned")
    set_utilization(util_file, {a.gpus[0].label: 50.0})
    wait_for(lambda: idle_state(hub, a.id)["state"] == "active", 10, "the warning cleared by use")
    set_utilization(util_file, {})
    # idle again: warned again from zero, with the full notice, not on the old clock
    wait_for(lambda: idle_state(hub, a.id)["state"] == "warned", 30, "alice warned again")
    again = idle_state(hub, a.id)
    assert again["idle_seconds"] < 8 and again["reclaim_in_seconds"] >= 5, again
    assert ledger.get(a.id).state == "running"
    hub.stop_server("alice")


def test_an_idle_burst_pool_is_reclaimed_and_its_engines_stopped(reclaim_hub):
    """%%distributed on a 0-GPU server takes a burst; its engines report their own GPUs and
    the kernel its cells' activity. Idle, it is warned, reclaimed, and the engines stop."""

    import psutil

    from .test_distributed_hub import run

    hub, ledger, util_file = reclaim_hub
    before = hub.broker("GET", "reclaims", hub.user_token("alice")).json()["reclaims"]
    assert hub.spawn("alice", {"gpus": 0}).status_code in (201, 202)
    hub.wait_ready("alice")
    kc = hub.server_kernel("alice")
    try:
        status, out = run(kc, "%config DistributedMagics.lease_seconds = 12")
        assert status == "ok", out
        status, out = run(kc, "%%distributed --gpus 2\nimport os\nos.getpid()")
        assert status == "ok", out
        [burst] = ledger.active(user="alice")
        assert burst.purpose == "distributed" and len(burst.gpus) == 2
        status, out = run(kc, "%distributed status")
        pids = [int(p) for p in re.findall(r"pid (\d+), ", out)]
        assert len(pids) == 2, out

        # the engines' own reports reach the broker (busy while the file says so)
        def engines_reported():
            grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
            mine = [g for g in grid["gpus"] if g["holder"] and g["holder"]["allocation_id"] == burst.id]
            return len(mine) == 2 and all(g["utilization"] == 50.0 for g in mine)

        wait_for(engines_reported, 30, "the engines' reports")
        set_utilization(util_file, {})
        wait_for(lambda: idle_state(hub, burst.id)["state"] == "warned", 30, "the burst warned")
        me = hub.broker("GET", "me", hub.user_token("alice")).json()
        assert [a["idle"]["state"] for a in me["allocations"] if a["id"] == burst.id] == ["warned"]
        status, out = run(kc, "%gpus")  # the notebook shows the warning too
        assert f"WARNING: allocation #{burst.id}: its 2 GPUs stayed below 5%" in out, out
        assert re.search(
            rf"{re.escape(burst.gpus[0].label)} +0% busy, 0 MiB +allocation #{burst.id} \(burst\)", out
        ), out

        # a deadline, not a speed claim: on a loaded machine the kernel's news of its last cell
        # can reach the broker after a reclaim, which then undoes it and reclaims it again later
        wait_for(lambda: ledger.get(burst.id).state == "released", 120, "the burst reclaimed")
        assert ledger.get(burst.id).end_reason.startswith("reclaimed: its 2 GPUs stayed below 5%")
        # the kernel learns it at its next renewal and stops the engines
        wait_for(lambda: not any(psutil.pid_exists(p) for p in pids), 30, "the engines stopped")
        [rec] = new_reclaims(hub, hub.user_token("alice"), before)  # the burst's, once; not the server's
        assert (rec["allocation_id"], rec["purpose"], rec["gpus"]) == (burst.id, "distributed", 2)

        # the next cell works on a new burst
        set_utilization(util_file, ALL_BUSY)
        status, out = run(kc, "%%distributed --gpus 2\nrank")
        assert status == "ok", out
        [again] = ledger.active(user="alice")
        assert again.id != burst.id and again.purpose == "distributed"
        run(kc, "%distributed shutdown")
    finally:
        kc.stop_channels()
        hub.stop_server("alice")


def test_a_report_names_only_the_callers_own_live_allocation_and_its_gpus(reclaim_hub):
    hub, _ledger, _ = reclaim_hub
    alice, bob = hub.user_token("alice"), hub.user_token("bob")
    r = hub.broker("POST", "allocations", alice, json={"gpus": 1})
    assert r.status_code == 201, r.text
    burst = r.json()
    [gpu] = burst["gpus"]
    other = next(
        g
        for g in hub.broker("GET", "utilization", hub.user_token("admin")).json()["gpus"]
        if (g["node"], g["index"]) != (gpu["node"], gpu["index"])
    )
    sample = {"node": gpu["node"], "index": gpu["index"], "utilization": 50}
    path = f"allocations/{burst['id']}/samples"
    # another user cannot even learn it exists
    r = hub.broker("POST", path, bob, json={"gpus": [sample]})
    assert r.status_code == 404
    # a GPU that is not the allocation's
    r = hub.broker(
        "POST", path, alice, json={"gpus": [{**sample, "node": other["node"], "index": other["index"]}]}
    )
    assert r.status_code == 400 and r.json()["reason"] == "not_its_gpu", r.text
    # a malformed report
    r = hub.broker("POST", path, alice, json={"gpus": [{**sample, "utilization": 250}]})
    assert r.status_code == 400 and "from 0 to 100" in r.json()["message"]
    grid = hub.broker("GET", "utilization", alice).json()
    assert [g["reported"] for g in grid["gpus"]] == [None]  # nothing refused was recorded
    # the owner's report is taken (shown to her as hers) and answered with the idle state
    r = hub.broker("POST", path, alice, json={"gpus": [{**sample, "utilization": 37}], "idle_seconds": 0})
    assert r.status_code == 200 and r.json()["allocation_id"] == burst["id"], r.text
    [row] = hub.broker("GET", "utilization", alice).json()["gpus"]
    assert row["reported"]["utilization"] == 37.0
    wait_for(  # what decides is gpuhub's own reading of the GPU (the file says 50 %)
        lambda: hub.broker("GET", "utilization", alice).json()["gpus"][0]["utilization"] == 50.0,
        20,
        "the broker's own reading",
    )
    # once released, reports are refused: the reporter stops
    assert hub.broker("DELETE", f"allocations/{burst['id']}", alice).status_code == 200
    r = hub.broker("POST", path, alice, json={"gpus": [sample]})
    assert r.status_code == 409 and r.json()["reason"] == "released"


def test_a_waiting_spawn_counts_on_an_idle_reclaim_and_starts_when_it_comes(reclaim_hub):
    """The queue's expected start is the warned allocation's reclaim time (firm, not a guess
    from run lengths), and the head starts on the reclaimed GPUs within a poll of their release."""
    hub, ledger, util_file = reclaim_hub
    for user in ("alice", "dave"):
        assert hub.spawn(user, {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready(user)
    alice, dave = ledger.active(user="alice")[0], ledger.active(user="dave")[0]
    assert hub.spawn("bob", {"gpus": 2}).status_code == 202
    # nobody here has a finished run long enough to count: no hours are invented
    assert "cannot tell yet when it starts" in hub.wait_progress("bob", "1st of 1 waiting for 2 GPUs")

    set_utilization(util_file, {g.label: 85.0 for g in dave.gpus})  # alice's GPUs go idle
    wait_for(lambda: idle_state(hub, alice.id)["state"] == "warned", 30, "alice warned")
    line = hub.wait_progress("bob", "when a notice or an idle reclaim is due")
    assert line.startswith("1st of 1 waiting for 2 GPUs, expected start"), line
    [entry] = hub.broker("GET", "queue", hub.user_token("admin")).json()["queue"]
    assert entry["expected_sure"] == "firm"
    assert ledger.get(alice.id).idle_deadline is not None

    hub.wait_ready("bob", timeout=60)  # alice's server reclaimed: bob's turn
    assert ledger.get(alice.id).state == "released"
    [bobs] = ledger.active(user="bob")
    assert set(bobs.gpus) == set(alice.gpus)
    for user in ("bob", "dave"):
        hub.stop_server(user)


def test_an_owners_busy_reports_keep_no_idle_gpu_from_the_others(reclaim_hub):
    """alice's GPU sits idle; she reports it 100 % busy with her own token, twice a second, to
    keep it from whoever waits. What decides is gpuhub's own reading of it (the broker samples
    this machine's GPUs itself, c.GpuReclaim.readings = "sampler"): she is warned and her server
    stopped as if she had said nothing; she sees her own reports as hers. (With readings =
    "owners", the earlier way, her reports kept it busy for as long as she sent them.)"""
    hub, ledger, util_file = reclaim_hub
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [a] = ledger.active(user="alice")
    [gpu] = a.gpus
    token = hub.user_token("alice")
    stop, answers = threading.Event(), []

    def forge():
        body = {"gpus": [{"node": gpu.node, "index": gpu.index, "utilization": 100, "memory_used_mib": 9000}]}
        while not stop.wait(0.5):
            answers.append(hub.broker("POST", f"allocations/{a.id}/samples", token, json=body).status_code)

    forger = threading.Thread(target=forge, daemon=True)
    forger.start()
    try:
        set_utilization(util_file, {})  # what the GPU really does: nothing
        wait_for(lambda: idle_state(hub, a.id)["state"] == "warned", 40, "alice warned despite her reports")
        [row] = hub.broker("GET", "utilization", token).json()["gpus"]
        # gpuhub's reading decides; hers (the forger's 100 %, her server reporter's) are kept for her
        assert row["utilization"] == 0.0 and row["reported"]["utilization"] in (0.0, 100.0), row
        wait_for(lambda: ledger.get(a.id).state == "released", 60, "alice's idle server reclaimed")
    finally:
        stop.set()
        forger.join(30)
    assert answers.count(200) >= 3, answers  # her reports were taken, and decided nothing
    reclaims = hub.broker("GET", "reclaims", hub.user_token("admin")).json()["reclaims"]
    [rec] = [r for r in reclaims if r["allocation_id"] == a.id]
    assert rec["user"] == "alice" and "below 5% utilization" in rec["reason"], rec
    wait_for(lambda: hub.server("alice") is None, 30, "alice's server gone from the hub")
