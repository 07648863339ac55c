"""Inside each engine: getting a rank out of a stuck collective, and the same process groups
reconnected in the same process, so an interrupt or an error never costs the rank's variables.

- **Freeing a stuck rank.** A rank blocked in a gloo collective (its peers were interrupted
  before they joined it) ignores SIGINT until the collective's timeout: the call waits in C++.
  Engines start with SIGUSR1 blocked in every thread (``gpu_magics.engine.main``), and a thread
  here waits for it; on SIGUSR1 it shuts down the connected sockets of every gpuhub group
  (gloo has no working abort: measured with torch 2.13, ``abort()`` returns and the collective
  goes on waiting), so the collective fails at once with "Connection closed by peer" and the
  rank returns to Python. For NCCL it calls each group's abort (``ncclCommAbort``).
- **Keeping or reconnecting the groups.** ``group_state`` says, for each group, how many
  collectives the rank has run on it, and whether the rank was freed; where every member of
  every group agrees and none was freed the groups are kept, else ``recover`` reconnects each
  gpuhub group in place on a fresh rendezvous (``engine.groups``): the group objects stay, so
  DDP, FSDP2's ``DeviceMesh`` and ``DTensor``, subgroups and a user's own objects that hold one go
  on with them. DDP's reducer is made afresh, FSDP2 drops what the interrupted
  step left (``reset_iter_state``), DDP modules bound to a name are made equal to rank 0's, and every
  group is then checked with a collective before the cell says it was kept.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from datetime import timedelta

from gpu_magics.engine.groups import group_fds, group_order, live_groups, register
from gpu_magics.engine.rendezvous import group_store

FREE_SIGNAL = signal.SIGUSR1
_STATE = {"freed": 0, "backend": "", "generation": 0}
_FREER: threading.Thread | None = None


def init_group(backend: str, store, rank: int, world: int, timeout_s: float) -> None:
    """``init_process_group`` with gpuhub's reconfigurable groups over ``backend``: the world
    group and every group made later with the default backend can be reconnected in place."""
    import torch.distributed as dist

    dist.init_process_group(
        register(backend), store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    _STATE.update(freed=0, backend=backend)


def free_collectives() -> None:
    """Make a collective this rank is blocked in fail now (SIGUSR1's handler, in its thread)."""
    _STATE["freed"] += 1
    if _STATE["backend"] == "nccl":
        for group in live_groups():
            group.abort_inner()
        return
    for fd in group_fds():
        try:
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            # not the listener: gloo's listening thread ends the process if its socket breaks
            if not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.detach()  # the fd stays gloo's


def start_freer() -> bool:
    """Start the thread that waits for SIGUSR1; False when SIGUSR1 is not blocked in this
    process (an engine not started by ``gpu_magics.engine.main``: the signal would end it)."""
    global _FREER
    if FREE_SIGNAL not in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return False
    if _FREER is None:

        def wait() -> None:
            while True:
                signal.sigwait({FREE_SIGNAL})
                try:
                    free_collectives()
                except Exception:  # never end the thread: the next interrupt needs it too
                    pass

        _FREER = threading.Thread(target=wait, daemon=True, name="gpuhub-freer")
        _FREER.start()
    return True


def _groups():
    """Every process group this rank is a member of, with the name c10d gave it."""
    import torch.distributed as dist

    world = dist.distributed_c10d._world
    return [(name, pg) for pg, name in list(world.pg_names.items()) if pg is not None]


def group_state() -> dict:
    """For each group this rank is a member of: its members, whether gpuhub can reconnect it,
    and how many collectives this rank has run on it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return {"initialized": False, "freed": _STATE["freed"], "groups": {}}
    groups = {}
    for name, pg in _groups():
        reconfigurable = hasattr(pg, "reconfigure")
        try:
            seq = pg.sequence() if reconfigurable else int(pg._get_sequence_number_for_group())
        except Exception:  # a backend that does not count: never trusted after a failure
            seq = -1
        groups[name] = {
            "ranks": dist.get_process_group_ranks(pg),
            "reconfigurable": reconfigurable,
            "backend": pg.kind if reconfigurable else dist.get_backend(pg),
            "seq": seq,
        }
    return {"initialized": True, "freed": _STATE["freed"], "rank": dist.get_rank(), "groups": groups}


def ddp_names() -> list[str]:
    """Names in the rank's namespace bound to a DistributedDataParallel module."""
    from IPython import get_ipython
    from torch.nn.parallel import DistributedDataParallel

    ns = get_ipython().user_ns
    return sorted(
        k for k, v in list(ns.items()) if isinstance(v, DistributedDataParallel) and not k.startswith("_")
    )


def holders() -> dict:
    """What in the rank's namespace holds a process group, by kind: names of DDP and FSDP2
    modules, DeviceMeshes, and the groups bound to a name (group name -> variable names)."""
    import torch.distributed as dist
    from IPython import get_ipython
    from torch.nn.parallel import DistributedDataParallel

    ns = get_ipython().user_ns
    found: dict = {"ddp": [], "fsdp": [], "mesh": [], "group": {}}
    names = {pg: name for name, pg in _groups()}
    for key, value in list(ns.items()):
        if key.startswith("_"):
            continue
        if isinstance(value, DistributedDataParallel):
            found["ddp"].append(key)
        elif _is_fsdp(value):
            found["fsdp"].append(key)
        elif type(value).__name__ == "DeviceMesh":
            found["mesh"].append(key)
        elif isinstance(value, dist.ProcessGroup) and value in names:
            found["group"].setdefault(names[value], []).append(key)
    return found


def _is_fsdp(obj) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(obj, FSDPModule)


def ddp_options(ddp) -> dict:
    """The options a DDP module was built with (what building it again needs)."""
    mib = getattr(ddp, "bucket_bytes_cap", 25 * 1024 * 1024) / (1024 * 1024)
    return {
        "device_ids": ddp.device_ids,
        "output_device": ddp.output_device,
        "dim": getattr(ddp, "dim", 0),
        "broadcast_buffers": getattr(ddp, "broadcast_buffers", True),
        "find_unused_parameters": getattr(ddp, "find_unused_parameters", False),
        "gradient_as_bucket_view": getattr(ddp, "gradient_as_bucket_view", False),
        "static_graph": getattr(ddp, "static_graph", False),
        "bucket_cap_mb": mib,
    }


def fresh_reducer(ddp, group) -> None:
    """A DDP module built again in place, on ``group``, around the same module (the object
    stays: whatever holds it goes on; no broadcast: ``init_sync=False``): a reducer as a new
    DDP module's (buckets in the parameters' order, nothing recorded), the same on every
    rank, whatever an interrupted backward left in the old one (a reducer reset in place
    keeps what it had recorded, and ranks that recorded differently disagree on the next
    step's collectives), and the layout a new rank's DDP starts from (buckets laid out
    differently are summed element by element wrongly)."""
    from torch.nn.parallel import DistributedDataParallel

    options, module, training = ddp_options(ddp), ddp.module, ddp.training
    ddp._remove_autograd_hooks()
    DistributedDataParallel.__init__(ddp, module, process_group=group, init_sync=False, **options)
    ddp.train(training)


def reset_holders() -> dict:
    """Every DDP module and FSDP2 module in this process (wherever it is held) made ready for a
    new step on its reconnected group: DDP's reducer made afresh (``fresh_reducer``), and FSDP2
    drops what an interrupted step left (its own ``reset_iter_state``). Local: no collective."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    ddp = fsdp = 0
    failed = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, DistributedDataParallel):
                fresh_reducer(obj, obj.process_group)
                ddp += 1
            elif _is_fsdp(obj):
                _reset_fsdp(obj)
                fsdp += 1
        except Exception as e:
            failed.append(f"{type(obj).__name__}: {type(e).__name__}: {e}".split("\n")[0][:200])
    return {"ddp": ddp, "fsdp": fsdp, "failed": failed}


def _reset_fsdp(module) -> None:
    """An FSDP2 root module back to its resting state after an interrupted step: FSDP2's own
    recovery (``reset_iter_state``: every parameter group resharded, the interrupted
    iteration's gradient reductions dropped). Modules inside a root are reset with it."""
    state = module._get_fsdp_state()
    if getattr(state, "_is_root", None) is True:  # None: never run forward, nothing to reset
        module.reset_iter_state()


def _sync_ddp(names: list[str]) -> list[str]:
    """The DDP modules named (the same names, in the same order, on every rank) made equal to
    rank 0's: parameters and buffers broadcast on each module's group."""
    from IPython import get_ipython
    from torch.distributed.utils import _sync_module_states

    ns = get_ipython().user_ns
    done = []
    for name in names:
        ddp = ns[name]
        _sync_module_states(
            module=ddp.module,
            process_group=ddp.process_group,
            broadcast_bucket_size=ddp.broadcast_bucket_size,
            src=0,
            params_and_buffers_to_ignore=getattr(ddp, "parameters_to_ignore", set()),
            broadcast_buffers=True,
        )
        done.append(name)
    return done


def ddp_digests() -> dict[str, list[float]]:
    """Each DDP module's parameters and buffers in a few numbers computed where they are (no
    copy to the host, no collective): equal replicas give equal numbers on every rank. An
    interrupt between two collectives can stop one rank after its optimizer's step and
    another before it: the ranks then hold different models with no group out of step."""
    import torch
    from IPython import get_ipython

    ns = get_ipython().user_ns
    out = {}
    for name in ddp_names():
        sums = torch.zeros(3, dtype=torch.float64)
        with torch.no_grad():
            for t in [*ns[name].module.parameters(), *ns[name].module.buffers()]:
                x = t.detach().to(torch.float64)
                sums += torch.stack([x.sum(), x.abs().sum(), (x * x).sum()]).cpu()
        out[name] = sums.tolist()
    return out


def sync_ddp(names: list[str]) -> dict[str, list[str]]:
    """``names``' DDP modules made equal to rank 0's (a broadcast on each one's group), and
    the optimizers in the namespace that step them: rank 0's state loaded on every rank (one
    rank may have stepped where another had not, so their momentum and moments differ too,
    and even their shape: a rank that never stepped has none)."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    modules = _sync_ddp(names)
    ns = get_ipython().user_ns
    optimizers = []
    for name in names:
        ddp = ns[name]
        mine = {id(p) for p in ddp.module.parameters()}
        for opt_name in sorted(k for k, v in list(ns.items()) if isinstance(v, torch.optim.Optimizer)):
            opt = ns[opt_name]
            if opt_name.startswith("_") or not any(
                id(p) in mine for g in opt.param_groups for p in g["params"]
            ):
                continue
            box = [opt.state_dict() if dist.get_rank(ddp.process_group) == 0 else None]
            dist.broadcast_object_list(box, group_src=0, group=ddp.process_group)
            if dist.get_rank(ddp.process_group) != 0:
                opt.load_state_dict(box[0])
            optimizers.append(opt_name)
    return {"modules": modules, "optimizers": optimizers}


def check_groups(names: list[str]) -> dict[str, str]:
    """A collective on each group named (this rank a member of each, every member asked for
    the same names in the same order): "" where it answered right, else what went wrong."""
    import torch
    import torch.distributed as dist

    by_name = dict(_groups())
    results = {}
    for name in sorted(names, key=group_order):
        pg = by_name.get(name)
        if pg is None:
            results[name] = "this rank no longer has it"
            continue
        try:
            t = torch.ones(1)
            if getattr(pg, "kind", "") == "nccl":
                t = t.cuda()
            dist.all_reduce(t, group=pg)
            size = dist.get_world_size(pg)
            results[name] = (
                "" if int(t.item()) == size else f"the check summed to {int(t.item())}, not {size}"
            )
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}".split("\n")[0][:200]
    return results


def recover(rendezvous: dict, env_update: dict, timeout_s: float, names: list[str], sync: list[str]) -> dict:
    """Reconnect the gpuhub groups ``names`` in place on ``rendezvous``
    (``rendezvous.open_rendezvous``), reset what holds them, make the DDP modules named
    ``sync`` equal to rank 0's, and check every group named with a collective."""
    os.environ.update(env_update)
    _STATE["generation"] += 1
    root = group_store(rendezvous, dict(os.environ), timeout_s)
    by_name = {g.group_name: g for g in live_groups()}
    failed = {}
    for name in sorted(names, key=group_order):
        try:
            by_name[name].reconfigure(root, _STATE["generation"])
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}".split("\n")[0][:200]
    reset = reset_holders()
    synced = _sync_ddp(sync) if not failed else []
    checked = check_groups([n for n in names if n not in failed])
    _STATE["freed"] = 0
    return {"failed": failed, "checked": checked, "reset": reset, "synced": synced, "state": group_state()}
