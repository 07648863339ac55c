"""Where a pool's engines run. The pool (``pool.EnginePool``) asks its launcher, never "local or
Slurm": ``cluster_options`` (where the controller listens), ``launch`` (start the engines),
``ranks`` (which engine is which rank, with each rank's environment), ``signal`` (reach the
ranks' processes), ``local_pids`` (processes of ours here that the kernel's reaper ends) and
``stop``. ``LocalLauncher`` runs engines on this machine through ipyparallel; the Slurm backend's
``slurmengines.SlurmLauncher`` runs them as Slurm tasks.
"""

from __future__ import annotations

import os
import sys

from traitlets.config import Config

# ipyparallel's engine with SIGUSR1 blocked in every thread (a stuck rank is freed by it)
ENGINE_CMD = [sys.executable, "-m", "gpu_magics.enginemain"]


def signal_pids(pool, sig: int, ranks: list[int] | None) -> None:
    """Signal ranks' engine processes of this machine by pid."""
    for r in ranks if ranks is not None else range(pool.size):
        try:
            os.kill(pool.infos[r]["pid"], sig)
        except (ProcessLookupError, IndexError):
            pass


class LocalLauncher:
    """Engines on this machine, started by ipyparallel; the ranks as planned (``specs``)."""

    local_pids: list[int] = []

    def __init__(self, specs):
        self.specs = specs

    def cluster_options(self) -> dict:
        config = Config()
        config.LocalEngineSetLauncher.engine_cmd = ENGINE_CMD
        return {"controller_ip": "127.0.0.1", "config": config}

    def launch(self, cluster, n: int) -> None:
        cluster.start_engines_sync(n=n)

    def ranks(self, pool, timeout: float) -> tuple[list[dict], int]:
        pool.specs = list(self.specs)
        pool._remote = pool.multi_host = False
        return [spec.env() for spec in pool.specs], os.getpid()

    def signal(self, pool, sig: int, ranks: list[int] | None) -> None:
        signal_pids(pool, sig, ranks)

    def stop(self) -> None:
        pass
