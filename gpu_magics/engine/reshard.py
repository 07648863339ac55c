"""Inside each engine, when a pool changes size in place: FSDP2 models (``fully_shard`` on a
1-D ``DeviceMesh``) and their optimizers moved from the old world size to the new one in the
same processes, the objects the user holds kept (``model`` and ``opt`` stay the same objects).

The order, on every rank of a pool (the kernel side drives it; ``engine.resize`` re-forms the
world group between the steps):

1. ``gather(names)`` on every rank of the OLD world. Collectives on the old world: one
   ``all_gather_object`` (every rank agrees on what it will gather, or all refuse), then per
   model (sorted names) ``get_model_state_dict`` and per optimizer of it (sorted names)
   ``get_optimizer_state_dict`` on the model's mesh group, full and offloaded: rank 0 holds the
   full state on its CPU, the other ranks nothing. Every rank remembers the FSDP structure
   (which modules were ``fully_shard``'ed, bottom-up, with ``reshard_after_forward``,
   ``mp_policy``, ``offload_policy``; ignored parameters). What cannot be moved is named with
   the reason (``refusal``).
2. Growing only: ``skeleton()`` on rank 0 (local): the models' architecture unsharded with
   parameters on the meta device, their optimizers (class, hyperparameters) and the structure,
   as cloudpickle bytes; ``adopt(blob)`` on each NEW rank (local) binds those names there.
3. The world group is re-formed at the new size (rank 0 stays rank 0).
4. ``rebuild()`` on every rank of the NEW world. Collectives on the new world: one
   ``all_gather_object`` (the same plan on every rank, rank 0 holding the state, or all refuse,
   none waits), then per model: FSDP2 undone in place (local: the original classes back, FSDP's
   hooks and state gone), ``fully_shard`` applied again with the same arguments on a new 1-D
   mesh of the new world (``init_device_mesh``: the world group itself), rank 0's full state
   broadcast into it (``set_model_state_dict`` with ``broadcast_from_rank0``), each optimizer
   object re-pointed at the new parameters by name and its state broadcast
   (``set_optimizer_state_dict``).
5. ``drop()`` (local) frees what ``gather`` held.

Torch internals this relies on (torch 2.13; for docs/known-issues.md): what ``fully_shard``
leaves on a module (the ``FSDP<Class>`` class with the original at
``__mro__[FSDPModule._orig_cls_mro_index]``, ``contract``'s ``STATE_KEY`` / ``REGISTRY_KEY``
entries in the module's ``__dict__``, ``_composable_state._module_state_mapping`` (read through
``_fsdp_state._get_module_fsdp_state``), ``_is_fsdp_managed_module`` /
``_fsdp_use_orig_params``); ``FSDPState``'s ``_modules``, ``_pre_forward_hook_handle`` /
``_post_forward_hook_handle``, ``_fsdp_param_groups``, ``_auto_reshard_after_forward``,
``_mp_policy``; ``FSDPParamGroup``'s ``fsdp_params``, ``mesh_info``, ``post_forward_mesh_info``
(its ``shard_mesh_size``), ``offload_policy`` and ``_module_to_pre_save_state_dict_hook_handle``
/ ``_module_to_pre_load_state_dict_hook_handle``; ``FSDPParam``'s ``sharded_param``,
``_module_info`` and ``_post_load_hook_handle``; and c10d's ``ProcessGroup._device_types``,
which torch's ``broadcast_from_rank0`` loading reads (``_device_types_of_inner``).
"""

from __future__ import annotations

import collections
import contextlib

# name -> what gather (or adopt) keeps for it in this process: models and optimizers
_HELD: dict[str, dict] = {}

# the key of an optimizer's param group that holds its parameters
_PARAMS = "params"


# ---------------------------------------------------------------- pure decisions


