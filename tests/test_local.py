"""Pure parts of the local backend and the spawner: environment, reconcile decisions, liveness."""

import os
import subprocess
import time
from datetime import UTC, datetime

import pytest

from spawner.policy.placement import Gpu
from spawner.policy.records import AllocationInfo
from spawner.spawners.base import make_gpu_env
from spawner.spawners.local import pid_alive, stale_local_allocations

T = datetime(2026, 11, 1, 12, 0)  # the ledger keeps naive UTC


def alloc(id, *, job=None, state="running", purpose="server", backend="local", created=T, gpus=()):
    return AllocationInfo(
        id=id,
        user="u",
        purpose=purpose,
        server_name="",
        state=state,
        created=created,
        started=None,
        ended=None,
        backend=backend,
        backend_job_id=job,
        end_reason=None,
        gpus=tuple(gpus),
    )


def test_make_gpu_env_names_exactly_the_allocated_gpus():
    a = alloc(7, gpus=[Gpu("n1", 1, "A100"), Gpu("n1", 3, "A100")])
    assert make_gpu_env(a) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "1,3",
        "GPUHUB_ALLOCATION_ID": "7",
        "GPUHUB_GPUS": "n1:1,n1:3",
        "GPUHUB_NODE": "n1",
        "GPUHUB_GPU_MODEL": "A100",
    }


def test_make_gpu_env_without_gpus_hides_them_all():
    env = make_gpu_env(None)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["GPUHUB_ALLOCATION_ID"] == ""


@pytest.mark.parametrize(
    "allocation, alive, stale",
    [
        (alloc(1, job="100"), {100}, None),
        (alloc(2, job="100"), set(), "server died while the hub was down"),
        (alloc(3, state="starting"), set(), "hub stopped while the server was starting"),
        # started by this hub process (created after it started): not ours to judge
        (alloc(4, state="starting", created=datetime(2030, 1, 1)), set(), None),
        (alloc(5, job="100", purpose="distributed"), set(), None),
        (alloc(6, job="100", backend="slurm"), set(), None),
    ],
)
def test_stale_local_allocations(allocation, alive, stale):
    started = datetime(2026, 11, 1, 13, 0, tzinfo=UTC).timestamp()
    got = stale_local_allocations([allocation], lambda pid: pid in alive, started)
    assert [why for _a, why in got] == ([stale] if stale else [])


def test_pid_alive_counts_a_zombie_as_dead():
    child = subprocess.Popen(["true"])
    # exited but not reaped: a zombie until wait()
    deadline = time.monotonic() + 10
    while pid_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(child.pid)
    assert open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    child.wait()
    assert not pid_alive(child.pid)
    assert pid_alive(os.getpid())
