"""The Slurm backend's own behaviour, on the real test cluster (``scripts/slurm-cluster``):
queueing, jobs ended outside gpuhub, a controller outage, restart reconcile, and limits
inside Slurm's accounting. The spawn tests shared with the local backend are in
``test_hub_local.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from spawner.ledger import Ledger
from spawner.policy.limits import Limit

from . import slurmtools
from .hubtools import wait_for, xsrf_from
from .slurmtools import UTIL_FILE, job_state, slurm

pytestmark = pytest.mark.hub
STATE = slurmtools.STATE_DIR


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with slurmtools.slurm_hub(
        tmp_path_factory.mktemp("slurmhub"),
        "c.JupyterHub.cleanup_servers = False\nc.GpuHub.extension_max_hours = 1",
    ) as h:
        yield h


@pytest.fixture
def ledger(hub):
    led = Ledger(hub.ledger_url)
    yield led
    for user in slurmtools.USERS:
        led.unset_limit("user", user)
    led.close()


@pytest.fixture
def clean(hub):
    yield
    for user in slurmtools.USERS:
        r = hub.api("GET", f"/users/{user}")
        if r.status_code == 200 and r.json()["servers"]:
            hub.stop_server(user)
    slurmtools.cancel_all_jobs()


def holders(ledger):
    return {st.gpu.label: st.holder.user for st in ledger.gpu_table() if st.holder}


def progress_until(hub, user: str, words: list[str], timeout: float = 60) -> list[str]:
    """Read the spawn page's progress stream until a message has all ``words``."""
    seen = []
    with requests.get(
        f"{hub.url}/hub/api/users/{user}/server/progress",
        headers={"Authorization": f"token {hub.token}"},
        stream=True,
        timeout=timeout,
    ) as r:
        deadline = time.monotonic() + timeout
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data:"):
                seen.append(json.loads(line[5:]).get("message", ""))
                if all(w in seen[-1] for w in words):
                    return seen
            if time.monotonic() > deadline:
                break
    raise AssertionError(f"no progress message with {words}; saw {seen}")


def test_a_full_cluster_queues_shows_why_and_starts_when_gpus_free(hub, ledger, clean):
    ledger.set_limit("user", "alice", Limit(max_gpus=4))
    ledger.set_limit("user", "bob", Limit(max_gpus=4))
    for user in ("alice", "bob"):
        assert hub.spawn(user, {"gpus": 4}).status_code in (201, 202)
    for user in ("alice", "bob"):
        hub.wait_ready(user, timeout=120)
    assert len(holders(ledger)) == 8

    # carol's request fits her limit but not the cluster now: it waits in Slurm's queue
    r = hub.spawn("carol", {"gpus": 2})
    assert r.status_code == 202, r.text
    messages = progress_until(
        hub, "carol", ["Queued in Slurm", "Resources", "in partition gpu: 1st of 1 waiting for 2 GPUs"]
    )
    [pending] = ledger.active(user="carol")
    assert pending.state == "starting" and pending.gpus == () and pending.gpu_count == 2
    assert job_state(pending.backend_job_id) == "PENDING"
    assert any("Admitted 2 GPUs" in m for m in messages)
    # the queued request counts against carol's limit (students: 2) at once
    assert ledger.allowance("carol", ["students"]).may_take == 0

    # dave queues too, and stops while pending: his job is cancelled, nothing is held
    assert hub.spawn("dave", {"gpus": 1}).status_code == 202
    progress_until(hub, "dave", ["Queued in Slurm"])
    [dave] = ledger.active(user="dave")
    hub.stop_server("dave")
    wait_for(
        lambda: job_state(dave.backend_job_id) in ("CANCELLED", "GONE"), 30, "dave's job to be cancelled"
    )
    assert ledger.get(dave.id).state == "released"

    # alice stops: carol's job starts on the GPUs alice had
    alice_gpus = {g.label for g in ledger.active(user="alice")[0].gpus}
    hub.stop_server("alice")
    hub.wait_ready("carol", timeout=120)
    [running] = ledger.active(user="carol")
    assert running.state == "running" and {g.label for g in running.gpus} <= alice_gpus
    env = slurmtools.process_environ(hub.server_pid("carol"))
    assert {f"{env['SLURMD_NODENAME']}:{i}" for i in env["SLURM_JOB_GPUS"].split(",")} == {
        g.label for g in running.gpus
    }


