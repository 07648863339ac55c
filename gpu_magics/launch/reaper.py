"""``python -m gpu_magics.launch.reaper KERNEL_PID PID...``: end a pool's processes when its kernel dies.

Started by the pool in a session of its own, so it outlives a kernel killed outright. Every
second it checks the kernel; when the kernel is gone (or a zombie) it stops each PID and its
children (SIGTERM, then SIGKILL after 3 s) and exits. It also exits once every PID is gone.
Without it the ipyparallel controller (and its scheduler processes) would run forever.
``--remove=DIR`` (the pool's private socket directory) is removed once the kernel is gone.
"""

from __future__ import annotations

import shutil
import sys
import time

import psutil

from gpu_magics.common.procs import alive


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


def watch(kernel_pid: int, pids: list[int], interval: float = 1.0) -> bool:
    """Wait; True once the kernel died and the pids were ended, False if they ended first."""
    while any(alive(p) for p in pids):
        if not alive(kernel_pid):
            kill_trees(pids)
            return True
        time.sleep(interval)
    return False


if __name__ == "__main__":
    # --remove=DIR: the pool's private socket directory, removed once its kernel is gone
    remove = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--remove=")]
    kernel, *targets = (int(a) for a in sys.argv[1:] if not a.startswith("--remove="))
    if watch(kernel, targets):
        for directory in remove:
            shutil.rmtree(directory, ignore_errors=True)
