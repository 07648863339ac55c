"""FSDP2 models and their optimizers moved to another world size in the same processes
(``engine.reshard``): the same ``model`` and ``opt`` objects on every surviving rank, their
full parameters and Adam state bit for bit, and the next step equal to a fresh FSDP2 model of
the new world loaded from the same full state (``torch.equal``: the same computation) and close
to a one-process model trained on the same global batch.

Real parts: torch.multiprocessing (spawn), gpuhub's reconfigurable groups over gloo on CPU
(``engine.groups``), real ``fully_shard`` with a 1-D ``DeviceMesh``, Adam, a private FileStore
per world. Shrink 4 -> 3 and 2 -> 1 (the departing ranks gather, then leave); grow 2 -> 3 (a
third process joins the new world and adopts the model from rank 0's skeleton)."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta

import pytest

from gpu_magics.engine import reshard

TIMEOUT = timedelta(seconds=60)
BATCH = 12  # rows of every global batch: divisible by 4, 3, 2 and 1 ranks


# ---------------------------------------------------------------- pure decisions


@pytest.mark.parametrize(
    "facts, says",
    [
        ({"units": 0}, ""),
        ({"units": 3, "mesh_dims": [1], "meshes": 1, "mesh_size": 4, "world": 4}, ""),
        ({"units": 3, "mesh_dims": [2], "meshes": 1, "mesh_size": 4, "world": 4}, "2-D DeviceMesh"),
        ({"units": 3, "mesh_dims": [1, 2], "meshes": 2, "mesh_size": 4, "world": 4}, "2-D DeviceMesh"),
        ({"units": 3, "mesh_dims": [1], "meshes": 2, "mesh_size": 4, "world": 4}, "2 different meshes"),
        ({"units": 3, "mesh_dims": [1], "meshes": 1, "mesh_size": 2, "world": 4}, "2 of the world's 4"),
        (
            {"units": 1, "mesh_dims": [1], "meshes": 1, "mesh_size": 4, "world": 4, "placements": False},
            "dimension other than 0",
        ),
        (
            {"units": 1, "mesh_dims": [1], "meshes": 1, "mesh_size": 4, "world": 4, "groups_per_unit": 2},
            "several meshes",
        ),
        (
            {"units": 1, "mesh_dims": [1], "meshes": 1, "mesh_size": 4, "world": 4, "other_dtensors": 2},
            "tensor parallel",
        ),
    ],
)
def test_refusal(facts, says):
    why = reshard.refusal(facts)
    if not says:
        assert why == ""
    else:
        assert says in why and why.startswith("not resharded: ") and "(%distributed save NAME) before" in why


@pytest.mark.parametrize(
    "recorded, world, value, noted",
    [
        (None, 3, None, False),
        (True, 3, True, False),
        (False, 1, False, False),
        (2, 4, 2, False),
        (2, 6, 2, False),
        (3, 6, 3, False),
        (2, 3, True, True),  # 2 does not divide 3
        (4, 4, True, True),  # the whole world: not a smaller reshard
        (2, 2, True, True),
        (2, 1, True, True),
    ],
)
def test_reshard_value(recorded, world, value, noted):
    got, note = reshard.reshard_value(recorded, world)
    assert got == value and type(got) is type(value)
    assert bool(note) is noted


@pytest.mark.parametrize(
    "params, models, owner, says",
    [
        ([1, 2], {"m": {1, 2, 3}}, "m", ""),
        ([1, 2, 3], {"m": {1, 2, 3}, "n": {4}}, "m", ""),
        ([9], {"m": {1, 2}}, "", ""),  # not a sharded model's optimizer: left alone, unsaid
        ([], {"m": {1}}, "", "no parameters"),
        ([1, 4], {"m": {1}, "n": {4}}, "", "2 models (m, n)"),
        ([1, 9], {"m": {1}}, "", "not in m"),
    ],
)
def test_optimizer_owner(params, models, owner, says):
    got, why = reshard.optimizer_owner(params, models)
    assert got == owner
    assert (says in why) if says else why == ""


def test_rebuild_order():
    held = {
        "b": {"kind": "model", "optimizers": ["opt_b"]},
        "a": {"kind": "model", "optimizers": []},
        "opt_b": {"kind": "optimizer", "model": "b"},
    }
    assert reshard.rebuild_order(held, None) == ["a", "b"]
    assert reshard.rebuild_order(held, ["opt_b"]) == ["b"]
    assert reshard.rebuild_order(held, ["a", "zzz"]) == ["a"]
    assert reshard.rebuild_order(held, []) == []


def test_plan_differs():
    same = {
        "models": [("m", "cpu", [(["0"], ["0.weight"])], [("opt", [["0.weight"]], True)])],
        "holds_state": True,
    }
    new_rank = dict(same, holds_state=False)  # only rank 0 must hold the state
    assert reshard.plan_differs([same, new_rank, new_rank]) == ""
    assert reshard.plan_differs([same]) == ""
    assert "rank 0 holds no gathered state" in reshard.plan_differs([new_rank, same])
    other = {"models": [], "holds_state": False}
    why = reshard.plan_differs([same, same, other, other])
    assert why.startswith("not rebuilt: rank 2, 3 would rebuild other") and "same names on every rank" in why
    unit = {"models": [("m", "cpu", [(["0"], ["0.weight", "0.bias"])], [])], "holds_state": False}
    assert "rank 1 " in reshard.plan_differs([same, unit])
    why = reshard.plan_differs([same, unit], "gather")
    assert why.startswith("not gathered: rank 1 would gather other") and "(gather the same names" in why


# ---------------------------------------------------------------- ranks in processes


def _net():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    # uneven shards: 16 rows over 3 ranks, and 1 row (the last weight) over several
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))


def _shard(model, mesh, grouped: bool = False):
    """One fully_shard per Linear and one on the root, with arguments of each kind; or
    (``grouped``) the first two Linears in one call."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if grouped:
        fully_shard([model[0], model[2]], mesh=mesh, reshard_after_forward=False)
    else:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh, reshard_after_forward=False)
    fully_shard(model[4], mesh=mesh, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=False))
    fully_shard(model, mesh=mesh)
    return model


