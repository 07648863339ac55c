"""Inside each surviving engine, when a pool shrinks in place: the world group re-formed at the
new size in the same process, the rank's torchrun variables renumbered, and what holds the old
groups moved to the new world (DDP) or named as lost (subgroups, other meshes). FSDP2 models
are resharded by ``engine.reshard`` around this (gathered before the departure, rebuilt
after). The kernel side is ``kernel.resize``."""

from __future__ import annotations

import os

from gpu_magics.engine import groups
from gpu_magics.engine.recovery import _STATE, ddp_options, fresh_reducer, init_group
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


def join_world(rendezvous: dict, env_update: dict, timeout_s: float, fresh: bool = False) -> dict:
    """Leave every old group and join the new world on ``rendezvous`` with the rank and size
    in ``env_update`` (torchrun's variables, renumbered); every DDP module in the process goes
    on with the new world (``_update_process_group``: its replicated parameters are the same on
    every survivor; ``fresh``: their gradient buckets made again, for ranks that join).
    Returns what was moved and what could not be."""
    import gc

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
            if fresh:  # new ranks join: every rank's buckets as a new DDP module's
                fresh_reducer(obj, dist.group.WORLD)
            else:  # the same ranks, fewer: their common layout goes on
                obj._update_process_group(dist.group.WORLD)
            moved.append(obj)
    ddp_names = sorted(
        k for k, v in ns.items() if isinstance(v, DistributedDataParallel) and not k.startswith("_")
    )
    ns.update(rank=rank, world_size=world, local_rank=int(os.environ["LOCAL_RANK"]), dist=dist)
    return {
        "rank": rank,
        "world": world,
        "ddp": ddp_names,
        "ddp_count": len(moved),
        "lost_groups": lost["group"],
        "lost_meshes": lost["mesh"],
    }


def world_check() -> bool:
    """A collective on the world group (every rank of it calls this): True where it answered
    right on this rank."""
    import torch
    import torch.distributed as dist

    check = torch.ones(1)
    dist.all_reduce(check)
    return int(check.item()) == dist.get_world_size()


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


# growing: a copy of rank 0's names for the new ranks ---------------------------------------


