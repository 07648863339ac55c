"""Inside each surviving engine, when a pool shrinks in place: the world group re-formed at the
new size in the same process, the rank's torchrun variables renumbered, and what holds the old
groups moved to the new world (DDP) or named as lost (subgroups, other meshes). FSDP2 models
are resharded by ``engine.reshard`` around this (gathered before the departure, rebuilt
after). The kernel side is ``kernel.resize``."""

from __future__ import annotations

import os

from gpu_magics.engine import groups
from gpu_magics.engine.recovery import _STATE, init_group
from gpu_magics.engine.rendezvous import group_store


def _ns() -> dict:
    from IPython import get_ipython

    return get_ipython().user_ns


def bound_groups(ns: dict | None = None) -> dict[str, list[str]]:
    """Names bound to a process group or a DeviceMesh that is not an FSDP2 model's (the ones
    a new world cannot keep): kind -> names."""
    import torch.distributed as dist

    ns = _ns() if ns is None else ns
    found: dict[str, list[str]] = {"group": [], "mesh": []}
    for key, value in list(ns.items()):
        if key.startswith("_"):
            continue
        if isinstance(value, dist.ProcessGroup):
            found["group"].append(key)
        elif type(value).__name__ == "DeviceMesh":
            found["mesh"].append(key)
    return found


def join_world(rendezvous: dict, env_update: dict, timeout_s: float) -> dict:
    """Leave every old group and join the new world on ``rendezvous`` with the rank and size
    in ``env_update`` (torchrun's variables, renumbered); every DDP module in the process goes
    on with the new world (``_update_process_group``: its replicated parameters are the same on
    every survivor). Returns what was moved and what could not be."""
    import gc

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ns = _ns()
    lost = bound_groups(ns)
    backend = _STATE["backend"] or "gloo"
    try:
        dist.destroy_process_group()
    except Exception:  # the departed ranks' connections are gone; the groups are gone here too
        pass
    groups._LIVE.clear()
    os.environ.update(env_update)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_group(backend, group_store(rendezvous, dict(os.environ), timeout_s), rank, world, timeout_s)
    moved = []
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel):
            obj._update_process_group(dist.group.WORLD)
            moved.append(obj)
    ddp_names = sorted(
        k for k, v in ns.items() if isinstance(v, DistributedDataParallel) and not k.startswith("_")
    )
    ns.update(rank=rank, world_size=world, local_rank=int(os.environ["LOCAL_RANK"]), dist=dist)
    check = torch.ones(1)
    dist.all_reduce(check)
    return {
        "rank": rank,
        "world": world,
        "checked": int(check.item()) == world,
        "ddp": ddp_names,
        "ddp_count": len(moved),
        "lost_groups": lost["group"],
        "lost_meshes": lost["mesh"],
    }


def ddp_digests(names: list[str]) -> dict[str, str]:
    """A digest of each named DDP module's parameters and buffers on this rank (the kernel
    compares them across ranks: replicas must be equal)."""
    import hashlib

    import torch

    ns = _ns()
    out = {}
    for name in names:
        h = hashlib.sha256()
        module = ns[name].module
        for t in [*module.parameters(), *module.buffers()]:
            h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()
    return out
