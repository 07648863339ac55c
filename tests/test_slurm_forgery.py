"""A job's text cannot make the hub's watcher (root) take another user's GPU: on the real
cluster, as a second real account.

bob submits an engines job whose comment holds a newline and then a line that imitates
``scontrol -d show job``'s per-node line, naming the GPU alice's server holds. gpuhub reads a
job's GPUs from ``squeue --json`` (``gres_detail``), so the watcher records bob's real GPU,
and alice keeps hers, her job running.
"""

import asyncio
import time

import pytest

from spawner.ledger import Ledger
from spawner.policy import Gpu, Limit, LimitRules
from spawner.slurm import jobs
from spawner.slurm.watcher import SlurmWatcher

from . import slurmtools
from .slurmtools import job_state, slurm


@pytest.fixture
def cluster():
    slurmtools.require_cluster()
    slurmtools.ensure_unix_users(("alice", "bob"))
    for user in ("alice", "bob"):
        slurm("sacctmgr", "-i", "add", "user", user, "account=gpuhub", check=False)
    yield
    slurmtools.cancel_all_jobs()


def submit(user, allocation_id, node, comment_tail=""):
    out = slurm(
        "sbatch", "--parsable", "--account=gpuhub", "--no-requeue", f"--job-name={NAMES[user]}",
        "--gres=gpu:a100:1", "-w", node, "--chdir=/tmp", "--output=/dev/null",
        f"--comment=gpuhub:{allocation_id}{comment_tail}",
        "--wrap", "sleep 300", user=user,
    ).stdout  # fmt: skip
    return jobs.parse_sbatch(out)


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