def _rebuilt_ddp(module, options: dict):
    """A DDP module on a new rank, around the copy of rank 0's module (the same parameters as
    every other rank's replica: no broadcast, which the other ranks would have to join)."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, init_sync=False, **options)


def _by_name(name: str):
    """On a new rank: the object bound to ``name`` there (a sharded model or its optimizer,
    which the move of sharded models put there before the copy arrives)."""
    return _ns()[name]


def _pickler(file, refs: dict[int, str] | None = None):
    import cloudpickle
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gpu_magics.engine.recovery import _is_fsdp

    refs = refs or {}

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            name = refs.get(id(obj))
            if name is not None:  # moved another way (a sharded model): referred to by name
                return _by_name, (name,)
            if isinstance(obj, DistributedDataParallel):
                return _rebuilt_ddp, (obj.module, ddp_options(obj))
            if isinstance(obj, dist.ProcessGroup) or type(obj).__name__ == "DeviceMesh":
                raise TypeError("it holds a process group of the old world")
            if _is_fsdp(obj):
                raise TypeError("an FSDP2 model is resharded, not copied")
            return super().reducer_override(obj)

    return Pickler(file, protocol=5)


def _dumps(values: dict, refs: dict[int, str] | None = None) -> bytes:
    import io

    buf = io.BytesIO()
    _pickler(buf, refs).dump(values)
    return buf.getvalue()


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".split("\n")[0][:160]


def snapshot(skip: list[str] | None = None) -> dict:
    """Rank 0's names for the ranks a pool grows by: one cloudpickle of every name a cell
    defined or imported (functions and classes of cells by value; DDP modules as their module
    and options), less ``skip`` (moved another way: what refers to them refers by name) and
    what cannot be pickled (named, with why). Modules go by name. Shared objects stay shared
    (one pickle)."""
    import types

    from IPython import get_ipython

    from gpu_magics.engine.namespace import SETUP_NAMES

    shell = get_ipython()
    ns, hidden = shell.user_ns, shell.user_ns_hidden
    missing = object()
    names = [
        n
        for n, v in list(ns.items())
        if not n.startswith("_")
        and n not in SETUP_NAMES
        and v is not hidden.get(n, missing)
        and n not in (skip or ())
    ]
    modules = {n: ns[n].__name__ for n in names if isinstance(ns[n], types.ModuleType)}
    objects = [n for n in names if n not in modules]
    refs = {id(ns[n]): n for n in skip or () if n in ns}  # what the cells' objects refer to by name
    failed: dict[str, str] = {}
    while True:
        try:
            blob = _dumps({n: ns[n] for n in objects}, refs)
            break
        except Exception:
            bad = {}
            for n in objects:
                try:
                    _dumps({n: ns[n]}, refs)
                except Exception as e:
                    bad[n] = _short(e)
            if not bad:  # each alone pickles, together not: copy none rather than guess
                failed.update({n: "could not be copied together with the others" for n in objects})
                objects, blob = [], _dumps({}, refs)
                break
            failed.update(bad)
            objects = [n for n in objects if n not in bad]
    return {"blob": blob, "modules": modules, "copied": sorted(objects), "failed": failed}


def _own_globals(value, ns: dict):
    """A cell's function whose globals are the unpickled copy's private dict, made again on
    this namespace (so that it reads and rebinds the rank's names, as it did on rank 0)."""
    import types

    if (
        isinstance(value, types.FunctionType)
        and value.__module__ == "__main__"
        and value.__globals__ is not ns
    ):
        f = types.FunctionType(value.__code__, ns, value.__name__, value.__defaults__, value.__closure__)
        f.__kwdefaults__, f.__qualname__, f.__doc__ = value.__kwdefaults__, value.__qualname__, value.__doc__
        f.__dict__.update(value.__dict__)
        return f
    if isinstance(value, type) and value.__module__ == "__main__":
        for key, member in list(vars(value).items()):
            if isinstance(member, types.FunctionType) and member.__globals__ is not ns:
                setattr(value, key, _own_globals(member, ns))
    return value


def adopt(copy: dict) -> list[str]:
    """On a new rank, in the new world: rank 0's names from :func:`snapshot`; the names set."""
    import importlib
    import pickle

    ns = _ns()
    for name, module in copy["modules"].items():
        ns[name] = importlib.import_module(module)
    values = pickle.loads(copy["blob"])
    for name, value in values.items():
        ns[name] = _own_globals(value, ns)
    return sorted([*copy["modules"], *values])


def difference(a, b, path: str = "") -> str:
    """Where two state dicts first differ ("" where they are equal bit for bit: tensors by
    ``torch.equal``, with dtype and shape)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach().cpu(), b.detach().cpu())
        )
        return "" if same else path or "the tensor"
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path} (keys {sorted(map(str, a.keys() ^ b.keys()))[:3]})"
        return next((d for k in a if (d := difference(a[k], b[k], f"{path}.{k}" if path else str(k)))), "")
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path} (length)"
        return next(
            (d for i, (x, y) in enumerate(zip(a, b, strict=True)) if (d := difference(x, y, f"{path}[{i}]"))),
            "",
        )
    return "" if a == b else f"{path} ({a!r} != {b!r})"[:200]


def check_resharded(models: dict[str, list[str]]) -> dict[str, str]:
    """Every rank of the new world, after ``reshard.rebuild`` and before ``reshard.drop``: each
    model's (and its optimizers') full state gathered again from the new shards, compared on
    rank 0 with what ``reshard.gather`` held: "" where equal, else where they differ (the other
    ranks answer "")."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from gpu_magics.engine import reshard

    ns = _ns()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {}
    for name in sorted(models):
        model = ns[name]
        now = get_model_state_dict(model, options=options)
        found = ""
        for opt in models[name]:
            osd = get_optimizer_state_dict(model, ns[opt], options=options)
            held = reshard._HELD[opt]["state"]  # None: an optimizer without state (nothing moved)
            if dist.get_rank() == 0 and not found and held is not None:
                found = difference(osd, held, opt)
        if dist.get_rank() == 0 and not found:
            found = difference(now, reshard._HELD[name]["state"], name)
        out[name] = found
    return out


def reshard_empty(names: list[str], old_world: int) -> dict:
    """Every rank of the new world, after a rank was lost (its shards with it): each FSDP2
    model named made again on a mesh of the new world, in place (the same module and optimizer
    objects; ``engine.reshard``'s undo and re-apply), its parameters not yet filled and its
    optimizers' state cleared: what a checkpoint is then restored into. ``old_world``: the size
    of the world its mesh spanned. Returns, per model,
    its optimizers' names, or why it was not made again."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from gpu_magics.engine import reshard

    ns = _ns()
    out: dict = {"models": {}, "refused": {}}
    for name in sorted(names):
        root = ns.get(name)
        try:
            facts, structure = reshard.describe_model(root)
            why = reshard.refusal(dict(facts, world=old_world))  # its mesh was the old world's
            if why:
                out["refused"][name] = why
                continue
            fqn = reshard._param_names(root)
            mine = set(fqn)
            opts = {
                k: [[fqn[id(p)] for p in g["params"]] for g in v.param_groups]
                for k, v in ns.items()
                if isinstance(v, torch.optim.Optimizer)
                and not k.startswith("_")
                and all(id(p) in mine for g in v.param_groups for p in g["params"])
            }
            reshard.unshard_in_place(root)
            mesh = init_device_mesh(structure.get("device_type", "cpu"), (dist.get_world_size(),))
            reshard._reapply(root, structure, mesh)
            params = dict(root.named_parameters())
            for k, groups in opts.items():
                for group, fqns in zip(ns[k].param_groups, groups, strict=True):
                    group["params"] = [params[f] for f in fqns]
                ns[k].state.clear()
            out["models"][name] = sorted(opts)
        except Exception as e:
            out["refused"][name] = f"could not be made again ({_short(e)})"
    return out
