"""What every launcher of a pool's engines is: the :class:`Launcher` protocol, the engine's
command (``ENGINE_CMD``), and where the ranks went (:class:`Placement`).

The pool (``gpu_magics.kernel.pool.EnginePool``) asks its launcher, never "local or Slurm":
``cluster_options`` (where the controller listens), ``controller_args`` (its channels'
protection: ``channels``), ``launch`` (start the engines), ``place`` (which engine is which
rank, with each rank's environment), ``signal`` (reach the ranks' processes), ``local_pids``
(processes of ours here that the kernel's reaper ends) and ``stop``.
``launch.local.LocalLauncher`` runs engines on this machine through ipyparallel;
``launch.slurm.SlurmLauncher`` runs them as Slurm tasks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Protocol

from gpu_magics.common.ranks import RankSpec

# ipyparallel's engine with SIGUSR1 blocked in every thread (a stuck rank is freed by it)
ENGINE_CMD = [sys.executable, "-m", "gpu_magics.engine.main"]


@dataclass(frozen=True)
class Placement:
    """Where a launcher's ranks went: the engines in rank order, each rank's spec and the
    environment its engine is set up with, and whether any (``remote``) or several
    (``multi_host``) of them run on other hosts than the kernel's."""

    engine_ids: tuple[int, ...]
    specs: tuple[RankSpec, ...]
    envs: tuple[dict, ...]
    remote: bool = False
    multi_host: bool = False


class Launcher(Protocol):
    """Starts, places, signals and stops a pool's engines (see the module's docstring)."""

    @property
    def controller_args(self) -> list[str]: ...

    @property
    def local_pids(self) -> list[int]: ...

    def cluster_options(self) -> dict: ...

    def launch(self, cluster, n: int) -> None: ...

    def place(self, client, engine_ids: list[int], timeout: float) -> Placement: ...

    def signal(self, pool, sig: int, ranks: list[int] | None) -> None: ...

    def stop(self) -> None: ...


def signal_pids(pool, sig: int, ranks: list[int] | None) -> None:
    """Signal ranks' engine processes of this machine by pid."""
    for r in ranks if ranks is not None else range(pool.size):
        try:
            os.kill(pool.infos[r]["pid"], sig)
        except (ProcessLookupError, IndexError):
            pass
