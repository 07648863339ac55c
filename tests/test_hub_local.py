"""End to end on a real JupyterHub + configurable-http-proxy, once per backend.

The same test bodies run with the local GPU spawner (the demo: 4 simulated GPUs on this
machine) and with the Slurm spawner on the real test cluster (2 nodes of 4 fake GPUs,
``scripts/slurm-cluster``); alice may hold 3, bob and carol 2 as students, dave 1. What a
server got is read from the running server process (``/proc``), not from the spawner.
The first (spawns through the API and the form, the queue, a release) runs once more on a
hub whose ledger is a PostgreSQL database (``scripts/postgres``).
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from spawner.ledger import Ledger

from . import dbtools, slurmtools
from .hubtools import Hub, wait_for, xsrf_from

pytestmark = pytest.mark.hub


@pytest.fixture(scope="module", params=["local", "slurm"])
def hub(request, tmp_path_factory):
    if request.param == "slurm":
        with slurmtools.slurm_hub(tmp_path_factory.mktemp("slurmhub")) as h:
            h.backend, h.total, h.models = "slurm", 8, "a100"
            yield h
        return
    h = Hub(tmp_path_factory.mktemp("hub")).start()
    h.backend, h.total, h.models = "local", 4, "Simulated A100"
    yield h
    h.stop()


@pytest.fixture
def clean(hub):
    """Every test starts and ends with no servers running."""
    yield
    for user in ("alice", "bob", "carol", "dave"):
        r = hub.api("GET", f"/users/{user}")
        if r.status_code == 200 and r.json()["servers"]:
            for name in r.json()["servers"]:
                hub.stop_server(user, name)


def holders(ledger):
    return {st.gpu.label: st.holder.user for st in ledger.gpu_table() if st.holder}


def visible(env):
    """The GPUs a server process sees, as node:index (Slurm: the node's own indices)."""
    if "SLURM_JOB_GPUS" in env:
        return {f"{env['SLURMD_NODENAME']}:{i}" for i in env["SLURM_JOB_GPUS"].split(",") if i}
    return {f"{env['GPUHUB_NODE']}:{i}" for i in env["CUDA_VISIBLE_DEVICES"].split(",") if i}


def test_rest_and_form_spawns_get_their_own_gpus(hub, ledger, clean):
    spawns_get_their_own_gpus(hub, ledger)


@pytest.fixture
def postgres_hub(tmp_path):
    with dbtools.postgres_database() as url:
        h = Hub(tmp_path / "hub", ledger_url=url).start()
        h.backend, h.total, h.models = "local", 4, "Simulated A100"
        yield h
        h.stop()


def test_a_hub_on_a_postgresql_ledger_spawns_queues_and_frees(postgres_hub):
    ledger = Ledger(postgres_hub.ledger_url)
    try:
        spawns_get_their_own_gpus(postgres_hub, ledger)
    finally:
        ledger.close()


def spawns_get_their_own_gpus(hub, ledger):
    # alice through the REST API
    r = hub.spawn("alice", {"gpus": 2})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("alice")

    # carol through the HTML form, logged in through the real login page
    browser = hub.login("carol")
    page = browser.get(f"{hub.url}/hub/spawn")
    assert page.status_code == 200
    assert re.search(rf'data-gpuhub="free">{hub.total - 2}<', page.text)  # alice holds 2
    assert re.search(r'data-gpuhub="fits">2<', page.text)  # carol: students limit 2
    posted = browser.post(
        f"{hub.url}/hub/spawn",
        data={"gpus": "2", "_xsrf": xsrf_from(page.text)},
        allow_redirects=False,
    )
    assert posted.status_code == 302, posted.text[-2000:]
    hub.wait_ready("carol")

    alice, carol = hub.server_env("alice"), hub.server_env("carol")
    assert len(visible(alice)) == 2 and len(visible(carol)) == 2
    assert not visible(alice) & visible(carol)
    for env in (alice, carol):
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        allocation = ledger.get(int(env["GPUHUB_ALLOCATION_ID"]))
        assert allocation.state == "running"
        assert {g.label for g in allocation.gpus} == visible(env)
        if hub.backend == "local":
            assert allocation.cuda_visible_devices == env["CUDA_VISIBLE_DEVICES"]
            assert allocation.backend_job_id == str(hub.server_pid(allocation.user))
        else:
            assert allocation.backend_job_id == env["SLURM_JOB_ID"] == hub.job_id(allocation.user)
    assert sorted(holders(ledger).values()) == ["alice", "alice", "carol", "carol"]
    if hub.backend == "slurm":
        hub.stop_server("alice")
        assert sorted(holders(ledger).values()) == ["carol", "carol"]
        return  # a full Slurm cluster queues instead of refusing: test_hub_slurm.py

    # the machine is full: dave waits in the queue, holding nothing, his place shown
    before = holders(ledger)
    r = hub.spawn("dave", {"gpus": 1})
    assert r.status_code == 202, r.text
    line = hub.wait_progress("dave", "waiting for 1 GPU")
    assert line.startswith("1st of 1 waiting for 1 GPU"), line
    assert holders(ledger) == before
    assert not hub.server("dave")["ready"]

    # stopping alice frees 2: dave's turn comes, and the form shows what is left free
    hub.stop_server("alice")
    hub.wait_ready("dave")
    assert sorted(holders(ledger).values()) == ["carol", "carol", "dave"]
    page = hub.login("bob").get(f"{hub.url}/hub/spawn")
    assert re.search(rf'data-gpuhub="free">{hub.total - 3}<', page.text)
    hub.stop_server("dave")


def test_over_the_limit_is_refused_with_the_message(hub, ledger, clean):
    r = hub.spawn("dave", {"gpus": 2})
    assert r.status_code == 403, r.text
    msg = r.json()["message"]
    assert (
        "You asked for 2 GPUs, but you hold 0 of a limit of 1 (default): your limit lets you hold 1 more GPU"
        in msg
    )
    assert holders(ledger) == {}
    # and on the spawn page, in the form, without a traceback
    browser = hub.login("dave")
    page = browser.get(f"{hub.url}/hub/spawn")
    r = browser.post(f"{hub.url}/hub/spawn", data={"gpus": "2", "_xsrf": xsrf_from(page.text)})
    assert r.status_code == 403
    assert "your limit lets you hold 1 more GPU. Ask for 1 or fewer." in r.text
    assert "Traceback" not in r.text
    assert 'id="gpuhub-gpus"' in r.text  # the form is shown again
    assert holders(ledger) == {} and hub.server("dave") is None


@pytest.mark.parametrize(
    "options, status, words",
    [
        ({"gpus": "abc"}, 400, "must be a whole number from 0 to 4096; got 'abc'"),
        ({"gpus": -1}, 400, "from 0 to 4096; got -1"),
        ({"gpus": 2.5}, 400, "must be a whole number"),
        ({"gpus": True}, 400, "must be a whole number"),
        ({"gpus": None}, 400, "must be a whole number"),
        ({"gpus": 99}, 400, "has at most 4"),
        ({"gpus": 1, "gpu_model": "H100"}, 400, "no GPU model 'H100' here. Models here: {models}"),
        ({"gpus": 1, "cpus": 64}, 400, "Unknown option 'cpus'"),
        ({"gpus": [1, 2]}, 400, "one value per option"),
    ],
)
def test_bad_rest_user_options_are_refused(hub, ledger, clean, options, status, words):
    before = holders(ledger)
    r = hub.spawn("bob", options)
    # a refusal answers 400 at once, unless the machine is so loaded that the start outlived the
    # POST's wait: then the hub answers 201/202 and the refusal ends the start's progress
    if r.status_code < 300:
        assert status == 400
    else:
        assert r.status_code == status, r.text
    assert words.format(models=hub.models) in hub.refusal(r, "bob")
    assert holders(ledger) == before
    wait_for(lambda: hub.server("bob") is None, 30, "the refused start to be cleared")
    assert ledger.active(user="bob") == []


@pytest.mark.parametrize(
    "form, words",
    [
        ({"gpus": "two"}, "must be a whole number from 0 to 4096; got 'two'"),
        ({"gpus": "-3"}, "from 0 to 4096; got -3"),
        ({"gpus": "1", "gpu_model": "<b>H100</b>"}, "no GPU model '<b>H100</b>' here"),
        ({"gpus": "1", "extra": "x"}, "Unknown option 'extra'"),
    ],
)
def test_hand_crafted_form_posts_are_refused(hub, ledger, clean, form, words):
    browser = hub.login("bob")
    page = browser.get(f"{hub.url}/hub/spawn")
    r = browser.post(f"{hub.url}/hub/spawn", data={**form, "_xsrf": xsrf_from(page.text)})
    assert "<b>H100</b>" not in r.text  # escaped, never rendered
    # 400 with the form shown again, or (a refusal after the form's 1 s wait, on a loaded
    # machine) the spawn-pending page, whose progress ends with the refusal
    assert r.status_code in (200, 400), r.text
    if r.status_code == 200:
        assert "/spawn-pending/bob" in r.url, r.url
    assert words in hub.refusal(r, "bob")
    assert holders(ledger) == {}
    wait_for(lambda: hub.server("bob") is None, 30, "the refused start to be cleared")


def test_zero_gpus_hides_every_gpu(hub, ledger, clean):
    assert hub.spawn("dave", {"gpus": 0}).status_code in (201, 202)
    hub.wait_ready("dave")
    env = hub.server_env("dave")
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["GPUHUB_ALLOCATION_ID"] == ""
    assert not env.get("SLURM_JOB_GPUS")
    assert holders(ledger) == {}


def test_a_dead_server_gives_its_gpus_back(hub, ledger, clean):
    import os
    import signal

    assert hub.spawn("bob", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("bob")
    os.kill(hub.server_pid("bob"), signal.SIGKILL)
    # the hub's poll notices the dead server: the GPUs come back without anyone stopping it
    wait_for(lambda: holders(ledger) == {}, 90, "the ledger to release bob's GPUs")
    assert ledger.active(user="bob") == []


def test_a_limit_set_with_the_cli_wins_on_the_next_spawn(hub, ledger, clean):
    gpuhub = [str(Path(sys.executable).with_name("gpuhub")), "-f", str(hub.dir / "jupyterhub_config.py")]
    assert hub.spawn("dave", {"gpus": 2}).status_code == 403  # default limit 1
    subprocess.run([*gpuhub, "limits", "set", "--user", "dave", "2"], check=True, capture_output=True)
    try:
        assert hub.spawn("dave", {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready("dave")
        assert len(visible(hub.server_env("dave"))) == 2
    finally:
        subprocess.run([*gpuhub, "limits", "unset", "--user", "dave"], check=True, capture_output=True)
