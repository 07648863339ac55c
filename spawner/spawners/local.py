"""The local backend: GPU servers as processes on this machine.

- ``gpu-local`` (:class:`GpuLocalProcessSpawner`): real Unix users, setuid, as
  ``LocalProcessSpawner``. For a shared multi-GPU server.
- ``gpu-local-simple`` (:class:`GpuSimpleLocalProcessSpawner`): every server runs as the
  hub's user, as ``SimpleLocalProcessSpawner``. For the demo and one-person machines only.

A server's "job id" in the ledger is its process id. When the hub process first opens the
ledger it reconciles: a local server allocation whose process is gone (it died while the
hub was down), or that was still starting when an earlier hub process stopped, is
released. JupyterHub's own start-up poll of each known server then releases any other
dead one through ``poll()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable
from datetime import UTC

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner

from gpu_magics.common.procs import alive as pid_alive
from spawner.ledger import Ledger
from spawner.policy.records import AllocationInfo
from spawner.spawners import inventory
from spawner.spawners.base import GpuSpawnerMixin

PROCESS_STARTED = time.time()
_reconciled: set[str] = set()
_reconcile_lock = threading.Lock()


def stale_local_allocations(
    allocations: Iterable[AllocationInfo],
    is_alive: Callable[[int], bool],
    process_started: float,
) -> list[tuple[AllocationInfo, str]]:
    """Which live local server allocations have no live process, and why."""
    stale = []
    for a in allocations:
        if a.purpose != "server" or a.backend != "local":
            continue
        if a.backend_job_id is None:
            # still "starting": stale only if an earlier hub process began it
            created = a.created.replace(tzinfo=UTC).timestamp()  # the ledger keeps naive UTC
            if created < process_started - 1 and a.state == "starting":
                stale.append((a, "hub stopped while the server was starting"))
            continue
        if not is_alive(int(a.backend_job_id)):
            stale.append((a, "server died while the hub was down"))
    return stale


def reconcile_local(ledger: Ledger, nodes: set[str], log=None) -> int:
    """Release local server allocations on ``nodes`` (this machine's) whose servers are gone."""
    released = 0
    allocations = [a for a in ledger.active(purpose="server", backend="local") if set(a.nodes) <= nodes]
    for a, why in stale_local_allocations(allocations, pid_alive, PROCESS_STARTED):
        if ledger.release(a.id, why):
            released += 1
            if log:
                log.info("gpuhub: released allocation %s of %s (%s)", a.id, a.user, why)
    return released


class LocalGpuMixin(GpuSpawnerMixin):
    backend_name = "local"

    def backend_job_id(self) -> str | None:
        return str(self.pid) if getattr(self, "pid", 0) else None

    def placement_nodes(self) -> set[str]:
        return inventory.local_nodes(self.gpuhub)  # a local server runs here: GPUs of this machine

    async def server_alive(self) -> bool:
        return bool(getattr(self, "pid", 0)) and pid_alive(self.pid)

    def end_server_now(self) -> None:
        pid = getattr(self, "pid", 0)
        if pid and pid_alive(pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                self.log.warning("Server %s: its stop was cut short; SIGKILLed %s", self._log_name, pid)

    async def _signal(self, sig):
        if sig == 0:  # LocalProcessSpawner.poll's liveness check: count zombies as dead
            return pid_alive(self.pid)
        return await super()._signal(sig)

    @property
    def ledger(self) -> Ledger:
        ledger = self.gpuhub.open_ledger()
        if ledger.url not in _reconciled:
            with _reconcile_lock:
                if ledger.url not in _reconciled:
                    reconcile_local(ledger, inventory.local_nodes(self.gpuhub), self.log)
                    _reconciled.add(ledger.url)
        return ledger


class GpuLocalProcessSpawner(LocalGpuMixin, LocalProcessSpawner):
    """LocalProcessSpawner with exclusive GPUs from the gpuhub ledger."""


class GpuSimpleLocalProcessSpawner(LocalGpuMixin, SimpleLocalProcessSpawner):
    """SimpleLocalProcessSpawner with exclusive GPUs: demo and single-user machines only."""