def refusal(facts: dict) -> str:
    """Why a model cannot be resharded in place ("" when it can), from what ``describe_model``
    found: ``mesh_dims`` (the set of its meshes' dimension counts), ``meshes`` (how many
    distinct meshes), ``mesh_size`` (the mesh's size), ``world`` (the world size),
    ``placements`` (whether every shard is ``Shard(0)``), ``groups_per_unit`` (the most
    parameter groups in one ``fully_shard`` call), ``units`` (how many calls),
    ``other_dtensors`` (parameters that are DTensors fully_shard does not manage)."""
    what = "save it (%distributed save NAME) before the resize, then define it again and restore it"
    if not facts.get("units"):
        return ""  # not an FSDP2 model: nothing to reshard (it is not gathered)
    if any(d != 1 for d in facts.get("mesh_dims", ())):
        dims = max(facts["mesh_dims"])
        return f"not resharded: it uses a {dims}-D DeviceMesh (HSDP or FSDP with TP); {what}"
    if facts.get("meshes", 1) > 1:
        return f"not resharded: its modules are sharded over {facts['meshes']} different meshes; {what}"
    if facts.get("mesh_size") != facts.get("world"):
        return (
            f"not resharded: its mesh has {facts.get('mesh_size')} of the world's "
            f"{facts.get('world')} ranks; {what}"
        )
    if not facts.get("placements", True):
        return (
            f"not resharded: a parameter is sharded on a dimension other than 0 (shard_placement_fn); {what}"
        )
    if facts.get("groups_per_unit", 1) > 1:
        return (
            "not resharded: a fully_shard call puts parameters on several meshes "
            f"(shard_placement_fn); {what}"
        )
    if facts.get("other_dtensors"):
        return (
            "not resharded: some parameters are DTensors that fully_shard does not manage "
            f"(tensor parallel); {what}"
        )
    return ""


def reshard_value(recorded, world: int) -> tuple[object, str]:
    """The ``reshard_after_forward`` to pass at ``world`` ranks for the one recorded, and a
    note when it had to change: an int (reshard to that many ranks after forward) must be a
    divisor of the new size other than 1 and the size itself, else True (reshard fully)."""
    if recorded is None or isinstance(recorded, bool):
        return recorded, ""
    n = int(recorded)
    if 1 < n < world and world % n == 0:
        return n, ""
    return True, f"reshard_after_forward={n} does not divide {world} ranks: True instead"


def optimizer_owner(opt_params: list[int], models: dict[str, set[int]]) -> tuple[str, str]:
    """The model an optimizer's parameters (ids) belong to, from each gathered model's
    parameter ids: (model name, "") or ("", why it is not resharded)."""
    if not opt_params:
        return "", "not resharded: it has no parameters"
    holders = sorted(name for name, ids in models.items() if ids & set(opt_params))
    if not holders:
        return "", ""  # not an optimizer of a sharded model: nothing to do
    if len(holders) > 1:
        return "", f"not resharded: its parameters are in {len(holders)} models ({', '.join(holders)})"
    if not set(opt_params) <= models[holders[0]]:
        return "", f"not resharded: some of its parameters are not in {holders[0]}"
    return holders[0], ""


def rebuild_order(held: dict[str, dict], names: list[str] | None) -> list[str]:
    """The models to rebuild, in the order every rank uses (rebuild is a collective): sorted
    names, those asked for (all held models when ``names`` is None)."""
    models = sorted(n for n, r in held.items() if r["kind"] == "model")
    if names is None:
        return models
    wanted = set(names)
    return [n for n in models if n in wanted or set(held[n]["optimizers"]) & wanted]


# ---------------------------------------------------------------- helpers


def _ns(ns: dict | None) -> dict:
    if ns is not None:
        return ns
    from IPython import get_ipython

    return get_ipython().user_ns


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _fsdp_state(module):
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    return _get_module_fsdp_state(module)


def _states(root) -> list:
    """The FSDP states in ``root``'s tree, bottom-up (reversed pre-order: a module's children
    come before it), each once."""
    seen, out = set(), []
    for _, module in reversed(list(root.named_modules())):
        state = _fsdp_state(module)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            out.append(state)
    return out


def _is_sharded_model(value) -> bool:
    import torch.nn as nn

    return isinstance(value, nn.Module) and any(_fsdp_state(m) is not None for m in value.modules())


@contextlib.contextmanager
def _device_types_of_inner():
    """While ``rebuild`` loads state: the world group answers ``_device_types`` (the devices of
    its backends, which torch's ``broadcast_from_rank0`` loading and its object collectives
    read) with its inner group's. gpuhub's ``ReconfigurableGroup`` registers no backend of its
    own, so c10d's property says none (torch 2.13: ``IndexError`` in ``_broadcast_tensors``).
    Nothing is changed where the group's class already answers it."""
    import torch.distributed as dist

    pg = dist.group.WORLD if dist.is_initialized() else None
    cls = type(pg)
    patch = (
        pg is not None
        and hasattr(pg, "_inner")
        and "_device_types" not in cls.__dict__
        and not pg._device_types
    )
    if patch:
        cls._device_types = property(lambda self: self._inner._device_types)
    try:
        yield
    finally:
        if patch:
            del cls._device_types


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".split("\n")[0][:300]


