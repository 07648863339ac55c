"""When the cluster is full, on the real test cluster: Slurm's own scheduler, configured with
gpuhub's fair share (``scripts/slurm-cluster``: priority/multifactor with slurmdbd), orders
two users' pending jobs by their recent GPU use; the spawn page shows a queued server's place
and Slurm's own expected start (what ``squeue --start`` says for that job); a ``%%distributed``
burst waits in Slurm's queue with the same line in its cell, and Ctrl-C while it waits
leaves nothing held. Pure parts: test_slurm_queue_units.py."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime

import pytest

from spawner.ledger import Ledger
from spawner.policy.fairshare import Weights
from spawner.policy.limits import Limit
from spawner.policy.waitline import utc_clock
from spawner.settings import GpuHub
from spawner.slurm import priority, squeue

from . import slurmtools
from .hubtools import DEMO_PASSWORD, wait_for
from .slurmtools import job_state, slurm, slurm_cluster_turn  # noqa: F401 (pytestmark)
from .test_distributed_slurm import kernel_of
from .test_hub_slurm import progress_until

pytestmark = [pytest.mark.hub, pytest.mark.usefixtures("slurm_cluster_turn")]

HEAVY, LIGHT = "erin", "frank"  # this test's own users: their usage starts from nothing


def squeue_json() -> dict[str, dict]:
    out = slurm("squeue", "--json").stdout
    return {str(j["job_id"]): j for j in json.loads(out)["jobs"]}


def sbatch(*args: str, user: str | None = None) -> str:
    argv = ["sbatch", "--parsable", "-J", "gpuhub-test", "-o", "/dev/null", *args]
    return slurm(*argv, user=user, input="#!/bin/sh\nsleep 600\n").stdout.strip().split(";")[0]


def hold_all_gpus() -> list[str]:
    """Root's jobs on every GPU, with a time limit (so Slurm can estimate when they end)."""
    held = [sbatch("-w", node, "--gres=gpu:4", "--time=10") for node in ("gpu-node1", "gpu-node2")]
    wait_for(lambda: all(job_state(j) == "RUNNING" for j in held), 30, "root's jobs to hold every GPU")
    return held


def fairshare(user: str) -> float:
    out = slurm("sshare", "-n", "-P", "-A", "gpuhub", "-u", user, "-o", "User,FairShare").stdout
    [value] = [line.split("|")[1] for line in out.splitlines() if line.split("|")[0] == user]
    return float(value)


def test_the_cluster_runs_gpuhubs_fair_share_settings():
    slurmtools.require_cluster()
    out = slurm("scontrol", "show", "config").stdout
    conf = {k.strip().lower(): v.strip() for k, _, v in (line.partition("=") for line in out.splitlines())}
    weights = GpuHub().queue_weights()
    assert weights == Weights()  # the test cluster follows gpuhub's defaults
    want = priority.slurm_priority_conf(weights, calc_period_minutes=1)
    shown = {"PriorityCalcPeriod": "00:01:00", "PriorityFavorSmall": "No"}  # how scontrol prints them
    for key, value in want.items():
        assert conf[key.lower()] == shown.get(key, value), key
    for partition in ("gpu", "interactive"):
        assert "TRESBillingWeights=GRES/gpu=1.0" in slurm("scontrol", "show", "partition", partition).stdout


def test_fair_share_puts_a_light_users_later_job_ahead_of_a_heavy_users(tmp_path):
    slurmtools.require_cluster()
    slurmtools.ensure_unix_users((HEAVY, LIGHT))
    slurmtools.cancel_all_jobs()
    for user in (HEAVY, LIGHT):  # a fresh association: no usage from earlier runs
        slurm("sacctmgr", "-i", "delete", "user", f"name={user}", check=False)
        slurm("sacctmgr", "-i", "add", "user", user, "Account=gpuhub")
    try:
        # the heavy user uses all 8 GPUs for a few seconds: real usage, in slurmdbd's association
        t0 = time.monotonic()
        slurm("sbatch", "--wait", "-A", "gpuhub", "-N", "2", "--gres=gpu:4", "-o", "/dev/null",
              "-J", "gpuhub-test", "--wrap", "sleep 3", user=HEAVY)  # fmt: skip
        # Slurm adds the usage at the job's end and recomputes the factors every PriorityCalcPeriod
        wait_for(lambda: fairshare(HEAVY) < fairshare(LIGHT), 150, "Slurm to apply the heavy user's use")
        applied = time.monotonic() - t0
        print(f"usage applied {applied:.1f} s after the heavy job was submitted")

        held = hold_all_gpus()
        heavy = sbatch("-A", "gpuhub", "--gres=gpu:4", "--time=5", user=HEAVY)
        wait_for(lambda: job_state(heavy) == "PENDING", 10, "the heavy user's job to wait")
        light = sbatch("-A", "gpuhub", "--gres=gpu:4", "--time=5", user=LIGHT)  # asked later

        # a job's priority is set at its submission and recomputed each PriorityCalcPeriod: the
        # light user's is the higher once Slurm has weighed both (a fresh-clone run read 272, 272)
        def ranked():
            jobs = squeue_json()
            return jobs if jobs[light]["priority"] > jobs[heavy]["priority"] else None

        listed = wait_for(ranked, 90, "Slurm to rank the light user's job above the heavy user's")
        assert listed[light]["submit_time"] >= listed[heavy]["submit_time"]
        queue = squeue.parse_squeue_json(json.dumps({"jobs": list(listed.values())}), ["gpuhub-test"]).queue
        assert squeue.queue_positions(queue, [light, heavy]) == {light: (1, 2, "gpu"), heavy: (2, 2, "gpu")}

        # four GPUs free up: the light user's job starts first; the heavy one still waits
        slurm("scancel", held[0])
        wait_for(lambda: job_state(light) == "RUNNING", 30, "the light user's job to start")
        assert job_state(heavy) == "PENDING"
    finally:
        slurmtools.cancel_all_jobs()
        for user in (HEAVY, LIGHT):
            slurm("scancel", "-u", user, check=False)