def _batch(k: int):
    import torch

    g = torch.Generator().manual_seed(100 + k)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def _step(model, opt, k: int, rank: int, world: int) -> None:
    """One step on this rank's slice of global batch ``k`` (FSDP averages the gradients over
    the ranks: the mean over the global batch)."""
    x, y = _batch(k)
    n = BATCH // world
    opt.zero_grad()
    ((model(x[rank * n : (rank + 1) * n]) - y[rank * n : (rank + 1) * n]) ** 2).mean().backward()
    opt.step()


def _world(d: str, tag: str, rank: int, size: int, store=None) -> None:
    import torch.distributed as dist

    from gpu_magics.engine import groups

    groups.register("gloo")
    store = store or dist.FileStore(os.path.join(d, tag), size)
    dist.init_process_group("gpuhub", store=store, rank=rank, world_size=size, timeout=TIMEOUT)


def _full_params(model) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _full_adam(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: {
            k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in s.items()
        }
        for p, s in opt.state.items()
    }


def _clone(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _clone(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_clone(v) for v in tree)
    return tree


def _equal(a: dict, b: dict, what: str) -> None:
    import torch

    assert sorted(a) == sorted(b), (what, sorted(a), sorted(b))
    for k in a:
        if isinstance(a[k], dict):
            _equal(a[k], b[k], f"{what}.{k}")
        else:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}.{k} differs"