def _device_for(device_type: str):
    import torch

    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _owned(state, live: set[int]):
    """``state`` with every tensor that shares storage with a live one (``live``: data
    pointers) cloned: on the CPU, ``cpu_offload`` hands back a buffer, an ignored parameter or
    an optimizer's ``step`` itself, and training on would change what was gathered."""
    import torch

    if isinstance(state, torch.Tensor):
        if state.untyped_storage().data_ptr() in live:
            return state.detach().clone()
        return state
    if isinstance(state, dict):
        return type(state)((k, _owned(v, live)) for k, v in state.items())
    if isinstance(state, list):
        return [_owned(v, live) for v in state]
    return state


def _live_pointers(model, opts=()) -> set[int]:
    """The storages of a model's parameters and buffers (their local shards) and of its
    optimizers' state."""
    import torch
    from torch.distributed.tensor import DTensor

    ptrs = set()
    tensors = [*model.parameters(), *model.buffers()]
    for opt in opts:
        for s in opt.state.values():
            tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        if t.untyped_storage().size():
            ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def _nbytes(state) -> int:
    import torch

    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(v) for v in state)
    return 0


def describe_model(root) -> tuple[dict, dict]:
    """What ``fully_shard`` made of ``root``: the facts ``refusal`` decides on, and the
    structure ``rebuild`` applies again (units bottom-up with their arguments, the parameters
    each manages, the ignored ones, the mesh's device type). Local: no collective."""
    from torch.distributed.tensor import Shard

    fqn = {id(m): name for name, m in root.named_modules()}
    units, meshes, dims, placements, groups_per_unit = [], {}, set(), True, 1
    managed = set()
    for state in _states(root):
        groups = state._fsdp_param_groups
        groups_per_unit = max(groups_per_unit, len(groups))
        rsf: object = None
        if not state._auto_reshard_after_forward:
            rsf = True
            if groups:
                post = groups[0].post_forward_mesh_info
                if post is None:
                    rsf = False
                elif post is not groups[0].mesh_info:
                    rsf = int(post.shard_mesh_size)
        params = []
        for group in groups:
            mesh = group.mesh_info.mesh
            meshes[id(mesh)] = mesh
            dims.add(mesh.ndim)
            for fp in group.fsdp_params:
                info = fp._module_info
                name = ".".join(x for x in (fqn.get(id(info.module), "?"), info.param_name) if x)
                params.append(name)
                managed.add(id(fp.sharded_param))
                if tuple(fp.sharded_param.placements) != (Shard(0),) * mesh.ndim:
                    placements = False
        units.append(
            {
                "modules": [fqn[id(m)] for m in state._modules],
                "reshard_after_forward": rsf,
                "mp_policy": state._mp_policy,
                "offload_policy": groups[0].offload_policy if groups else None,
                "params": params,
            }
        )
    mesh = next(iter(meshes.values()), None)
    _, world = _rank_world()
    facts = {
        "units": len(units),
        "mesh_dims": sorted(dims),
        "meshes": len(meshes),
        "mesh_size": mesh.size() if mesh is not None else world,
        "world": world,
        "placements": placements,
        "groups_per_unit": groups_per_unit,
        "other_dtensors": sum(1 for p in root.parameters() if id(p) not in managed and _is_dtensor(p)),
    }
    ignored = [n for n, p in root.named_parameters() if id(p) not in managed and not _is_dtensor(p)]
    structure = {
        "units": units,
        "ignored": ignored,
        "device_type": mesh.device_type if mesh is not None else "cpu",
    }
    return facts, structure


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


# ---------------------------------------------------------------- gather (old world)


