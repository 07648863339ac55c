"""The cluster as ``sinfo`` shows it, cached for a short while (the spawn form reads it)."""

from __future__ import annotations

import subprocess
import threading
import time

from spawner.slurm import SlurmError, commands, sinfo

_cache: dict[str, tuple[float, sinfo.Cluster]] = {}
_lock = threading.Lock()


def read_cluster(max_age: float = 30.0, timeout: float = 20.0) -> sinfo.Cluster:
    """Nodes, GPUs and partitions from ``sinfo``; at most ``max_age`` seconds old, or the
    last known answer while ``sinfo`` fails."""
    with _lock:
        hit = _cache.get("sinfo")
        if hit and time.monotonic() - hit[0] < max_age:
            return hit[1]
        try:
            out = subprocess.run(
                commands.sinfo_argv(), capture_output=True, text=True, timeout=timeout, check=True
            )
        except FileNotFoundError:
            raise SlurmError(
                "sinfo is not installed: the Slurm backend needs Slurm's client commands"
            ) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"sinfo took longer than {timeout:g} s") from None
        except subprocess.CalledProcessError as e:
            raise SlurmError(f"sinfo failed: {e.stderr.strip()[-300:]}") from None
        cluster = sinfo.parse_sinfo(out.stdout)
        if not cluster.nodes:
            raise SlurmError("sinfo lists no nodes")
        _cache["sinfo"] = (time.monotonic(), cluster)
        return cluster