def _old_world(d: str, rank: int, world: int, ns: dict, grouped: bool) -> dict:
    """Ranks of the first world: the model sharded and trained two steps with Adam (and an
    SGD on its last layer that never stepped), what it was; then ``gather``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    _world(d, "old", rank, world)
    model = _shard(_net(), init_device_mesh("cpu", (world,)), grouped)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for k in range(2):
        _step(model, opt, k, rank, world)
    sgd = torch.optim.SGD(model[4].parameters(), lr=0.1, momentum=0.9)
    unnamed = torch.optim.SGD(model[0].parameters(), lr=0.1)  # bound to no name in ns
    ns.update(model=model, opt=opt, sgd=sgd, layer=model[2], x=3)
    if world == 4:  # HSDP on a 2-D mesh: named, never touched
        hsdp = _net()
        from torch.distributed.fsdp import fully_shard

        fully_shard(hsdp, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
        ns["hsdp"] = hsdp
    before = {
        "params": _full_params(model),
        "adam": _full_adam(model, opt),
        # cloned: on the CPU the full state's "step" is the optimizer's own tensor
        "osd": _clone(get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))),
        "structure": reshard.describe_model(model)[1]["units"],
    }
    summary = reshard.gather(["model", "hsdp", "x"], ns=ns)  # optimizers found without their names
    assert summary["models"] == {"model": {"units": 3 if grouped else 4, "params": 6}}, summary
    assert summary["optimizers"] == {"opt": "model", "sgd": "model"}, summary
    assert summary["inside"] == {} and summary["unnamed_optimizers"] == {"model": 1}, summary
    del unnamed
    assert summary["grads_dropped"] == ["model"]  # the last step's gradients
    if world == 4:
        assert "2-D DeviceMesh" in summary["refused"]["hsdp"], summary
    assert (summary["bytes"] > 0) is (rank == 0), summary
    json.dumps(summary)
    dist.barrier()
    return before


def _hooks(model) -> list[tuple]:
    """How many hooks of each kind every module of ``model`` has."""
    kinds = ("_forward_pre_hooks", "_forward_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks")
    kinds += ("_load_state_dict_post_hooks", "_backward_hooks", "_backward_pre_hooks")
    return [(name, *(len(getattr(m, k)) for k in kinds)) for name, m in model.named_modules()]


def _new_world_checks(
    d: str, rank: int, world: int, ns: dict, ids: dict, before: dict | None, grouped: bool
) -> None:
    """After ``rebuild`` on every rank of the new world: the same objects, the same full state,
    and the next step equal to a fresh FSDP2 model of this world loaded from that state."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    out = reshard.rebuild(ns=ns)
    assert out["failed"] == {} and out["not_rebuilt"] == [] and out["names_changed"] == [], out
    units = 3 if grouped else 4
    assert out["models"] == {"model": {"units": units, "mesh": world}}, out
    assert out["optimizers"] == {"opt": "model", "sgd": "model"}, out
    json.dumps(out)
    model, opt, sgd = ns["model"], ns["opt"], ns["sgd"]
    if ids:  # a rank of the old world: the objects the user held
        assert {k: id(ns[k]) for k in ids} == ids
    assert ns["layer"] is model[2] and isinstance(model, FSDPModule) and isinstance(model[2], FSDPModule)
    assert not isinstance(model[1], FSDPModule)
    params = list(model.parameters())
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    assert all(isinstance(p, DTensor) and p.device_mesh.size() == world for p in params)
    assert [id(p) for p in sgd.param_groups[0]["params"]] == [id(p) for p in model[4].parameters()]
    assert not sgd.state and sgd.param_groups[0]["momentum"] == 0.9
    # what rank 0 had before, to every rank of the new world (a new rank had nothing)
    box = [before if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ref = box[0]
    assert reshard.describe_model(model)[1]["units"] == ref["structure"]
    _equal(_full_params(model), ref["params"], "params")
    _equal(_full_adam(model, opt), ref["adam"], "adam")
    assert opt.param_groups[0]["lr"] == 0.01

    # the reference: a fresh FSDP2 model of this world from the same full state
    fresh = _shard(_net(), init_device_mesh("cpu", (world,)), grouped)
    assert _hooks(model) == _hooks(fresh)  # none of the old FSDP's hooks left, none missing
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)  # lr comes from the state
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(fresh, {k: v.clone() for k, v in ref["params"].items()}, options=full)
    set_optimizer_state_dict(fresh, fresh_opt, _clone(ref["osd"]), options=full)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        _step(m, o, 2, rank, world)
    after = _full_params(model)
    _equal(after, _full_params(fresh), "next step vs a fresh FSDP2 model")
    _equal(_full_adam(model, opt), _full_adam(fresh, fresh_opt), "adam after the next step")
    if rank == 0:
        _plain_reference(ref, after, world)
    if world == 3:  # ranks that disagree on what to rebuild: all refuse, none waits, nothing changes
        if rank == 1:
            assert reshard.drop(["sgd"])["dropped"] == ["sgd"]
        again = reshard.rebuild(ns=ns)
        assert again["models"] == {} and again["failed"] == {
            "model": "not rebuilt: rank 1 would rebuild other models, units or optimizers than rank 0 "
            "(gather or adopt the same names on every rank)"
        }, again
        _equal(_full_params(model), after, "params after a refused rebuild")
    with open(os.path.join(d, f"done.{rank}"), "w") as f:
        json.dump({"rank": rank, "world": world, "rebuilt": out["models"]}, f)
    assert reshard.drop()["dropped"] == (
        ["model", "opt"] if (world, rank) == (3, 1) else ["model", "opt", "sgd"]
    )
    assert reshard.held()["bytes"] == 0
    dist.barrier()
    dist.destroy_process_group()


def _plain_reference(ref: dict, after: dict, world: int) -> None:
    """One process, one plain model, the whole global batch (the mean of the ranks' slices):
    close, not equal: FSDP sums the ranks' gradients in another order than one backward."""
    import torch

    plain = _net()
    plain.load_state_dict(ref["params"])
    opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    names = [n for n, _ in plain.named_parameters()]
    opt.load_state_dict(
        {
            "state": {i: _clone(ref["osd"]["state"][n]) for i, n in enumerate(names)},
            "param_groups": [dict(ref["osd"]["param_groups"][0], params=list(range(len(names))))],
        }
    )
    x, y = _batch(2)
    n = BATCH // world
    opt.zero_grad()
    losses = [((plain(x[r * n : (r + 1) * n]) - y[r * n : (r + 1) * n]) ** 2).mean() for r in range(world)]
    (sum(losses) / world).backward()
    opt.step()
    for k, p in plain.named_parameters():
        assert torch.allclose(p.detach(), after[k], rtol=1e-5, atol=1e-6), k
        assert not torch.equal(p.detach(), ref["params"][k]), f"{k} did not move"


