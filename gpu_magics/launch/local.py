"""Engines on this machine (``LocalLauncher``, a :class:`~gpu_magics.launch.base.Launcher`),
started by ipyparallel, with a controller on Unix sockets in a private directory.
"""

from __future__ import annotations

import os
import shutil
import sys

from traitlets.config import Config

from gpu_magics.common import channels
from gpu_magics.launch.base import ENGINE_CMD, Placement, signal_pids

# ipyparallel's controller, binding Unix sockets where its engines and clients look for them
CONTROLLER_CMD = [sys.executable, "-m", "gpu_magics.launch.controller"]


class LocalLauncher:
    """Engines on this machine, started by ipyparallel; the ranks as planned (``specs``). The
    controller binds Unix sockets (``ipc``) in a new private directory (0700, removed at
    ``stop``) and, as every pool's, runs with CurveZMQ: no TCP port of the pool gives anything
    to an account without the keys in the owner's connection files."""

    local_pids: list[int] = []
    # off: loopback TCP without Curve, as before issue 27 (benchmarks/channels.py compares them)
    private_channels = True

    def __init__(self, specs):
        self.specs = specs
        self.socket_dir: str | None = None

    @property
    def controller_args(self) -> list[str]:
        return channels.IPC_CONTROLLER_ARGS if self.private_channels else []

    def cluster_options(self) -> dict:
        config = Config()
        config.LocalEngineSetLauncher.engine_cmd = ENGINE_CMD
        config.LocalControllerLauncher.controller_cmd = CONTROLLER_CMD
        self.stop()  # a pool started again: a new directory
        if not self.private_channels:
            return {"controller_ip": "127.0.0.1", "config": config}
        self.socket_dir = channels.socket_dir("gpuhub-pool-", channels.CONTROLLER_SOCKET_NAME)
        return {"controller_ip": os.path.join(self.socket_dir, channels.CONTROLLER_PREFIX), "config": config}

    def launch(self, cluster, n: int) -> None:
        cluster.start_engines_sync(n=n)

    def place(self, client, engine_ids: list[int], timeout: float) -> Placement:
        """The ranks as planned, on the engines in the order the pool has them."""
        return Placement(tuple(engine_ids), tuple(self.specs), tuple(spec.env() for spec in self.specs))

    def signal(self, pool, sig: int, ranks: list[int] | None) -> None:
        signal_pids(pool, sig, ranks)

    def stop(self) -> None:
        if self.socket_dir:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            self.socket_dir = None