def test_a_job_cancelled_outside_gpuhub_frees_its_gpus(hub, ledger, clean):
    assert hub.spawn("bob", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("bob")
    [alloc] = ledger.active(user="bob")
    slurm("scancel", alloc.backend_job_id)
    wait_for(lambda: ledger.get(alloc.id).state == "released", 30, "the watcher to release bob's GPUs")
    assert "ended" in ledger.get(alloc.id).end_reason or "gone" in ledger.get(alloc.id).end_reason
    wait_for(lambda: hub.server("bob") is None, 60, "the hub to notice bob's server is gone")
    assert holders(ledger) == {}


def test_a_controller_outage_declares_no_server_dead(hub, ledger, clean):
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [alloc] = ledger.active(user="alice")
    pid = int((STATE / "run" / "slurmctld.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    wait_for(lambda: slurm("squeue", "-h", check=False).returncode != 0, 30, "slurmctld to be down")
    try:
        failures_before = hub.log_path.read_text().count("squeue failed")
        deadline = time.monotonic() + 120

        def still_alive() -> None:
            assert hub.server("alice")["ready"], "the hub declared alice's server dead"
            assert ledger.get(alloc.id).state == "running"

        # the outage itself: until two of the watcher's rounds in a row found no controller (each
        # squeue gives up after Slurm's MessageTimeout), the server looked at every second
        while hub.log_path.read_text().count("squeue failed") < failures_before + 2:
            still_alive()
            assert time.monotonic() < deadline, "the watcher ran no squeue during the outage"
            time.sleep(1)
        still_alive()  # and after the second failed round
    finally:
        subprocess.run([str(slurmtools.SCRIPT), "start"], check=True, capture_output=True)
    wait_for(lambda: "squeue answers again" in hub.log_path.read_text(), 60, "the watcher to recover")
    assert hub.server("alice")["ready"] and ledger.get(alloc.id).state == "running"
    assert job_state(alloc.backend_job_id) == "RUNNING"
    hub.stop_server("alice")
    assert ledger.get(alloc.id).state == "released"


def test_a_restarted_hub_reconciles_with_squeue(hub, ledger, clean):
    for user in ("alice", "bob"):
        assert hub.spawn(user, {"gpus": 2}).status_code in (201, 202)
    for user in ("alice", "bob"):
        hub.wait_ready(user)
    [alice] = ledger.active(user="alice")
    [bob] = ledger.active(user="bob")
    hub.stop()  # cleanup_servers = False: the jobs keep running
    assert job_state(alice.backend_job_id) == "RUNNING"
    slurm("scancel", bob.backend_job_id)  # bob's job ends while nobody watches
    wait_for(lambda: job_state(bob.backend_job_id) != "RUNNING", 30, "bob's job to end")
    assert ledger.get(bob.id).state == "running"  # nobody told the ledger yet
    hub.start()
    wait_for(lambda: ledger.get(bob.id).state == "released", 60, "the restarted hub to release bob's GPUs")
    wait_for(lambda: hub.server("bob") is None, 60, "the hub to drop bob's server")
    kept = ledger.get(alice.id)
    assert kept.state == "running" and kept.gpus == alice.gpus
    assert hub.server("alice")["ready"] and hub.job_id("alice") == alice.backend_job_id


def test_limits_reach_slurm_accounting(hub, ledger, clean):
    gpuhub = [str(Path(sys.executable).with_name("gpuhub")), "-f", str(hub.dir / "jupyterhub_config.py")]
    r = subprocess.run([*gpuhub, "limits", "set", "--user", "alice", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    try:
        _limits_bound_plain_sbatch(gpuhub)
    finally:
        subprocess.run([*gpuhub, "limits", "unset", "--user", "alice"], capture_output=True)


def _limits_bound_plain_sbatch(gpuhub):
    assoc = slurm("sacctmgr", "-n", "-P", "show", "assoc", "user=alice", "format=grptres").stdout
    assert "gres/gpu=2" in assoc
    job = "#!/bin/bash\nsleep 300\n"
    sbatch = ["sbatch", "--parsable", "--job-name=gpuhub-test", "-o", "/dev/null", "--chdir=/tmp"]
    # a plain sbatch from a terminal is bounded too: 3 GPUs at once is refused outright
    over = slurm(*sbatch, "--gres=gpu:3", user="alice", input=job, check=False)
    assert over.returncode != 0 and "AssocGrpGRES" in over.stderr, over.stderr
    # two 1-GPU jobs run; the third waits on the association's GPU limit
    ids = [slurm(*sbatch, "--gres=gpu:1", user="alice", input=job).stdout.strip() for _ in range(3)]
    wait_for(lambda: [job_state(i) for i in ids[:2]] == ["RUNNING", "RUNNING"], 30, "two jobs to run")
    reason = lambda: slurm("squeue", "-h", "-j", ids[2], "-o", "%T %r").stdout.strip()  # noqa: E731
    wait_for(lambda: reason() == "PENDING AssocGrpGRES", 30, "the third job to wait on the limit")
    # unset returns alice to her config limit (3), in Slurm as well
    r = subprocess.run([*gpuhub, "limits", "unset", "--user", "alice"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (
        "gres/gpu=3" in slurm("sacctmgr", "-n", "-P", "show", "assoc", "user=alice", "format=grptres").stdout
    )
    wait_for(lambda: job_state(ids[2]) == "RUNNING", 30, "the third job to start under the new limit")


def test_a_limit_changed_outside_gpuhub_is_put_back_when_slurm_refuses_the_next_job(hub, ledger, clean):
    """A repeat spawn trusts what the hub last found in the user's association (no sacctmgr
    before sbatch); an operator's sacctmgr that cuts alice's GPUs to 0 makes Slurm refuse her
    next job, and the hub then reads and writes her association again and submits once more."""
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice", timeout=120)
    hub.stop_server("alice")
    assert grp_gpus("alice") == "gres/gpu=3"  # the demo's limit for alice, written at her spawn
    slurmtools.set_slurm_gpus("alice", 0)
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice", timeout=120)
    assert grp_gpus("alice") == "gres/gpu=3"
    log = hub.log()
    assert "Slurm refused alice's job" in log and "checking their association again" in log, log[-3000:]
    hub.stop_server("alice")


def grp_gpus(user: str) -> str:
    out = slurm(
        "sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "account=gpuhub", "format=grptres"
    ).stdout
    return out.strip()


def test_limits_set_through_the_broker_reach_slurm(hub, ledger, clean):
    # carol is seen by the hub (a spawn records her groups), then her group's limit changes
    assert hub.spawn("carol", {"gpus": 0}).status_code in (201, 202)
    hub.wait_ready("carol")
    assert grp_gpus("carol") == "gres/gpu=2"  # students: 2, written before her first job
    hub.wait_for_broker()
    admin = hub.user_token("admin")
    r = hub.broker("PUT", "limits/group/students", admin, json={"max_gpus": 1})
    assert r.status_code == 200, r.text
    assert grp_gpus("carol") == "gres/gpu=1"
    r = hub.broker("DELETE", "limits/group/students", admin)
    assert r.status_code == 204, r.text
    assert grp_gpus("carol") == "gres/gpu=2"


def test_the_form_offers_partitions_and_a_partition_is_honoured(hub, ledger, clean):
    browser = hub.login("bob")
    page = browser.get(f"{hub.url}/hub/spawn").text
    assert 'name="partition"' in page
    assert '<option value="gpu" data-free="8" selected>' in page
    assert '<option value="interactive" data-free="4"' in page
    assert "waits in the queue" in page
    # a partition that does not exist is refused before anything reaches Slurm
    r = hub.spawn("bob", {"gpus": 1, "partition": "nope"})
    assert r.status_code == 400 and "Partitions: gpu, interactive" in r.json()["message"]
    assert ledger.active(user="bob") == []
    # "interactive" has only gpu-node1: the job lands there
    posted = browser.post(
        f"{hub.url}/hub/spawn",
        data={"gpus": "2", "partition": "interactive", "_xsrf": xsrf_from(page)},
        allow_redirects=False,
    )
    assert posted.status_code == 302, posted.text[-1000:]
    hub.wait_ready("bob")
    [alloc] = ledger.active(user="bob")
    assert {g.node for g in alloc.gpus} == {"gpu-node1"}
    assert slurm("squeue", "-h", "-j", alloc.backend_job_id, "-o", "%P").stdout.strip() == "interactive"

    # the server reports its GPUs' use from its Slurm node, as the job's user
    first, second = (g.label for g in alloc.gpus)
    UTIL_FILE.write_text(json.dumps({first: {"utilization": 64, "memory_used_mib": 2048}}))
    UTIL_FILE.chmod(0o644)

    def reported():
        grid = {
            f"{g['node']}:{g['index']}": g
            for g in hub.broker("GET", "utilization", hub.user_token("admin")).json()["gpus"]
        }
        return grid[first]["utilization"] == 64.0 and grid[second]["utilization"] == 0.0

    wait_for(reported, 30, "bob's Slurm server to report its GPUs")
    [row] = hub.broker("GET", "utilization", hub.user_token("admin")).json()["users"]
    assert (row["user"], row["gpus"]) == ("bob", 2) and 0 < row["mean_utilization"] <= 32


def test_the_port_callback_takes_only_a_port_from_the_servers_own_token(hub, ledger, clean):
    assert hub.spawn("dave", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("dave")
    env = slurmtools.process_environ(hub.server_pid("dave"))
    token = env["JUPYTERHUB_API_TOKEN"]
    url = f"{hub.url}/hub/api/batchspawner"
    headers = {"Authorization": f"token {token}"}
    [alloc] = ledger.active(user="dave")
    # batchspawner's own handler would set any attribute: here the job id and allocation
    bad = requests.post(
        url, headers=headers, json={"port": 1234, "job_id": "1", "allocation_id": 0}, timeout=10
    )
    assert bad.status_code == 400
    assert requests.post(url, headers=headers, json={"port": "1"}, timeout=10).status_code == 400
    # a running server's port is settled
    assert requests.post(url, headers=headers, json={"port": 1234}, timeout=10).status_code == 409
    # another user's token is not a server token of dave's
    other = requests.post(
        url, headers={"Authorization": f"token {hub.user_token('dave')}"}, json={"port": 1}, timeout=10
    )
    assert other.status_code == 403
    state = hub.server("dave")["state"]
    assert state["job_id"] == alloc.backend_job_id and state["gpuhub_allocation_id"] == alloc.id
    assert hub.server("dave")["ready"]


def test_a_spawn_still_queued_when_the_hub_restarts_leaves_nothing_behind(hub, ledger, clean):
    ledger.set_limit("user", "alice", Limit(max_gpus=8))
    assert hub.spawn("alice", {"gpus": 8, "partition": "gpu"}).status_code == 400  # one node has 4
    for user in ("alice", "bob"):
        ledger.set_limit("user", user, Limit(max_gpus=4))
        assert hub.spawn(user, {"gpus": 4}).status_code in (201, 202)
    for user in ("alice", "bob"):
        hub.wait_ready(user, timeout=120)
    assert hub.spawn("carol", {"gpus": 1}).status_code == 202
    progress_until(hub, "carol", ["Queued in Slurm"])
    [queued] = ledger.active(user="carol")
    assert job_state(queued.backend_job_id) == "PENDING"
    hub.stop()  # JupyterHub cannot resume a pending spawn: the restarted hub must clean it up
    hub.start()
    wait_for(lambda: ledger.get(queued.id).state == "released", 90, "carol's queued count to be released")
    wait_for(
        lambda: job_state(queued.backend_job_id) in ("CANCELLED", "GONE"), 60, "carol's job to be cancelled"
    )
    wait_for(lambda: hub.server("carol") is None, 90, "the hub to drop carol's server")
    assert {a.user for a in ledger.active()} == {"alice", "bob"}  # the running servers are kept
    assert hub.server("alice")["ready"] and hub.server("bob")["ready"]


def test_a_burst_takes_only_its_own_users_tagged_engines_job(hub, ledger, clean):
    hub.wait_for_broker()
    # bursts come from a server's kernel: alice has a server (without GPUs of its own)
    assert hub.spawn("alice", {"gpus": 0}).status_code in (201, 202)
    hub.wait_ready("alice")
    alice = hub.user_token("alice")
    r = hub.broker("POST", "allocations", alice, json={"gpus": 1})
    assert r.status_code == 201, r.text
    burst = r.json()
    assert burst["gpus"] == [] and burst["gpu_count"] == 1 and burst["state"] == "starting"  # Slurm places it

    def submit(user, name, tag):
        script = "#!/bin/bash\nsleep 300\n"
        argv = ["sbatch", "--parsable", f"--job-name={name}", f"--comment={tag}", "--gres=gpu:1"]
        argv += ["-o", "/dev/null", "--chdir=/tmp"]
        return slurm(*argv, user=user, input=script).stdout.strip()

    tag = f"gpuhub:{burst['id']}"
    refused = [
        (submit("bob", "gpuhub-engines", tag), "another user's job"),
        (submit("alice", "something-else", tag), "not an engines job"),
        (submit("alice", "gpuhub-engines", "gpuhub:999999"), "tagged for another allocation"),
    ]
    for job, why in refused:
        r = hub.broker("POST", f"allocations/{burst['id']}/job", alice, json={"job_id": job})
        assert r.status_code == 400 and r.json()["reason"] == "bad_job", why
    assert ledger.get(burst["id"]).backend_job_id is None
    # done with them: alice's would otherwise hold GPUs of her Slurm limit (AssocGrpGRES)
    slurm("scancel", *(job for job, _ in refused))
    mine = submit("alice", "gpuhub-engines", tag)
    r = hub.broker("POST", f"allocations/{burst['id']}/job", alice, json={"job_id": mine})
    assert r.status_code == 200 and r.json()["backend_job_id"] == mine
    other = submit("alice", "gpuhub-engines", tag)  # a second job for the same burst: refused...
    r = hub.broker("POST", f"allocations/{burst['id']}/job", alice, json={"job_id": other})
    assert r.status_code == 409 and r.json()["reason"] == "has_job"
    # ...and, tagged with a burst that runs another job, cancelled by the watcher
    wait_for(lambda: job_state(other) in ("CANCELLED", "GONE"), 30, "the stray job to be cancelled")
    wait_for(lambda: job_state(mine) == "RUNNING", 30, "the burst's own job to run")  # kept, not cancelled
    wait_for(lambda: len(ledger.get(burst["id"]).gpus) == 1, 30, "the burst's GPU to be recorded")
    assert hub.broker("DELETE", f"allocations/{burst['id']}", alice).status_code == 200
    wait_for(lambda: job_state(mine) in ("CANCELLED", "GONE"), 30, "the released burst's job to be cancelled")


def test_a_sessions_time_limit_is_its_jobs_time_limit(hub, ledger, clean):
    """A spawn asking for 1.5 h (no longest is set here) runs as a job with ``--time=90``:
    Slurm itself ends it then, whatever happens to the hub. An extension raises the job's
    TimeLimit (the hub may; bob could not), and one past the cap changes neither."""
    assert hub.spawn("bob", {"gpus": 1, "hours": 1.5}).status_code in (201, 202)
    hub.wait_ready("bob")
    [alloc] = ledger.active(user="bob")
    assert alloc.time_limit_seconds == 5400
    shown = slurm("scontrol", "show", "job", alloc.backend_job_id).stdout
    assert "TimeLimit=01:30:00" in shown, shown
    bob = hub.user_token("bob")
    r = hub.broker("POST", f"allocations/{alloc.id}/extend", bob, json={"hours": 0.5})
    assert r.status_code == 200 and r.json()["extension"]["by"] == "bob", r.text
    shown = slurm("scontrol", "show", "job", alloc.backend_job_id).stdout
    assert "TimeLimit=02:00:00" in shown, shown
    assert ledger.get(alloc.id).time_limit_seconds == 7200
    r = hub.broker("POST", f"allocations/{alloc.id}/extend", bob, json={"hours": 1})  # past the 1 h cap
    assert r.status_code == 403 and "ask for 30 min or less" in r.json()["message"], r.text
    assert "TimeLimit=02:00:00" in slurm("scontrol", "show", "job", alloc.backend_job_id).stdout
    # bob himself cannot raise it past what the hub granted: Slurm lets only its operators
    own = slurm(
        "scontrol", "update", f"JobId={alloc.backend_job_id}", "TimeLimit=600", user="bob", check=False
    )
    assert own.returncode != 0, own
    assert "TimeLimit=02:00:00" in slurm("scontrol", "show", "job", alloc.backend_job_id).stdout