def _shrink(index: int, d: str, old: int, new: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ns: dict = {}
    before = _old_world(d, index, old, ns, grouped=False)
    ids = {k: id(ns[k]) for k in ("model", "opt", "sgd", "layer")}
    if index >= new:  # departing: gathered, then stopped
        return
    dist.destroy_process_group()
    _world(d, "new", index, new)
    _new_world_checks(d, index, new, ns, ids, before if index == 0 else None, grouped=False)


def _grow(index: int, d: str, old: int, new: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(d, "new"), new)
    store.set_timeout(TIMEOUT)
    ns: dict = {}
    ids: dict = {}
    before = None
    if index < old:
        before = _old_world(d, index, old, ns, grouped=True)
        ids = {k: id(ns[k]) for k in ("model", "opt", "sgd", "layer")}
        if index == 0:
            blob = reshard.skeleton(ns=ns)
            assert isinstance(blob, bytes) and len(blob) < 100_000
            store.set("skeleton", blob)  # what the kernel sends to the new ranks
        dist.destroy_process_group()
    else:  # a new rank: nothing until the new world forms, then the skeleton
        got = reshard.adopt(store.get("skeleton"), ns)
        assert got == {
            "names": ["layer", "model", "opt", "sgd"],
            "models": ["model"],
            "optimizers": ["opt", "sgd"],
        }, got
        assert ns["layer"] is ns["model"][2]
        assert all(p.is_meta for p in ns["model"].parameters())
        assert type(ns["model"]).__name__ == "Sequential" and type(ns["opt"]).__name__ == "Adam"
    _world(d, "new", index, new, store=store)
    _new_world_checks(d, index, new, ns, ids, before, grouped=True)


def _run(fn, nprocs: int, old: int, new: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        mp.start_processes(fn, args=(d, old, new), nprocs=nprocs, start_method="spawn")
        done = []
        for r in range(new):
            with open(os.path.join(d, f"done.{r}")) as f:
                done.append(json.load(f))
    return done


@pytest.mark.parametrize("old, new", [(4, 3), (2, 1)])
def test_shrink(old, new):
    done = _run(_shrink, old, old, new)
    assert [r["world"] for r in done] == [new] * new
    assert all(r["rebuilt"] == {"model": {"units": 4, "mesh": new}} for r in done)


def test_grow():
    done = _run(_grow, 3, 2, 3)
    assert [r["rank"] for r in done] == [0, 1, 2] and all(r["world"] == 3 for r in done)


def test_unshard_in_place_leaves_a_plain_module():
    """``fully_shard`` undone on a one-rank world: the module is its own class again with no
    FSDP hook, state or registry entry, its parameters full-size on the meta device, and it can
    be sharded again."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0, world_size=1)
        try:
            model = _net()
            plain_hooks = _hooks(model)
            _shard(model, init_device_mesh("cpu", (1,)))
            model(torch.randn(2, 8)).sum().backward()
            assert reshard.unshard_in_place(model) == 4
            assert not any(isinstance(m, FSDPModule) for m in model.modules())
            assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear", "ReLU", "Linear"]
            assert _hooks(model) == plain_hooks
            for m in model.modules():
                assert STATE_KEY not in m.__dict__ and REGISTRY_KEY not in m.__dict__
                assert "_is_fsdp_managed_module" not in m.__dict__ and m not in _module_state_mapping
            assert {n: (tuple(p.shape), p.is_meta) for n, p in model.named_parameters()} == {
                n: (tuple(p.shape), True) for n, p in _net().named_parameters()
            }
            assert all(type(p) is nn.Parameter and p.grad is None for p in model.parameters())
            _shard(model, init_device_mesh("cpu", (1,)))  # fully_shard takes it again
            assert isinstance(model, FSDPModule)
            # a tied weight stays one parameter through undoing and applying again
            tied = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
            tied[1].weight = tied[0].weight
            mesh = init_device_mesh("cpu", (1,))
            fully_shard(tied, mesh=mesh)
            _, structure = reshard.describe_model(tied)
            reshard.unshard_in_place(tied)
            assert tied[1].weight is tied[0].weight and tied[0].weight.is_meta
            reshard._reapply(tied, structure, mesh)
            assert tied[1].weight is tied[0].weight and not tied[0].weight.is_meta
            assert [n for n, _ in tied.named_parameters()] == ["0.weight"]
        finally:
            dist.destroy_process_group()
