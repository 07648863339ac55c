"""A kernel's ``%%distributed`` pool as JupyterLab's GPU panel shows it (its ranks: node, GPU,
pid, state; its burst; what ``--autosave`` saves and where).

The kernel writes one JSON file per kernel process, ``<pid>.json``, in ``gpuhub-pools/`` of the
user's Jupyter runtime directory (the server's and its kernels', private to the user: made
0700, files 0600, written whole by a rename); the server extension (``gpu_magics.lab``) reads
them. A file whose kernel is gone is removed by the reader. Standard library only.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from gpu_magics.common.procs import alive

DIRNAME = "gpuhub-pools"


def directory(runtime_dir: str | os.PathLike) -> Path | None:
    """The pools' directory, made private if missing; None when it is not the user's own
    private directory (then nothing is written there or read from it)."""
    d = Path(runtime_dir) / DIRNAME
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = d.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return d


def publish(runtime_dir: str | os.PathLike, doc: dict) -> None:
    """This kernel's pool, replacing what it said before."""
    d = directory(runtime_dir)
    if d is None:
        return
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".pool-", suffix=".json")  # 0600
    with os.fdopen(fd, "w") as f:
        json.dump({**doc, "kernel_pid": os.getpid()}, f)
    os.replace(tmp, d / f"{os.getpid()}.json")


def withdraw(runtime_dir: str | os.PathLike) -> None:
    """This kernel has no pool now."""
    d = directory(runtime_dir)
    if d is not None:
        (d / f"{os.getpid()}.json").unlink(missing_ok=True)


def read_all(runtime_dir: str | os.PathLike) -> list[dict]:
    """Every live kernel's pool (kernel pid order); the files of kernels that are gone are removed."""
    d = directory(runtime_dir)
    if d is None:
        return []
    found = []
    for f in sorted(d.glob("*.json")):
        if not f.stem.isdigit():
            continue
        if not alive(int(f.stem)):
            f.unlink(missing_ok=True)
            continue
        try:
            found.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # being replaced: the next poll reads it
    return found
