"""A job's text cannot make the hub's watcher (root) take another user's GPU, cancel a job or
stop cycling: on the real cluster, as a second real account.

bob submits engines jobs whose comments hold a newline and then a line that imitates
``scontrol -d show job``'s per-node line (naming the GPU alice's server holds), the old
``squeue -o '%i|%T|...|%k'`` line of a job of carol's (tagged with carol's live
allocation), or that line for alice's own job, ended. gpuhub reads jobs from ``squeue --json``
(and in the text fallback refuses a job whose text holds a newline), so the real watcher,
cycling on its own, records bob's real GPU only, attaches and cancels nothing, and goes on;
alice keeps her GPU, her job running.
"""

import asyncio
import time

import pytest

from spawner.ledger import Ledger
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu
from spawner.slurm import commands
from spawner.slurm.watcher import SlurmWatcher

from . import slurmtools
from .slurmtools import job_state, slurm, slurm_cluster_turn  # noqa: F401 (pytestmark)

pytestmark = pytest.mark.usefixtures("slurm_cluster_turn")


@pytest.fixture
def cluster():
    slurmtools.require_cluster()
    slurmtools.ensure_unix_users(("alice", "bob"))
    for user in ("alice", "bob"):
        slurm("sacctmgr", "-i", "add", "user", user, "account=gpuhub", check=False)
        # no GPU limit left in Slurm by an earlier test's hub (bob holds three GPUs here)
        slurmtools.set_slurm_gpus(user, -1, check=False)
    yield
    slurmtools.cancel_all_jobs()


def submit(user, allocation_id, node, comment_tail="", comment=None):
    out = slurm(
        "sbatch", "--parsable", "--account=gpuhub", "--no-requeue", f"--job-name={NAMES[user]}",
        "--gres=gpu:a100:1", "-w", node, "--chdir=/tmp", "--output=/dev/null",
        f"--comment={comment if comment is not None else f'gpuhub:{allocation_id}{comment_tail}'}",
        "--wrap", "sleep 300", user=user,
    ).stdout  # fmt: skip
    return commands.parse_sbatch(out)


NAMES = {"alice": "gpuhub-server", "bob": "gpuhub-engines"}


