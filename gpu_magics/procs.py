"""Whether a process runs: the one check every watcher here needs (stdlib only)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie does not: a killed kernel or server whose parent has
    not reaped it yet is gone all the same (containers whose init never reaps keep them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no procfs: trust kill()