# through the hub ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with slurmtools.slurm_hub(
        tmp_path_factory.mktemp("slurmqueue"), 'c.GpuHub.user_shares = {"carol": 3}'
    ) as h:
        yield h.wait_for_broker()


@pytest.fixture
def clean(hub):
    yield
    for user in slurmtools.USERS:
        r = hub.api("GET", f"/users/{user}")
        if r.status_code == 200 and r.json()["servers"]:
            hub.stop_server(user)
    slurmtools.cancel_all_jobs()


def test_the_spawn_page_shows_the_place_and_slurms_expected_start(hub, clean, browser):
    hold_all_gpus()
    r = hub.spawn("carol", {"gpus": 2})
    assert r.status_code == 202, r.text
    # the share in gpuhub's config is carol's association's Fairshare, written before sbatch
    out = slurm("sacctmgr", "-n", "-P", "show", "assoc", "account=gpuhub", "user=carol", "format=fairshare")
    assert out.stdout.split() == ["3"]
    # Slurm gives the job its reason on its scheduler's pass: until then the line says "waiting"
    messages = progress_until(
        hub, "carol", ["Queued in Slurm", "expected start about", "Slurm's reason: Resources"], timeout=60
    )
    line = messages[-1]
    job = hub.job_id("carol")
    # what Slurm itself says for this job, now: squeue --json's start_time and squeue --start
    listed = squeue_json()[job]
    expected = squeue.epoch_utc(listed["start_time"])
    assert expected is not None
    start = slurm("squeue", "--start", "-h", "-j", job, "-o", "%S").stdout.strip()
    assert datetime.fromisoformat(start).astimezone(UTC).replace(tzinfo=None) == expected
    assert f"job {job} in partition gpu: 1st of 1 waiting for 2 GPUs" in line, line
    assert f"expected start about {utc_clock(expected)}" in line and "Slurm's estimate" in line, line
    assert line.endswith("Slurm's reason: Resources"), line

    # the same line on the spawn-pending page, in Chromium
    page = browser.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", "carol")
    page.fill("#password_input", DEMO_PASSWORD)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    page.goto(f"{hub.url}/hub/spawn-pending/carol")
    page.wait_for_function(
        "(w) => (document.querySelector('#progress-message') || {}).textContent?.includes(w)",
        arg=f"expected start about {utc_clock(expected)}",
        timeout=30000,
    )
    shown = page.text_content("#progress-message")
    assert f"job {job} in partition gpu: 1st of 1 waiting for 2 GPUs" in shown, shown
    # and the heading says it waits, not that the server is starting up
    assert page.text_content("#gpuhub-heading").strip() == "Waiting for GPUs in Slurm's queue"


def cell_lines(kc, until: str, timeout: float) -> list[str]:
    """The cell's display outputs (as created and as updated in place) until one has ``until``."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            break
        if msg["msg_type"] in ("display_data", "update_display_data", "stream"):
            text = msg["content"].get("data", {}).get("text/plain") or msg["content"].get("text") or ""
            seen.append(text)
            if until in text:
                return seen
    raise AssertionError(f"no output with {until!r}; saw {seen}")


def test_a_burst_waits_in_slurms_queue_with_its_line_and_ctrl_c_leaves_nothing_held(hub, clean):
    ledger = Ledger(hub.ledger_url)
    ledger.set_limit("user", "alice", Limit(max_gpus=8))
    try:
        assert hub.spawn("alice", {"gpus": 0}).status_code in (201, 202)
        hub.wait_ready("alice", timeout=120)
        hold_all_gpus()
        kc, kid = kernel_of(hub, "alice")
        kc.execute("%%distributed --gpus 4\nprint('ran', rank)")
        seen = cell_lines(kc, "expected start about", timeout=90)
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        job = burst.backend_job_id
        assert job and job_state(job) == "PENDING"
        line = seen[-1]
        expected = squeue.epoch_utc(squeue_json()[job]["start_time"])
        # the cluster keeps jobs private (PrivateData=jobs): alice's kernel sees only her own
        # jobs, so it counts no place among them and says why
        assert f"Queued in Slurm as engines job {job} in partition gpu: waiting for 4 GPUs" in line, line
        assert "private on this cluster" in line, line
        assert f"expected start about {utc_clock(expected)}" in line, line

        # Ctrl-C (the stop button) while it waits: the job is cancelled, the burst released
        r = hub.api_url_request("POST", f"/user/alice/api/kernels/{kid}/interrupt")
        assert r.status_code == 204, r.text
        reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        assert "burst GPUs released" in "\n".join(reply["content"]["traceback"])
        wait_for(lambda: job_state(job) in ("CANCELLED", "GONE"), 30, "the engines' job to be cancelled")
        assert ledger.get(burst.id).state == "released"
        assert [a for a in ledger.active(user="alice") if a.purpose == "distributed"] == []
        left = slurm("squeue", "-h", "-u", "alice", "-n", "gpuhub-engines", "-o", "%i %T").stdout
        assert left.strip() == ""  # no engines' job of alice's, pending or running
        assert "ran" not in "".join(seen)
        kc.stop_channels()
    finally:
        ledger.unset_limit("user", "alice")
