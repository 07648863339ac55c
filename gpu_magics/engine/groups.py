"""Process groups that survive a recovery, inside each engine.

Every group a pool's ranks make (the world group at setup, ``dist.new_group``, a ``DeviceMesh``'s
groups) is a :class:`ReconfigurableGroup` when it is made with gpuhub's backend (``"gpuhub"``, the
pool's default): a ``torch.distributed.ProcessGroup`` written in Python that hands each
collective to a real gloo or NCCL group inside it. When an interrupt or an error leaves a group
that cannot be trusted, :func:`reconfigure` gives the same object a new inner group on a fresh
rendezvous, so whatever holds the object (DDP's reducer, FSDP2's ``DeviceMesh``, a ``DTensor``,
a subgroup in a variable, a user's own object) goes on with it. This is torchft's design
(``ProcessGroupWrapper.configure``), written small here: torchft's groups need its Rust
lighthouse and a TCP store address, its gloo wrapper has no reduce-scatter (FSDP2 needs one), and
it registers a world of size 1 for ``DeviceMesh``.

The class is built on first use (:func:`group_class`), so that importing this module costs the
kernel nothing (the kernel refers to the functions here, the engines run them).
"""

from __future__ import annotations

import os
import stat
import weakref
from datetime import timedelta

BACKEND = "gpuhub"
_INNER = {"kind": "gloo"}  # the backend inside every group: set by ``register``
_LIVE: dict[str, weakref.ReferenceType] = {}  # group name -> group, for this process
_CLASS: list[type] = []

# every collective of c10d's ProcessGroup that a Python subclass can override (torch 2.13);
# each one is handed to the inner group as it is
COLLECTIVES = (
    "broadcast",
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "allgather",
    "_allgather_base",
    "allgather_coalesced",
    "allgather_into_tensor_coalesced",
    "all_gather_single",
    "all_gather_single_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "_reduce_scatter_base",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "alltoall",
    "alltoall_base",
    "all_to_all_single",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
    "_get_backend",
)


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


def _inner_group(kind: str, store, rank: int, size: int, timeout: timedelta):
    """A plain c10d group of ``size`` ranks with one real backend, as ``init_process_group``
    would make it."""
    import torch
    import torch.distributed as dist

    pg = dist.ProcessGroup(store, rank, size)
    if kind == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        backend = dist.ProcessGroupNCCL(store, rank, size, options)
        backend._set_sequence_number_for_group()
        pg._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, backend)
        return pg
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    backend._set_sequence_number_for_group()
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    if torch.cuda.is_available():
        pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def _delegate(name: str):
    def collective(self, *args, **kwargs):
        return getattr(self._inner, name)(*args, **kwargs)

    collective.__name__ = name
    return collective


def group_class() -> type:
    """:class:`ReconfigurableGroup`, made once per process (it subclasses torch's class)."""
    if _CLASS:
        return _CLASS[0]
    import torch.distributed as dist

    class ReconfigurableGroup(dist.ProcessGroup):
        """A process group whose connections can be replaced while the object stays."""

        def __init__(self, store, rank: int, size: int, timeout: timedelta, ranks: list[int]):
            super().__init__(rank, size)
            self.kind = _INNER["kind"]
            self.ranks = list(ranks)  # global ranks, in group-rank order
            self.timeout = timeout
            self.generation = 0
            self.fds: frozenset[int] = frozenset()
            self._gname = ""
            self._inner = None
            self._connect(store, rank, size)

        def _connect(self, store, rank: int, size: int) -> None:
            before = socket_fds()
            self._inner = _inner_group(self.kind, store, rank, size, self.timeout)
            self.fds = socket_fds() - before

        def reconfigure(self, root_store, generation: int) -> None:
            """New connections for the same members, met under ``generation`` on
            ``root_store``; blocks until every member has called it."""
            import torch.distributed as dist

            old, self._inner, self.fds = self._inner, None, frozenset()
            del old  # its threads have nothing left to do: the connections were shut down
            store = dist.PrefixStore(f"gpuhub-regroup-{generation}/{self._gname}/", root_store)
            self._connect(store, self.ranks.index(dist.get_rank()), len(self.ranks))
            self.generation = generation

        def abort_inner(self) -> None:
            """NCCL's abort for the inner group (``ncclCommAbort``)."""
            import torch

            if self._inner is not None and self.kind == "nccl":
                self._inner._get_backend(torch.device("cuda")).abort()

        def sequence(self) -> int:
            return int(self._inner._get_sequence_number_for_group()) if self._inner is not None else -1

        def getBackendName(self) -> str:
            return BACKEND

        def _set_group_name(self, name: str) -> None:
            self._gname = name
            _LIVE[name] = weakref.ref(self)
            super()._set_group_name(name)

        @property
        def group_name(self) -> str:
            return self._gname

        def __repr__(self) -> str:
            return f"<gpuhub group {self._gname} over {self.kind}, ranks {self.ranks}>"

    for name in COLLECTIVES:
        setattr(ReconfigurableGroup, name, _delegate(name))
    _CLASS.append(ReconfigurableGroup)
    return ReconfigurableGroup


def _create(options, backend_options):
    """c10d's creator for the ``gpuhub`` backend (the extended API: it is told the ranks)."""
    ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
    return group_class()(options.store, options.group_rank, options.group_size, options.timeout, ranks)


def register(kind: str) -> str:
    """Make ``gpuhub`` a c10d backend whose groups wrap ``kind`` (gloo or nccl); its name."""
    import torch.distributed as dist

    _INNER["kind"] = kind
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    return BACKEND


def live_groups() -> list:
    """This process's reconfigurable groups, by name."""
    found = []
    for name in sorted(_LIVE, key=group_order):
        group = _LIVE[name]()
        if group is None:
            del _LIVE[name]
        else:
            found.append(group)
    return found


def group_order(name: str) -> tuple:
    """The order every rank reconfigures in (the same on all, so none waits on another):
    c10d's numbered names by number, then any other name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def group_fds() -> frozenset[int]:
    """The sockets of every reconfigurable group's current connections."""
    fds: set[int] = set()
    for group in live_groups():
        fds |= group.fds
    return frozenset(fds)
