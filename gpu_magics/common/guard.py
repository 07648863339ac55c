"""What a kernel holds from the broker, in a file its pool's reaper reads.

A burst's allocations are the kernel's: its parts renew them and give them back. A kernel that
dies, or that no longer runs (paused with SIGSTOP, stuck), can neither give them back nor stop
its engines when the hub ends them at a notice's due time; the reaper
(``gpu_magics.launch.reaper``), a process of its own session, can. So the kernel lists the
allocations it holds in a guard file: one per kernel, in a directory of its own (0700, a random
name), JSON ``{"allocations": [ids]}``, replaced whole by a rename. An allocation leaves the
list *before* the kernel gives it back, so one the broker calls released while it is still
listed was ended by the hub (a due preemption, an admin, a lease run out), not by the kernel:
the reaper then stops the pool's processes, so that nobody else's work finds them on its GPUs.

Standard library only: the kernel writes it, the reaper reads it.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import threading
from pathlib import Path

from gpu_magics.common.scratch import make_private

_lock = threading.Lock()
_guard: Guard | None = None


def decide(kernel_alive: bool, released: set[int], still_listed: set[int]) -> str:
    """The reaper's move (pure): ``"release"`` the listed allocations once the kernel is gone;
    ``"stop"`` the pool when the hub ended an allocation the kernel still lists (``released``
    by the broker's answer, ``still_listed`` on a read of the file after that answer);
    else ``"wait"``."""
    if not kernel_alive:
        return "release"
    if released & still_listed:
        return "stop"
    return "wait"


def read(path: str | os.PathLike) -> set[int]:
    """The allocations listed in a guard file (none when it is missing or unreadable)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return set()
    ids = data.get("allocations") if isinstance(data, dict) else None
    return (
        {i for i in ids if isinstance(i, int) and not isinstance(i, bool)} if isinstance(ids, list) else set()
    )


class Guard:
    """This kernel's guard file: :meth:`add` when an allocation is granted, :meth:`remove`
    before it is given back."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.path = directory / "held.json"
        self._ids: set[int] = set()
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"allocations": sorted(self._ids)}))
        os.replace(tmp, self.path)

    def add(self, allocation_id: int) -> None:
        with _lock:
            self._ids.add(int(allocation_id))
            self._write()

    def remove(self, allocation_id: int) -> None:
        with _lock:
            self._ids.discard(int(allocation_id))
            self._write()

    @property
    def ids(self) -> set[int]:
        return set(self._ids)


def kernel_guard() -> Guard:
    """This process's guard file, made on first use and removed at exit."""
    global _guard
    with _lock:
        if _guard is None:
            directory = make_private(prefix="gpuhub-held-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
            _guard = Guard(directory)
        return _guard


def current_path() -> str | None:
    """The guard file's path if this process holds one (what a reaper is given), else None."""
    return None if _guard is None else str(_guard.path)
