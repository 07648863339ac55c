"""``python -m gpu_magics.launch.reaper KERNEL_PID PID...``: end a pool's processes when its kernel dies.

Started by the pool in a session of its own, so it outlives a kernel killed outright. Every
second it checks the kernel; when the kernel is gone (or a zombie) it stops each PID and its
children (SIGTERM, then SIGKILL after 3 s) and exits. It also exits once every PID is gone.
Without it the ipyparallel controller (and its scheduler processes) would run forever.
``--remove=DIR`` (the pool's private socket directory) is removed once the kernel is gone.

``--guard=FILE`` (the kernel's guard file, :mod:`gpu_magics.common.guard`): the burst
allocations the kernel holds. Once the kernel is gone, the reaper gives each back to the broker
(``$GPUHUB_BROKER_URL`` with the server's ``$JUPYTERHUB_API_TOKEN``, inherited), so the GPUs are
free within seconds, not when a lease runs out. While the kernel lives, it asks the broker every
``CHECK_SECONDS`` whether the hub ended one of them (a notice's due time, an admin, a lease run
out while the kernel was paused or stuck); one still listed ``GRACE_SECONDS`` later (a running
kernel unlists it as soon as it acts) makes it stop the pool's processes here as at the
kernel's death (the engines of a Slurm job end with its controller, and the hub cancels the
job), so that nobody else's work finds them on those GPUs.
"""

from __future__ import annotations

import shutil
import sys
import time

import psutil

from gpu_magics.common import guard
from gpu_magics.common.procs import alive

CHECK_SECONDS = 2.0  # how often the broker is asked about the guarded allocations
# how long an allocation the hub ended may stay listed before the pool is stopped: a running
# kernel unlists one at once when it acts on its notice (and then stops or shrinks the pool
# itself, saying what it kept); one that does not is paused, stuck or gone
GRACE_SECONDS = 10.0


def kill_trees(pids: list[int], grace: float = 3.0) -> None:
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _gone, left = psutil.wait_procs(procs, timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def ended_by_hub(client, path: str) -> set[int]:
    """The guarded allocations the broker says are no longer live and the kernel still lists
    (read again after the broker's answer: the kernel unlists one before it gives it back)."""
    released = set()
    for allocation_id in guard.read(path):
        try:
            state = client.get(allocation_id).get("state")
        except Exception:  # the broker cannot say (down, restarting): ask again next time
            continue
        if state == "released":
            released.add(allocation_id)
    return released & guard.read(path) if released else set()


def give_back(client, path: str) -> list[int]:
    """Release every allocation the guard file lists; the ids the broker was told of."""
    told = []
    for allocation_id in sorted(guard.read(path)):
        try:
            client.release(allocation_id, why="kernel_gone")
            told.append(allocation_id)
        except Exception:  # its lease ends it
            continue
    return told


def watch(
    kernel_pid: int, pids: list[int], interval: float = 1.0, guard_path: str | None = None, client=None
) -> bool:
    """Wait; True once the kernel died (or the hub ended an allocation it still held) and the
    pids were ended, False if they ended first. With ``guard_path``, the kernel's allocations
    are given back at its death."""
    checked = 0.0
    seen: dict[int, float] = {}  # an allocation the hub ended -> when that was first seen
    while any(alive(p) for p in pids):
        gone = not alive(kernel_pid)
        overdue: set[int] = set()
        if not gone and guard_path and client is not None and time.monotonic() - checked >= CHECK_SECONDS:
            checked = time.monotonic()
            ended = ended_by_hub(client, guard_path)
            seen = {i: seen.get(i, checked) for i in ended}
            overdue = {i for i, t in seen.items() if checked - t >= GRACE_SECONDS}
        move = guard.decide(not gone, overdue, overdue)
        if move != "wait":
            kill_trees(pids)
            if move == "release" and guard_path and client is not None:
                give_back(client, guard_path)
            return True
        time.sleep(interval)
    if guard_path and client is not None and not alive(kernel_pid):
        give_back(client, guard_path)  # the kernel and its engines went together
        return True
    return False


if __name__ == "__main__":
    # --remove=DIR: the pool's private socket directory, removed once its kernel is gone
    remove = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--remove=")]
    guards = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--guard=")]
    kernel, *targets = (int(a) for a in sys.argv[1:] if not a.startswith("--"))
    broker = None
    if guards:
        from gpu_magics.kernel.broker import BrokerClient

        broker = BrokerClient.from_env()
        if broker is not None:
            broker.timeout = 10
    if watch(kernel, targets, guard_path=guards[0] if guards else None, client=broker):
        for directory in remove:
            shutil.rmtree(directory, ignore_errors=True)
