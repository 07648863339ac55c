"""Placement: which GPUs a request takes (pure, deterministic).

- ``place(request, free, inventory)``: pack onto as few nodes as possible. A request that
  fits on one node goes to the node with the fewest free GPUs that still fits it (best fit,
  keeping big holes for big requests); a multi-node request takes the fullest nodes (whole
  free nodes first among equals), then the best-fitting node for the remainder.
- :class:`GpuSet` / :class:`GroupedGpus`: free sets that remember their groups by node, and
  the :data:`FitIndex` (``make_fit_index``, ``refit``, ``best_node``) that finds the one-node
  best fit without a pass over every node.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain


@dataclass(frozen=True, order=True)
class Gpu:
    """One GPU as the inventory knows it."""

    node: str
    index: int
    model: str = "GPU"
    memory_mib: int | None = field(default=None, compare=False)
    uuid: str | None = field(default=None, compare=False)
    # a slice of the GPU ``index`` (``c.GpuHub.gpu_slices``): ``part`` 1 to ``parts``; 0: the whole GPU
    part: int = 0
    parts: int = field(default=0, compare=False)

    @property
    def label(self) -> str:
        """``node:0`` for a whole GPU, ``node:0s2`` for its slice 2 (of ``parts``)."""
        return f"{self.node}:{self.index}" + (f"s{self.part}" if self.part else "")

    @property
    def whole(self) -> Gpu:
        """The GPU this is a slice of (itself when whole)."""
        if not self.part:
            return self
        memory = None if self.memory_mib is None else self.memory_mib * self.parts
        return Gpu(self.node, self.index, self.model, memory, self.uuid)


def largest_placeable(free: Sequence[Gpu], model: str | None, max_nodes: int | None) -> int:
    """The largest count ``place`` could satisfy right now."""
    if isinstance(free, KEPT):
        return free.remembered(("largest", model, max_nodes), lambda: _largest(free, model, max_nodes))
    return _largest(free, model, max_nodes)


def _largest(free: Sequence[Gpu], model: str | None, max_nodes: int | None) -> int:
    per_node = sorted((len(v) for v in _by_node(free, model).values()), reverse=True)
    return sum(per_node if max_nodes is None else per_node[:max_nodes])


class GpuSet(tuple):
    """GPUs already in order (node, index), that group themselves by node once: the
    inventory a process keeps in memory (``Ledger``), so that an admission on a cluster of
    thousands of GPUs does not sort and group them all again. Read its groups, never change them."""

    @classmethod
    def ordered(cls, gpus: Iterable[Gpu]) -> GpuSet:
        """``gpus``, known to be in order already (e.g. a part of a ``GpuSet``)."""
        return cls(gpus)

    def remembered(self, key, compute):
        """``compute()``, once per ``key`` for this set (it never changes)."""
        memo = self.__dict__.setdefault("memo", {})
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def by_node(self, model: str | None) -> dict[str, list[Gpu]]:
        groups = self.__dict__.setdefault("groups", {})
        if model not in groups:
            out: dict[str, list[Gpu]] = {}
            for g in self:
                if model is None or g.model == model:
                    out.setdefault(g.node, []).append(g)
            groups[model] = out
        return groups[model]


class GroupedGpus(Sequence):
    """GPUs kept as their groups by node (nodes in order, each node's in order), read as a
    sequence without making one: an admission reads the free GPUs by node, their count and
    their fit index, and making the tuple of thousands for every decision cost more than the
    rest of the placement. Like a ``GpuSet``: read its groups, never change them."""

    def __init__(self, groups: dict[str, list[Gpu]], fit: tuple[GpuSet, FitIndex] | None = None):
        self.__dict__["groups"] = {None: groups}
        if fit is not None:
            self.fit = fit

    def __len__(self) -> int:
        return self.remembered("len", lambda: sum(map(len, self.by_node(None).values())))

    def __iter__(self):
        return chain.from_iterable(self.by_node(None).values())

    def __getitem__(self, i):
        return self.remembered("tuple", lambda: tuple(self))[i]

    def __eq__(self, other):
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"GroupedGpus({list(self)!r})"

    remembered = GpuSet.remembered
    by_node = GpuSet.by_node


KEPT = (GpuSet, GroupedGpus)  # sets that keep their groups and remembered answers


# the nodes with free GPUs by (how many are free, whether that is fewer than all of the
# node's), each list in name order: the one-node best fit without a pass over every node
FitIndex = dict[tuple[int, bool], list[str]]


def make_fit_index(groups: Mapping[str, list[Gpu]], totals: Mapping[str, list[Gpu]]) -> FitIndex:
    """The :data:`FitIndex` of the free GPUs ``groups`` (by node, nodes in name order) on a
    cluster whose GPUs by node are ``totals``."""
    index: FitIndex = {}
    for node, gs in groups.items():
        index.setdefault((len(gs), len(gs) != len(totals.get(node, ()))), []).append(node)
    return index


def refit(index: FitIndex, moved: Mapping[str, tuple[int, int, int]]) -> FitIndex:
    """``index`` after the nodes of ``moved`` went from ``before`` to ``after`` free GPUs of
    ``total`` (``node: (before, after, total)``); ``index`` itself is left as it was."""
    out = dict(index)
    for node, (before, after, total) in moved.items():
        if before == after:
            continue
        if before:
            key = (before, before != total)
            left = [n for n in out[key] if n != node]
            if left:
                out[key] = left
            else:
                del out[key]
        if after:
            key = (after, after != total)
            nodes = list(out.get(key, ()))
            insort(nodes, node)
            out[key] = nodes
    return out


def best_node(index: FitIndex, n: int) -> str | None:
    """The node the one-node best fit gives ``n`` GPUs on: the fewest free that hold ``n``,
    a whole node before a part of one, then by name (None: no node holds ``n``)."""
    keys = [key for key in index if key[0] >= n]
    return index[min(keys)][0] if keys else None


def models_in(inventory: Sequence[Gpu]) -> list[str]:
    if isinstance(inventory, GpuSet):
        return inventory.remembered("models", lambda: sorted({g.model for g in inventory}))
    return sorted({g.model for g in inventory})


def _by_node(gpus: Iterable[Gpu], model: str | None) -> dict[str, list[Gpu]]:
    """The GPUs (of ``model``) per node, nodes and GPUs in order (read only: a ``GpuSet``
    hands out the groups it keeps)."""
    if isinstance(gpus, KEPT):
        return gpus.by_node(model)
    out: dict[str, list[Gpu]] = {}
    for g in sorted(gpus):
        if model is None or g.model == model:
            out.setdefault(g.node, []).append(g)
    return out


def place(request: Request, free: Sequence[Gpu], inventory: Sequence[Gpu]) -> tuple[Gpu, ...] | None:
    """The GPUs to give ``request``, or ``None`` when they cannot be placed now."""
    if free is inventory and isinstance(free, GpuSet):  # "could it ever fit": asked at every admission
        shape = ("place", request.count, request.model, request.max_nodes, request.gpus_per_node)
        return free.remembered(shape, lambda: _place(request, free, inventory))
    return _place(request, free, inventory)


def _place(request: Request, free: Sequence[Gpu], inventory: Sequence[Gpu]) -> tuple[Gpu, ...] | None:
    n = request.count
    if n == 0:
        return ()
    free_by = _by_node(free, request.model)
    total_by = _by_node(inventory, request.model)

    def whole(node: str) -> bool:
        return len(free_by[node]) == len(total_by.get(node, ()))

    if request.gpus_per_node:
        per = request.gpus_per_node
        if n % per:
            return None
        want = n // per
        fitting = sorted(
            (node for node, gs in free_by.items() if len(gs) >= per),
            key=lambda node: (len(free_by[node]), not whole(node), node),
        )
        if len(fitting) < want or (request.max_nodes and want > request.max_nodes):
            return None
        return tuple(g for node in sorted(fitting[:want]) for g in free_by[node][:per])

    fit = getattr(free, "fit", None) if request.model is None else None
    if fit is not None and fit[0] is inventory and (request.max_nodes is None or request.max_nodes >= 1):
        node = best_node(fit[1], n)  # kept from write to write by the ledger (freeset.py)
        if node is not None:
            return tuple(free_by[node][:n])
    elif request.max_nodes is None or request.max_nodes >= 1:
        # one node holds it: the best-fitting such node, as below with k = 1, without sorting
        # every node (thousands on a large cluster)
        # min of (free, not whole, name) in one pass over the nodes (they come in name order)
        fewest, first, first_whole = None, None, None
        for node, gs in free_by.items():
            k = len(gs)
            if k < n or (fewest is not None and k > fewest):
                continue
            is_whole = k == len(total_by.get(node, ()))
            if fewest is None or k < fewest:
                fewest, first, first_whole = k, node, node if is_whole else None
            elif first_whole is None and is_whole:
                first_whole = node
        if first is not None:
            return tuple(free_by[first_whole or first][:n])
    # as few nodes as possible: the smallest k whose k fullest nodes hold n
    order = sorted(free_by, key=lambda node: (-len(free_by[node]), not whole(node), node))
    k, total = 0, 0
    while total < n and k < len(order):
        total += len(free_by[order[k]])
        k += 1
    if total < n or (request.max_nodes is not None and k > request.max_nodes):
        return None
    # the k-1 fullest whole, then the best-fitting node for the remainder (keeps big holes)
    chosen = [g for node in order[: k - 1] for g in free_by[node]]
    rest = n - len(chosen)
    candidates = [node for node in order[k - 1 :] if len(free_by[node]) >= rest]
    best = min(candidates, key=lambda node: (len(free_by[node]), not whole(node), node))
    chosen.extend(free_by[best][:rest])
    return tuple(sorted(chosen))


@dataclass(frozen=True)
class Request:
    user: str
    count: int
    model: str | None = None
    max_nodes: int | None = 1  # None: as many as needed
    gpus_per_node: int | None = None