def gather(names: list[str] | None = None, ns: dict | None = None) -> dict:
    """On every rank of the old world, the same ``names`` (None: every name in the
    namespace): the full state of each FSDP2 model named and of each optimizer of one gathered
    onto rank 0's CPU, the structure kept on every rank (what an earlier gather held is
    dropped first). Collectives over the old world: one to agree on the plan (a rank that
    would gather something else, and every rank refuses), then each model's state (sorted
    names) and its optimizers' (sorted names) over the model's mesh group.

    Returns {"rank", "models": {name: {"units", "params"}}, "optimizers": {name: model},
    "inside": {name: model} (names bound to a part of a gathered model: they stay bound to it),
    "refused": {name: why}, "failed": {name: why} (a collective that failed: nothing held),
    "bytes": bytes held here (rank 0: the full states; others 0), "grads_dropped": [models
    whose gradients a rebuild will not keep], "unnamed_optimizers": {model: how many
    optimizers bound to no name hold its parameters (they are not re-pointed)}}. Every
    optimizer bound to a name in the namespace is looked at, whether named or not."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    drop()
    ns = _ns(ns)
    rank, world = _rank_world()
    keys = sorted(k for k in (ns if names is None else names) if k in ns and not k.startswith("_"))
    models = {k: ns[k] for k in keys if _is_sharded_model(ns[k])}
    out: dict = {"rank": rank, "models": {}, "optimizers": {}, "inside": {}, "refused": {}, "failed": {}}
    out.update(bytes=0, grads_dropped=[], unnamed_optimizers={})
    # a name bound to a part of another gathered model moves with it
    inside = {
        k: o
        for k, m in models.items()
        for o, om in models.items()
        if o != k and any(s is m for s in om.modules())
    }
    # local decisions first: what each rank will gather
    chosen: dict[str, dict] = {}
    for k in sorted(models):
        if k in inside:
            continue
        facts, structure = describe_model(models[k])
        why = refusal(facts)
        if why:
            out["refused"][k] = why
            continue
        chosen[k] = {"kind": "model", "object": models[k], "structure": structure, "state": None}
        chosen[k].update(optimizers=[], fqn=_param_names(models[k]))
    accepted = {k: set(rec["fqn"]) for k, rec in chosen.items()}
    opts: dict[str, dict] = {}
    # every optimizer bound to a name, named or not: one left on the old parameters would
    # update nothing after the rebuild
    for k in sorted(
        n for n, v in ns.items() if isinstance(v, torch.optim.Optimizer) and not n.startswith("_")
    ):
        value = ns[k]
        owner, why = optimizer_owner([id(p) for g in value.param_groups for p in g[_PARAMS]], accepted)
        if why:
            out["refused"][k] = why
        if owner:
            fqn = chosen[owner]["fqn"]
            groups = [[fqn[id(p)] for p in g[_PARAMS]] for g in value.param_groups]
            opts[k] = {"kind": "optimizer", "object": value, "model": owner, "groups": groups}
            opts[k].update(stateful=bool(value.state), state=None)
            chosen[owner]["optimizers"].append(k)
    why = _agree(_plan(chosen, opts, holds_state=True), world, "gather")
    if why:
        out["refused"].update({k: why for k in [*chosen, *opts]})
        return out
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    try:
        for _k, rec in sorted(chosen.items()):
            model = rec["object"]
            state = get_model_state_dict(model, options=options)  # reshards every group first
            rec["state"] = _owned(state, _live_pointers(model)) if rank == 0 else None
            out["bytes"] += _nbytes(state)
            for o in sorted(rec["optimizers"]):
                if opts[o]["stateful"]:  # one that never stepped is not given state (torch would)
                    osd = get_optimizer_state_dict(model, opts[o]["object"], options=options)
                    opts[o]["state"] = (
                        _owned(osd, _live_pointers(model, [opts[o]["object"]])) if rank == 0 else None
                    )
                    out["bytes"] += _nbytes(osd)
    except Exception as e:  # every rank's collective fails with it: nothing is held anywhere
        out["failed"] = {k: f"not gathered: {_describe(e)}" for k in [*chosen, *opts]}
        out["bytes"] = 0
        return out
    _HELD.update(chosen)
    _HELD.update(opts)
    for k, rec in chosen.items():
        out["models"][k] = {"units": len(rec["structure"]["units"]), "params": len(set(rec["fqn"].values()))}
        if any(p.grad is not None for p in rec["object"].parameters()):
            out["grads_dropped"].append(k)
    out["optimizers"] = {k: rec["model"] for k, rec in opts.items()}
    out["inside"] = {k: inside.get(p, p) for k, p in inside.items() if inside.get(p, p) in chosen}
    out["unnamed_optimizers"] = _unnamed_optimizers(accepted, {id(rec["object"]) for rec in opts.values()})
    return out


def _param_names(root) -> dict[int, str]:
    """Parameter id -> name in ``root``, for the parameters registered now and for each
    FSDP2 parameter's sharded one (registered between a forward and its backward, an
    unsharded one stands in for it; an optimizer holds the sharded one)."""
    names = {id(p): n for n, p in root.named_parameters()}
    fqn = {id(m): name for name, m in root.named_modules()}
    for state in _states(root):
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                info = fp._module_info
                names.setdefault(
                    id(fp.sharded_param), ".".join(x for x in (fqn[id(info.module)], info.param_name) if x)
                )
    return names


def _unnamed_optimizers(models: dict[str, set[int]], named: set[int]) -> dict[str, int]:
    """How many optimizers in this process, bound to no name in the namespace, hold a
    parameter of each gathered model (they are not re-pointed: they will update nothing)."""
    import gc

    import torch

    found: dict[str, int] = {}
    for obj in gc.get_objects():
        # type(), not isinstance: that asks every object its __class__, and some warn
        if issubclass(type(obj), torch.optim.Optimizer) and id(obj) not in named:
            ids = {id(p) for g in obj.param_groups for p in g[_PARAMS]}
            for name, params in models.items():
                if ids & params:
                    found[name] = found.get(name, 0) + 1
    return found


def held() -> dict:
    """What this process holds from ``gather`` or ``adopt``: name -> kind, and bytes."""
    return {
        "names": {k: r["kind"] for k, r in sorted(_HELD.items())},
        "bytes": sum(_nbytes(r.get("state")) for r in _HELD.values()),
    }


def drop(names: list[str] | None = None) -> dict:
    """Forget what ``gather`` / ``adopt`` held (all of it when ``names`` is None; a model's
    optimizers go with it): the full states on rank 0, the structure everywhere. Local.
    Returns {"dropped": names, "bytes": bytes freed}."""
    import gc

    keys = set(_HELD) if names is None else {k for k in names if k in _HELD}
    for k in list(keys):
        if _HELD[k]["kind"] == "model":
            keys.update(_HELD[k]["optimizers"])
    freed = sum(_nbytes(_HELD[k].get("state")) for k in keys)
    for k in sorted(keys):
        rec = _HELD.pop(k)
        owner = _HELD.get(rec.get("model", ""))
        if rec["kind"] == "optimizer" and owner is not None:
            owner["optimizers"].remove(k)
    gc.collect()
    return {"dropped": sorted(keys), "bytes": freed}


# ---------------------------------------------------------------- skeleton / adopt (growing)


def _meta_param(shape, dtype, requires_grad):
    import torch
    import torch.nn as nn

    return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)


def _plain_module(cls, state):
    module = cls.__new__(cls)
    module.__setstate__(state)
    return module


def _new_optimizer(cls, defaults, groups):
    """An optimizer of ``cls`` over ``groups`` (its params the adopted model's): through its
    constructor where that takes its defaults as keywords, else as unpickling makes one."""
    try:
        opt = cls(groups, **defaults)
    except Exception:
        opt = cls.__new__(cls)
        opt.__setstate__(
            {"defaults": dict(defaults), "state": collections.defaultdict(dict), "param_groups": groups}
        )
    return opt


_FSDP_ATTRS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")


def _fsdp_hook_ids(root) -> set[int]:
    """The ids of every hook ``fully_shard`` registered in ``root``'s tree."""
    ids = set()
    for state in _states(root):
        for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
            ids.update(_handle_ids(h))
        for group in state._fsdp_param_groups:
            for d in (
                group._module_to_pre_save_state_dict_hook_handle,
                group._module_to_pre_load_state_dict_hook_handle,
            ):
                for h in d.values():
                    ids.update(_handle_ids(h))
            for fp in group.fsdp_params:
                ids.update(_handle_ids(fp._post_load_hook_handle))
    return ids


def _handle_ids(handle) -> list[int]:
    if hasattr(handle, "handles"):  # autograd's _MultiHandle (a fully_shard of several modules)
        return [i for h in handle.handles for i in _handle_ids(h)]
    return [handle.id] if hasattr(handle, "id") else []


def _plain_state(module, hook_ids: set[int]) -> dict:
    """A module's ``__dict__`` as it was before ``fully_shard``: FSDP's keys and hooks out,
    buffers on the CPU (parameters are made meta by the pickler)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    state = {}
    for key, value in module.__dict__.items():
        if key in (STATE_KEY, REGISTRY_KEY) or key in _FSDP_ATTRS:
            continue
        if key == "_buffers":
            value = collections.OrderedDict(
                (k, None if v is None else v.detach().cpu().clone()) for k, v in value.items()
            )
        elif key.endswith(("hooks", "_hooks_with_kwargs", "_hooks_always_called")) and isinstance(
            value, dict
        ):
            value = type(value)((i, h) for i, h in value.items() if i not in hook_ids)
        state[key] = value
    return state


def skeleton(names: list[str] | None = None, ns: dict | None = None) -> bytes:
    """On rank 0 after ``gather`` (local): cloudpickle bytes of each gathered model's
    architecture unsharded (its own classes, FSDP's hooks and state out, parameters on the meta
    device, buffers' values on the CPU), its optimizers (class, defaults, hyperparameters, no
    state), the names bound to parts of them, and the structure ``rebuild`` needs; for
    ``adopt`` on the new ranks."""
    import cloudpickle
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    ns = _ns(ns)
    models = rebuild_order(_HELD, names)
    hook_ids: set[int] = set()
    for k in models:
        hook_ids |= _fsdp_hook_ids(_HELD[k]["object"])

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, nn.Parameter):
                return _meta_param, (tuple(obj.shape), obj.dtype, obj.requires_grad)
            if isinstance(obj, nn.Module):
                cls = type(obj)
                if issubclass(cls, FSDPModule):
                    cls = cls.__mro__[cls._orig_cls_mro_index]
                return _plain_module, (cls, _plain_state(obj, hook_ids))
            if isinstance(obj, torch.optim.Optimizer):
                groups = [dict(g, params=list(g[_PARAMS])) for g in obj.param_groups]
                return _new_optimizer, (type(obj), dict(obj.defaults), groups)
            if isinstance(obj, (dist.ProcessGroup, DeviceMesh)):
                raise TypeError(f"a {type(obj).__name__} cannot go to a new rank")
            return super().reducer_override(obj)

    bound = {k: _HELD[k]["object"] for k in models}
    records = {}
    for k in models:
        rec = _HELD[k]
        records[k] = {"kind": "model", "structure": rec["structure"], "optimizers": list(rec["optimizers"])}
        for o in rec["optimizers"]:
            orec = _HELD[o]
            bound[o] = orec["object"]
            records[o] = {
                "kind": "optimizer",
                "model": k,
                "groups": orec["groups"],
                "stateful": orec["stateful"],
            }
    # names bound to parts of the models go with them (the same objects after adopt)
    for key, value in ns.items():
        if key in bound or key.startswith("_") or not isinstance(value, nn.Module):
            continue
        if any(value is m for k in models for m in _HELD[k]["object"].modules()):
            bound[key] = value
    import io

    buf = io.BytesIO()
    Pickler(buf).dump({"bound": bound, "records": records})
    return buf.getvalue()


def adopt(blob: bytes, ns: dict | None = None) -> dict:
    """On each new rank (local): bind the names of ``skeleton``'s bytes in this namespace (the
    models as plain modules with meta parameters, their optimizers, the names of their parts)
    and keep the structure for ``rebuild``. Returns {"names", "models", "optimizers"}."""
    import cloudpickle

    ns = _ns(ns)
    data = cloudpickle.loads(blob)
    for key, value in data["bound"].items():
        ns[key] = value
    for key, rec in data["records"].items():
        rec = dict(rec, object=data["bound"][key], state=None)
        if rec["kind"] == "model":
            rec["fqn"] = {}
        _HELD[key] = rec
    kinds = data["records"]
    return {
        "names": sorted(data["bound"]),
        "models": sorted(k for k, r in kinds.items() if r["kind"] == "model"),
        "optimizers": sorted(k for k, r in kinds.items() if r["kind"] == "optimizer"),
    }


# ---------------------------------------------------------------- rebuild (new world)


def unshard_in_place(root) -> int:
    """Undo ``fully_shard`` on ``root``'s tree in place, locally (no collective: its old
    group may be gone): every managed module back to its own class, FSDP's hooks, state and
    registry entries removed, and each parameter FSDP managed replaced by a plain parameter of
    its full shape and dtype on the meta device (values come from the full state later).
    Returns how many ``fully_shard`` units were undone."""
    import torch.nn as nn
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule

    states = _states(root)
    replaced: dict[int, nn.Parameter] = {}
    for state in states:
        for h in {
            id(h): h for h in (state._pre_forward_hook_handle, state._post_forward_hook_handle)
        }.values():
            h.remove()
        for group in state._fsdp_param_groups:
            for d in (
                group._module_to_pre_save_state_dict_hook_handle,
                group._module_to_pre_load_state_dict_hook_handle,
            ):
                for h in d.values():
                    h.remove()
                d.clear()
            for fp in group.fsdp_params:
                fp._post_load_hook_handle.remove()
                sharded = fp.sharded_param
                new = replaced.get(id(sharded))
                if new is None:
                    new = _meta_param(tuple(sharded.shape), sharded.dtype, sharded.requires_grad)
                    replaced[id(sharded)] = new
                info = fp._module_info
                for module, name in [
                    (info.module, info.param_name),
                    *zip(info.shared_modules, info.shared_param_names, strict=True),
                ]:
                    module._parameters[name] = new
    for module in root.modules():
        for key in (STATE_KEY, REGISTRY_KEY):
            entries = module.__dict__.get(key)
            if isinstance(entries, dict):
                for k in [
                    k
                    for k, v in entries.items()
                    if k == "fully_shard" or getattr(k, "__name__", "") == "fully_shard"
                ]:
                    del entries[k]
                if not entries:
                    del module.__dict__[key]
        for attr in _FSDP_ATTRS:
            module.__dict__.pop(attr, None)
        if module in _module_state_mapping:
            del _module_state_mapping[module]
        cls = type(module)
        if issubclass(cls, FSDPModule):
            module.__class__ = cls.__mro__[cls._orig_cls_mro_index]
    return len(states)


def _materialize(root, modules: list, device, skip: set[int]) -> None:
    """Every meta parameter in the trees of ``modules`` (but those in ``skip``) given storage
    on ``device``, in every module of ``root`` that holds it (tied parameters stay tied);
    values are loaded afterwards."""
    import torch
    import torch.nn as nn

    new: dict[int, nn.Parameter] = {}
    for top in modules:
        for p in top.parameters():
            if p.is_meta and id(p) not in skip and id(p) not in new:
                new[id(p)] = nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad
                )
    if not new:
        return
    for module in root.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) in new:
                module._parameters[name] = new[id(p)]


def _reapply(root, structure: dict, mesh) -> list[str]:
    """``fully_shard`` on ``root``'s units again, bottom-up, with their arguments, on ``mesh``;
    meta parameters materialized on the mesh's device one unit at a time (at most one unit's
    parameters full-size at once). Returns notes on arguments that had to change."""
    import torch
    from torch.distributed.fsdp import fully_shard

    device = _device_for(mesh.device_type)
    world = mesh.size()
    named = dict(root.named_parameters())
    ignored = {named[n] for n in structure["ignored"] if n in named}
    notes = []
    for unit in structure["units"]:
        modules = [root.get_submodule(f) for f in unit["modules"]]
        _materialize(root, modules, device, {id(p) for p in ignored})
        rsf, note = reshard_value(unit["reshard_after_forward"], world)
        if note:
            notes.append(f"{unit['modules'][0] or 'the root'}: {note}")
        kwargs = {"mesh": mesh, "reshard_after_forward": rsf}
        if unit["mp_policy"] is not None:
            kwargs["mp_policy"] = unit["mp_policy"]
        if unit["offload_policy"] is not None:
            kwargs["offload_policy"] = unit["offload_policy"]
        if ignored:
            kwargs["ignored_params"] = ignored
        fully_shard(modules[0] if len(modules) == 1 else modules, **kwargs)
    _materialize(root, [root], device, set())  # ignored parameters of a new rank
    for module in root.modules():
        for k, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[k] = torch.empty_like(b, device=device)
    return notes


def _check_structure(root, structure: dict) -> str:
    """ "" when the rebuilt units manage the same parameters as before, else what differs."""
    _, now = describe_model(root)
    before = [(u["modules"], sorted(u["params"])) for u in structure["units"]]
    after = [(u["modules"], sorted(u["params"])) for u in now["units"]]
    if sorted(map(str, before)) != sorted(map(str, after)):
        return "the rebuilt fully_shard units manage other parameters than before"
    return ""


def _plan(models: dict[str, dict], opts: dict[str, dict], holds_state: bool) -> dict:
    """What this rank is about to gather or rebuild, as every rank must agree on it:
    each model's name, device type, units (modules and parameters) and optimizers (names,
    parameter names, whether they have state); and whether it holds the gathered state."""
    plan = []
    for k in sorted(models):
        rec = models[k]
        units = [(u["modules"], sorted(u["params"])) for u in rec["structure"]["units"]]
        mine = [(o, opts[o]["groups"], opts[o]["stateful"]) for o in sorted(rec["optimizers"])]
        plan.append((k, rec["structure"]["device_type"], units, mine))
    return {"models": plan, "holds_state": holds_state}


def plan_differs(plans: list[dict], doing: str = "rebuild") -> str:
    """ "" when every rank's plan (in rank order) is the same and rank 0 holds the gathered
    state, else what is wrong: the same answer on every rank (each sees every plan)."""
    done = {"rebuild": "rebuilt", "gather": "gathered"}[doing]
    if not plans:
        return ""
    if not plans[0]["holds_state"]:
        return (
            f"not {done}: rank 0 holds no gathered state for these names (gather must run on every "
            "rank of the old world first)"
        )
    odd = [r for r, p in enumerate(plans) if p["models"] != plans[0]["models"]]
    if odd:
        ranks = ", ".join(map(str, odd))
        return (
            f"not {done}: rank {ranks} would {doing} other models, units or optimizers than rank 0 "
            f"({'gather or adopt' if doing == 'rebuild' else 'gather'} the same names on every rank)"
        )
    return ""


def _agree(mine: dict, world: int, doing: str) -> str:
    """Every rank's plan to every rank (``all_gather_object`` on the world group), judged the
    same way on each."""
    import torch.distributed as dist

    if world == 1 or not dist.is_initialized():
        return plan_differs([mine], doing)
    plans: list = [None] * world
    with _device_types_of_inner():
        dist.all_gather_object(plans, mine)
    return plan_differs(plans, doing)


def _copy_osd(osd: dict) -> dict:
    """A full optimizer state to load, its containers and scalars new (``load_state_dict``
    keeps a ``step`` tensor as given, and torch's loading changes the dicts it is given):
    what ``gather`` held stays as it was gathered."""
    import torch

    def scalar(v):
        return v.clone() if isinstance(v, torch.Tensor) and v.dim() == 0 else v

    return {
        "state": {p: {k: scalar(v) for k, v in s.items()} for p, s in osd["state"].items()},
        "param_groups": [dict(g, params=list(g["params"])) for g in osd["param_groups"]],
    }


def rebuild(names: list[str] | None = None, mesh=None, ns: dict | None = None) -> dict:
    """On every rank of the new world, the same ``names`` (None: every model held), after
    ``gather`` (old ranks) or ``adopt`` (new ranks): each model resharded in place onto
    ``mesh`` (None: a new 1-D mesh of the whole new world, on the device type it had), its
    full state broadcast from rank 0, its optimizers re-pointed at the new parameters (by
    name) and their state broadcast from rank 0. Collectives over the new world group, models
    in sorted name order. Stops at the first model that fails (the other ranks would wait in
    its collectives).

    Returns {"rank", "world", "models": {name: {"units", "mesh"}}, "optimizers": {name:
    model}, "notes": [...], "failed": {name: why}, "not_rebuilt": [names after a failure],
    "names_changed": [names no longer bound to the object gathered]}."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    ns = _ns(ns)
    rank, world = _rank_world()
    order = rebuild_order(_HELD, names)
    out: dict = {"rank": rank, "world": world, "models": {}, "optimizers": {}, "notes": [], "failed": {}}
    out["not_rebuilt"], out["names_changed"] = [], []
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    meshes: dict[str, object] = {}
    held_state = all(_HELD[k]["state"] is not None for k in order) and all(
        _HELD[o]["state"] is not None for k in order for o in _HELD[k]["optimizers"] if _HELD[o]["stateful"]
    )
    models = {k: _HELD[k] for k in order}
    opts = {o: _HELD[o] for k in order for o in _HELD[k]["optimizers"]}
    why = _agree(_plan(models, opts, held_state), world, "rebuild")  # every rank goes on, or none
    if why:
        out["failed"] = {k: why for k in order}
        return out
    for i, k in enumerate(order):
        rec = _HELD[k]
        root = rec["object"]
        try:
            if rank == 0 and rec["state"] is None:
                raise RuntimeError("rank 0 holds no gathered state for it (gather first, on every rank)")
            device_type = rec["structure"]["device_type"]
            if mesh is not None:
                use = mesh
            else:
                if device_type not in meshes:
                    meshes[device_type] = init_device_mesh(device_type, (world,))
                use = meshes[device_type]
            if _is_sharded_model(root):
                unshard_in_place(root)
            out["notes"] += [f"{k}: {n}" for n in _reapply(root, rec["structure"], use)]
            state = dict(rec["state"]) if rank == 0 else {}
            with _device_types_of_inner():
                set_model_state_dict(root, state, options=options)
            why = _check_structure(root, rec["structure"])
            if why:
                raise RuntimeError(why)
            params = dict(root.named_parameters())
            for o in sorted(rec["optimizers"]):
                orec = _HELD[o]
                opt = orec["object"]
                opt.state.clear()
                for group, fqns in zip(opt.param_groups, orec["groups"], strict=True):
                    group[_PARAMS] = [params[f] for f in fqns]
                if orec["stateful"]:
                    osd = orec["state"]
                    if rank == 0:
                        if osd is None:
                            raise RuntimeError(f"rank 0 holds no gathered state for {o}")
                        osd = _copy_osd(osd)
                    with _device_types_of_inner():
                        set_optimizer_state_dict(root, opt, osd if rank == 0 else {}, options=options)
                out["optimizers"][o] = k
            out["models"][k] = {"units": len(rec["structure"]["units"]), "mesh": use.size()}
        except Exception as e:
            out["failed"][k] = f"not rebuilt: {_describe(e)}"
            out["not_rebuilt"] = order[i + 1 :]
            break
    for k in order:
        rec = _HELD[k]
        for name in [k, *rec["optimizers"]]:
            if ns.get(name) is not _HELD[name]["object"]:
                out["names_changed"].append(name)
    return out
