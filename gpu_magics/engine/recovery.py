"""Inside each engine: getting a rank out of a stuck collective, and a new process group in
the same process, so an interrupt or an error never costs the rank's variables.

- **Freeing a stuck rank.** A rank blocked in a gloo collective (its peers were interrupted
  before they joined it) ignores SIGINT until the collective's timeout: the call waits in C++.
  Engines start with SIGUSR1 blocked in every thread (``gpu_magics.engine.main``), and a thread
  here waits for it; on SIGUSR1 it shuts down the group's connected sockets (gloo has no working
  abort: measured with torch 2.13, ``abort()`` returns and the collective goes on waiting), so
  the collective fails at once with "Connection closed by peer" and the rank returns to Python.
  For NCCL it calls torch's process-group abort (``ncclCommAbort``), which is what NCCL offers.
- **Keeping or replacing the group.** ``group_state`` says how many collectives the rank has run
  and whether it was freed; where every rank agrees and none was freed the group is kept, else
  ``replace_group`` destroys it and joins a new one on a fresh rendezvous, and re-binds every
  ``DistributedDataParallel`` module bound to a name in the rank's namespace to the new group
  (DDP broadcasts rank 0's parameters and buffers as it is built, so the ranks stay identical).
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import threading
from datetime import timedelta

from gpu_magics.engine.rendezvous import group_store

FREE_SIGNAL = signal.SIGUSR1
_STATE = {"fds": frozenset(), "freed": 0, "backend": ""}
_FREER: threading.Thread | None = None


def socket_fds() -> frozenset[int]:
    """This process's open sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.stat(f"/proc/self/fd/{name}").st_mode):
                found.add(int(name))
        except (OSError, ValueError):
            continue
    return frozenset(found)


def init_group(backend: str, store, rank: int, world: int, timeout_s: float) -> None:
    """``init_process_group``, noting the sockets it opened (the group's own connections)."""
    import torch.distributed as dist

    before = socket_fds()
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    _STATE.update(fds=socket_fds() - before, freed=0, backend=backend)


def free_collectives() -> None:
    """Make a collective this rank is blocked in fail now (SIGUSR1's handler, in its thread)."""
    _STATE["freed"] += 1
    if _STATE["backend"] == "nccl":
        import torch.distributed as dist

        dist.distributed_c10d._abort_process_group()
        return
    for fd in _STATE["fds"]:
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


def group_state() -> dict:
    import torch.distributed as dist

    if not dist.is_initialized():
        return {"initialized": False, "seq": -1, "freed": _STATE["freed"]}
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    return {"initialized": True, "seq": int(seq), "freed": _STATE["freed"]}


def ddp_names() -> list[str]:
    """Names in the rank's namespace bound to a DistributedDataParallel module."""
    from IPython import get_ipython
    from torch.nn.parallel import DistributedDataParallel

    ns = get_ipython().user_ns
    return sorted(
        k for k, v in list(ns.items()) if isinstance(v, DistributedDataParallel) and not k.startswith("_")
    )


def _ddp_options(old) -> dict:
    mib = getattr(old, "bucket_bytes_cap", 25 * 1024 * 1024) / (1024 * 1024)
    return {
        "device_ids": old.device_ids,
        "output_device": old.output_device,
        "dim": getattr(old, "dim", 0),
        "broadcast_buffers": getattr(old, "broadcast_buffers", True),
        "find_unused_parameters": getattr(old, "find_unused_parameters", False),
        "gradient_as_bucket_view": getattr(old, "gradient_as_bucket_view", False),
        "static_graph": getattr(old, "static_graph", False),
        "bucket_cap_mb": mib,
    }


def replace_group(rendezvous: dict, env_update: dict, timeout_s: float, rebind: list[str]) -> dict:
    """Leave the default group, join a new one on ``rendezvous`` (``rendezvous.open_rendezvous``),
    and re-bind the DDP modules named ``rebind`` (the same names, in the same order, on every
    rank)."""
    import gc

    import torch.distributed as dist
    from IPython import get_ipython
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(env_update)
    backend = _STATE["backend"] or dist.get_backend()
    ns = get_ipython().user_ns
    old = {name: ns[name] for name in rebind}
    for ddp in old.values():
        ddp._remove_autograd_hooks()  # no backward may reach the old group's reducer
    try:
        dist.destroy_process_group()
    except Exception:  # a group whose connections were shut down may complain; it is gone
        pass
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    init_group(backend, group_store(rendezvous, dict(os.environ), timeout_s), rank, world, timeout_s)
    for name, ddp in old.items():
        ns[name] = DistributedDataParallel(ddp.module, **_ddp_options(ddp))
    old.clear()
    gc.collect()
    ns["dist"] = dist
    return {"rebound": list(rebind), "seq": group_state()["seq"]}
