"""Where a pool's process group meets, inside each engine: rank 0's engine makes the meeting
place (``open_rendezvous``, asked for by the kernel's pool), and every rank joins the group
through it (``group_store``: at ``rank.setup_rank``, and again at ``recovery.recover``).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from datetime import timedelta

_STORE = None  # rank 0's TCPStore between open_rendezvous and setup_rank


def open_rendezvous(kind: str, world_size: int, timeout_s: float) -> dict:
    """Runs on rank 0's engine before any rank joins.

    ``file``: all ranks share this node, and meet in a ``FileStore`` in a new directory of mode
    0700, so no other account can join, read or write it (no port at all). ``tcp``: ranks on
    several nodes meet in a ``TCPStore`` that picked its own port (no bind-close-reuse race).
    TCPStore has no authentication and any account on the cluster's network reaches its port,
    so every key of the group lives under a secret prefix (:func:`group_store`): made here, it
    reaches the other ranks only through ipyparallel's signed messages, and without it a
    connection to the port can neither read nor overwrite a key of the group.
    """
    global _STORE
    if kind == "file":
        return {"kind": "file", "path": os.path.join(tempfile.mkdtemp(prefix="gpuhub-rendezvous-"), "store")}
    import torch.distributed as dist

    _STORE = dist.TCPStore(
        "0.0.0.0", 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
    return {"kind": "tcp", "port": _STORE.port, "secret": secrets.token_hex(32)}


def group_store(rendezvous: dict, env: dict, timeout_s: float):
    """The store rank ``env['RANK']`` joins the process group through: the private FileStore,
    or the TCPStore (rank 0's own, made by :func:`open_rendezvous`) under the secret prefix."""
    import torch.distributed as dist

    world = int(env["WORLD_SIZE"])
    if rendezvous["kind"] == "file":
        return dist.FileStore(rendezvous["path"], world)
    if int(env["RANK"]) == 0:
        store = _STORE
    else:
        store = dist.TCPStore(
            env["MASTER_ADDR"],
            int(rendezvous["port"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
    return dist.PrefixStore(f"gpuhub-{rendezvous['secret']}", store)