async def cycle_until(watcher, done, what, timeout=60):
    """Run the watcher's cycles until ``done()``, with a deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await watcher.cycle()
        if done():
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


async def test_a_forged_gres_line_in_a_comment_takes_nobodys_gpu(cluster, tmp_path):
    led = Ledger(f"sqlite:///{tmp_path}/ledger.sqlite", config_rules=LimitRules(default=Limit(max_gpus=4)))
    led.sync_inventory([Gpu(node, i, "a100") for node in ("gpu-node1", "gpu-node2") for i in range(4)])
    watcher = SlurmWatcher(lambda: led)
    try:
        mine = led.allocate("alice", [], 1, purpose="server", deferred=True, backend="slurm")
        alice_job = submit("alice", mine.id, "gpu-node2")
        led.attach_job(mine.id, alice_job)
        await cycle_until(watcher, lambda: led.get(mine.id).gpus, "alice's GPU recorded")
        [held] = led.get(mine.id).gpus
        assert held.node == "gpu-node2"

        burst = led.allocate("bob", [], 1, purpose="distributed", deferred=True, backend="slurm")
        forged = f"\n     Nodes={held.node} CPU_IDs=0 Mem=1 GRES=gpu:a100:1(IDX:{held.index})"
        bob_job = submit("bob", burst.id, "gpu-node1", forged)
        led.attach_job(burst.id, bob_job)
        # Slurm itself shows the forged line where the old text parser looked for GPUs
        detail = slurm("scontrol", "-d", "show", "job", bob_job).stdout
        assert (
            f"GRES=gpu:a100:1(IDX:{held.index})" in detail and f"Nodes={held.node} CPU_IDs=0 Mem=1" in detail
        )
        await cycle_until(watcher, lambda: led.get(burst.id).gpus, "bob's GPU recorded")

        bob_gpus = [g.label for g in led.get(burst.id).gpus]
        assert len(bob_gpus) == 1 and bob_gpus[0].startswith("gpu-node1:"), bob_gpus
        alice_now = led.get(mine.id)
        assert alice_now.state == "running" and [g.label for g in alice_now.gpus] == [held.label]
        assert job_state(alice_job) == "RUNNING" and job_state(bob_job) == "RUNNING"
        await watcher.cycle()  # and a later cycle changes nothing either
        assert led.get(mine.id).state == "running" and job_state(alice_job) == "RUNNING"
    finally:
        led.close()


# bob's comment, exactly: in the old one-line text form, a job of carol's tagged gpuhub:5, with
# an id above Slurm's MaxJobId (67043328), so that no real job of the test cluster ever has it
FORGED = "99999999"
BOB = f"gpuhub:99\n{FORGED}|RUNNING|None|gpu-node1|carol|gpuhub-server|N/A|gpuhub:5"


async def cycles_until(watcher, done, what, timeout=60):
    """Wait on the running watcher's own cycles (its updated event) until ``done()``; every
    cycle on the way must have succeeded."""
    deadline = time.monotonic() + timeout
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        before = watcher.cycles
        await watcher.next_update(left)
        if watcher.cycles > before:
            assert watcher.last_cycle_ok and watcher.failures == 0, "a watcher cycle failed"


async def test_forged_job_lines_cancel_attach_and_record_nothing_and_the_watcher_keeps_cycling(
    cluster, tmp_path
):
    led = Ledger(f"sqlite:///{tmp_path}/ledger.sqlite", config_rules=LimitRules(default=Limit(max_gpus=4)))
    led.sync_inventory([Gpu(node, i, "a100") for node in ("gpu-node1", "gpu-node2") for i in range(4)])
    watcher = SlurmWatcher(lambda: led, min_interval=0.2, max_interval=0.5)
    try:
        for _ in range(4):  # carol's allocation gets id 5, the one the forged line names
            led.release(led.allocate("dave", [], 1, deferred=True, backend="slurm").id, "test")
        carol = led.allocate("carol", [], 1, purpose="server", deferred=True, backend="slurm")
        assert carol.id == 5
        mine = led.allocate("alice", [], 1, purpose="server", deferred=True, backend="slurm")
        alice_job = submit("alice", mine.id, "gpu-node2")
        led.attach_job(mine.id, alice_job)
        watcher.start()
        await cycles_until(watcher, lambda: led.get(mine.id).gpus, "alice's GPU recorded")
        [held] = led.get(mine.id).gpus

        burst = led.allocate("bob", [], 1, purpose="distributed", deferred=True, backend="slurm")
        forged = [
            submit("bob", None, "gpu-node1", comment=BOB),
            submit(
                "bob",
                None,
                "gpu-node1",
                comment=f"gpuhub:98\n{alice_job}|COMPLETED|None|"
                f"{held.node}|alice|gpuhub-server|N/A|gpuhub:{mine.id}",
            ),
        ]
        gres_line = f"\n     Nodes={held.node} CPU_IDs=0 Mem=1 GRES=gpu:a100:1(IDX:{held.index})"
        bob_job = submit("bob", burst.id, "gpu-node1", gres_line)
        led.attach_job(burst.id, bob_job)
        # the old text form shows the forged lines as job lines
        text = slurm("squeue", "-h", "-a", "-t", "all", "-o", "%i|%T|%r|%N|%u|%j|%S|%k").stdout
        assert f"{FORGED}|RUNNING|None|gpu-node1|carol|gpuhub-server|N/A|gpuhub:5" in text.splitlines()
        assert f"{alice_job}|COMPLETED|None|{held.node}|alice|gpuhub-server|N/A|gpuhub:{mine.id}" in text

        def settled():
            seen = all(j in watcher.jobs and watcher.jobs[j].running for j in [*forged, bob_job])
            return seen and led.get(burst.id).gpus

        await cycles_until(watcher, settled, "bob's jobs running and his real GPU recorded")
        start = watcher.cycles
        await cycles_until(watcher, lambda: watcher.cycles >= start + 3, "three more cycles")
        assert [g.label for g in led.get(burst.id).gpus] == [
            "gpu-node1:" + str(led.get(burst.id).gpus[0].index)
        ]
        alice_now = led.get(mine.id)
        assert alice_now.state == "running" and [g.label for g in alice_now.gpus] == [held.label]
        assert alice_now.backend_job_id == alice_job and watcher.jobs[alice_job].state == "RUNNING"
        assert led.get(carol.id).backend_job_id is None and led.get(carol.id).state == "starting"
        assert FORGED not in watcher.jobs and not watcher.unreadable
        assert list(watcher.cancelled) == [] and list(watcher.refused) == []
        assert job_state(alice_job) == "RUNNING" and all(job_state(j) == "RUNNING" for j in forged)

        # the text fallback (a Slurm without --json), on the same cluster: bob's jobs are refused
        text_watcher = SlurmWatcher(lambda: led)
        text_watcher._json = False
        for _ in range(2):
            await text_watcher.cycle()
            assert text_watcher.failures == 0
        assert {*forged, bob_job} <= text_watcher.unreadable and FORGED not in text_watcher.jobs
        assert text_watcher.jobs[alice_job].running and not text_watcher.cancelled
        assert led.get(mine.id).state == "running" and led.get(carol.id).backend_job_id is None

        # a real orphan is cancelled, as its owner, after the check; one whose comment is not
        # its allocation's tag (bob's GRES imitation) is not, and the log says why
        plain = led.allocate("bob", [], 1, purpose="distributed", deferred=True, backend="slurm")
        plain_job = submit("bob", plain.id, "gpu-node2")
        led.attach_job(plain.id, plain_job)
        await cycles_until(watcher, lambda: led.get(plain.id).gpus, "bob's plain job's GPU recorded")
        led.release(burst.id, "lease expired")
        led.release(plain.id, "lease expired")
        await cycles_until(
            watcher, lambda: job_state(plain_job) not in ("RUNNING", "PENDING") and watcher.refused,
            "bob's plain job cancelled",
        )  # fmt: skip
        assert list(watcher.cancelled) == [plain_job]
        assert watcher.refused[0] == (
            bob_job,
            f"job {bob_job}'s comment names no gpuhub allocation, not allocation {burst.id}",
        )
        assert job_state(bob_job) == "RUNNING" and all(job_state(j) == "RUNNING" for j in forged)
        assert job_state(alice_job) == "RUNNING" and led.get(mine.id).state == "running"
    finally:
        if watcher._task is not None:
            watcher._task.cancel()
        led.close()
