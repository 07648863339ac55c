"""The free GPUs, kept in memory from one write to the next (a part of :class:`Ledger`).

Every admission needs the free GPUs grouped by node. Reading the held GPUs and grouping the
rest costs milliseconds on a cluster of thousands, so a process keeps what it last read,
tagged with the ledger's ``generation`` (counted up by every write, whoever writes). A
writing transaction that finds the generation unchanged since then uses it as it is; when
its own transaction commits, it applies the GPUs that transaction took or gave back (seen
at each flush, ``note_held``) and tags the result with the new generation. When another
process wrote in between, it applies the moves that process wrote in ``gpu_moves`` (every
write records its own); only when those are no longer kept are the free GPUs read again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from functools import cached_property

from sqlalchemy import Connection, bindparam, delete, inspect, select, update
from sqlalchemy.orm import Session

from spawner import policy
from spawner.ledger.db import connection
from spawner.ledger.models import AllocationGpu, GpuMove, LedgerLock

CHANGES = "held_changes"  # session.info key: [(gpu_id, held now, part, parts)] in flush order
Move = tuple[int, bool, int, int]  # a GPU taken or given back: whole (part 0) or one part of it
KEEP_GENERATIONS = 4096  # gpu_moves keeps the moves of this many of the newest generations
PRUNE_EVERY = 512  # ... pruned by the write whose generation is a multiple of this
_MOVES = GpuMove.__table__


def record_moves(conn: Connection, info: dict, generation: int) -> None:
    """Write this transaction's GPU moves (``info``: its session's) as of ``generation`` (the
    lock row is held), and now and then forget the oldest."""
    changes = info.get(CHANGES)
    if changes:
        conn.execute(
            _MOVES.insert(),
            [
                {"generation": generation, "gpu_id": g, "held": h, "part": part, "parts": parts}
                for g, h, part, parts in changes
            ],
        )
    if generation % PRUNE_EVERY == 0 and generation > KEEP_GENERATIONS:
        oldest = generation - KEEP_GENERATIONS
        conn.execute(delete(_MOVES).where(_MOVES.c.generation <= oldest))
        lock = LedgerLock.__table__
        after = max(info.get("moves_after") or 0, oldest)
        conn.execute(update(lock).where(lock.c.id == 1).values(moves_after=after))


MOVES_SINCE = (
    select(_MOVES.c.gpu_id, _MOVES.c.held, _MOVES.c.part, _MOVES.c.parts)
    .where(_MOVES.c.generation > bindparam("generation"))
    .order_by(_MOVES.c.id)
)


def moves_since(s: Session, generation: int) -> list[Move] | None:
    """The GPU moves of every write after ``generation``, in order; None when some of them
    are no longer kept (read the held GPUs again)."""
    if generation < (s.info.get("moves_after") or 0):
        return None
    rows = connection(s).execute(MOVES_SINCE, {"generation": generation})
    return [(gpu_id, bool(held), part, parts) for gpu_id, held, part, parts in rows]


def note_held(session: Session, _flush_context) -> None:
    """``after_flush``: record every allocation-GPU row this flush made, changed or deleted."""
    changes = session.info.setdefault(CHANGES, [])
    for row in session.new:
        if isinstance(row, AllocationGpu):
            changes.append((row.gpu_id, bool(row.held), row.part or 0, row.parts or 0))
    for row in session.dirty:
        if isinstance(row, AllocationGpu) and inspect(row).attrs.held.history.has_changes():
            changes.append((row.gpu_id, bool(row.held), row.part or 0, row.parts or 0))
    for row in session.deleted:
        if isinstance(row, AllocationGpu):
            changes.append((row.gpu_id, False, row.part or 0, row.parts or 0))


@dataclass(frozen=True)
class FreeState:
    """The free GPUs at one generation of the ledger and one version of its inventory, kept
    as their groups by node: a decision reads them as a ``GroupedGpus`` over those groups,
    never as one tuple of thousands (made per decision, that was 0.13-0.3 ms of each)."""

    generation: int
    inventory: int
    groups: dict[str, list[policy.Gpu]]  # the free GPUs of each node with any (read only)
    everyone: policy.GpuSet  # the present GPUs they are free among
    fit: policy.FitIndex  # the groups' nodes by free count, for the one-node best fit
    # the GPUs held in slices, by row id: the (part, parts) held of each (a GPU held in parts
    # is not free for a whole request; a few on a cluster, kept whole from write to write)
    split: dict[int, frozenset[tuple[int, int]]] = field(default_factory=dict)

    @cached_property
    def free(self) -> policy.GroupedGpus:
        return policy.GroupedGpus(self.groups, (self.everyone, self.fit))

    @classmethod
    def read(cls, generation: int, present, held: Iterable[tuple[int, int, int]]) -> FreeState:
        """From the held rows ``(gpu_id, part, parts)``: a GPU is free when no row holds it,
        whole or any part of it."""
        whole: set[int] = set()
        split: dict[int, set[tuple[int, int]]] = {}
        for gpu_id, part, parts in held:
            if part:
                split.setdefault(gpu_id, set()).add((part, parts))
            else:
                whole.add(gpu_id)
        taken = whole | split.keys()
        free = policy.GpuSet.ordered(
            g for g, i in zip(present.gpus, present.ids, strict=True) if i not in taken
        )
        groups = free.by_node(None)
        fit = policy.make_fit_index(groups, present.gpus.by_node(None))
        frozen = {i: frozenset(p) for i, p in split.items()}
        return cls(generation, present.version, groups, present.gpus, fit, frozen)

    def at(self, generation: int) -> FreeState:
        """The same free GPUs at a later generation (a write that moved none)."""
        later = replace(self, generation=generation)
        if "free" in self.__dict__:
            later.__dict__["free"] = self.free
        return later

    def after(self, generation: int, present, changes: list[Move]) -> FreeState:
        """This state with ``changes`` applied, in order: only their nodes change (absent
        GPUs are never free). A GPU is free again when its last held part is given back (it
        is never held whole and in parts at once: ``spawner/ledger/slices.py``)."""
        by_id, before = present.by_id, self.groups
        nodes: dict[str, set[policy.Gpu]] = {}
        split = self.split
        for gpu_id, held, part, parts in changes:
            g = by_id.get(gpu_id)
            if g is None:
                continue
            free = nodes.get(g.node)
            if free is None:
                free = nodes[g.node] = set(before.get(g.node, ()))
            if not part:
                (free.discard if held else free.add)(g)
                continue
            if split is self.split:
                split = dict(split)
            now = set(split.get(gpu_id, ()))
            (now.add if held else now.discard)((part, parts))
            if now:
                split[gpu_id] = frozenset(now)
                free.discard(g)
            else:
                split.pop(gpu_id, None)
                free.add(g)
        groups = dict(before)
        for node, free in nodes.items():
            if free:
                groups[node] = sorted(free)
            else:
                groups.pop(node, None)
        if any(node not in before for node in nodes if node in groups):
            groups = dict(sorted(groups.items()))  # a node came back: keep the nodes in order
        everyone = self.everyone.by_node(None)
        moved = {
            node: (len(before.get(node, ())), len(free), len(everyone.get(node, ())))
            for node, free in nodes.items()
        }
        fit = policy.refit(self.fit, moved)
        return FreeState(generation, self.inventory, groups, self.everyone, fit, split)
