"""The ledger's GPUs and nodes (a part of :class:`spawner.ledger.Ledger`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session, selectinload

from spawner import policy
from spawner.ledger.db import connection
from spawner.ledger.freeset import CHANGES, FreeState, moves_since
from spawner.ledger.models import Allocation, AllocationGpu, GpuRow, LedgerLock, Node, is_live
from spawner.policy.records import AllocationInfo, GpuStatus

_AG = AllocationGpu.__table__
HELD_GPUS = select(_AG.c.gpu_id).where(_AG.c.held)
HELD_ROWS = select(_AG.c.gpu_id, _AG.c.part, _AG.c.parts).where(_AG.c.held)


@dataclass(frozen=True)
class Present:
    """The GPUs present at one version of the inventory (``ledger_lock.inventory``), sorted,
    with their row ids: what every admission places on, kept in memory while it is the same."""

    version: int
    gpus: policy.GpuSet
    ids: tuple[int, ...]  # the row id of each of ``gpus``

    @cached_property
    def by_id(self) -> dict[int, policy.Gpu]:
        return dict(zip(self.ids, self.gpus, strict=True))

    @cached_property
    def id_of(self) -> dict[tuple[str, int], int]:
        return {(g.node, g.index): i for g, i in zip(self.gpus, self.ids, strict=True)}


class GpuRecords:
    """Which GPUs exist, and which are free."""

    def sync_inventory(self, gpus: Iterable[policy.Gpu], nodes: Iterable[str] | None = None) -> None:
        """Make the ledger's GPUs of ``nodes`` match the inventory, keeping every allocation.

        ``nodes`` are the nodes this inventory speaks for (default: those it lists); GPUs of
        other nodes are left alone, so a process with a partial view cannot hide them. New
        GPUs are added, known ones updated, missing ones marked absent (never deleted: a
        live allocation or the usage history may still name them).
        """
        wanted = {(g.node, g.index): g for g in gpus}
        covered = set(nodes) if nodes is not None else {node for node, _ in wanted}
        with self._tx() as s:
            nodes = {n.name: n for n in s.scalars(select(Node))}
            seen = set()
            changed = False
            for row in s.scalars(select(GpuRow).options(selectinload(GpuRow.node))):
                key = (row.node.name, row.index)
                seen.add(key)
                if row.node.name not in covered:
                    continue
                g = wanted.get(key)
                now = (
                    g is not None,
                    *((g.model, g.memory_mib, g.uuid) if g else (row.model, row.memory_mib, row.uuid)),
                )
                if now != (row.present, row.model, row.memory_mib, row.uuid):
                    row.present, row.model, row.memory_mib, row.uuid = now
                    changed = True
            for key, g in sorted(wanted.items()):
                if key in seen:
                    continue
                changed = True
                node = nodes.get(g.node)
                if node is None:
                    node = nodes[g.node] = Node(name=g.node)
                    s.add(node)
                s.add(
                    GpuRow(
                        node=node,
                        index=g.index,
                        model=g.model,
                        memory_mib=g.memory_mib,
                        uuid=g.uuid,
                        present=True,
                    )
                )
            if changed:  # every process reloads its copy of the inventory
                s.execute(
                    update(LedgerLock).where(LedgerLock.id == 1).values(inventory=LedgerLock.inventory + 1)
                )
                s.info.pop("inventory", None)
            else:
                s.info["changed"] = False  # nothing any decision depends on

    def _present(self, s: Session) -> Present:
        """The present GPUs, read again only when ``sync_inventory`` changed them."""
        version = s.info.get("inventory")
        if version is None:  # a reading transaction (a writing one read it with the lock)
            version = s.scalar(select(LedgerLock.inventory).where(LedgerLock.id == 1)) or 0
        cached = getattr(self, "_present_cache", None)
        if cached is not None and cached.version == version:
            return cached
        rows = s.execute(
            select(GpuRow.id, Node.name, GpuRow.index, GpuRow.model, GpuRow.memory_mib, GpuRow.uuid)
            .join(Node, GpuRow.node_id == Node.id)
            .where(GpuRow.present)
        ).all()
        pairs = sorted(
            (policy.Gpu(name, index, model, mem, uuid), gid) for gid, name, index, model, mem, uuid in rows
        )
        present = Present(version, policy.GpuSet.ordered(g for g, _ in pairs), tuple(i for _, i in pairs))
        self._present_cache = present
        return present

    def _inventory(self, s: Session) -> policy.GpuSet:
        return self._present(s).gpus

    def _held_gpu_ids(self, s: Session) -> set[int]:
        """The GPUs held, whole or in part."""
        return set(connection(s).execute(HELD_GPUS).scalars())

    def _held_rows(self, s: Session) -> list[tuple[int, int, int]]:
        return [tuple(row) for row in connection(s).execute(HELD_ROWS)]

    def _free(self, s: Session) -> policy.GpuSet | policy.GroupedGpus:
        """The present GPUs no live allocation holds, whole or in part."""
        return self._free_state_in(s).free

    def _free_state_in(self, s: Session) -> FreeState:
        """The free GPUs and the GPUs held in parts. A writing transaction uses those this
        process kept, brought up to date with the moves written since (``freeset``)."""
        present = self._present(s)
        if s.new or s.dirty or s.deleted:
            s.flush()  # this transaction's own changes first (note_held records them)
        generation = s.info.get("generation")
        if generation is None:  # a reader
            return FreeState.read(-1, present, self._held_rows(s))
        state = getattr(self, "_free_state", None)
        if state is not None and state.inventory == present.version and state.generation < generation:
            moved = moves_since(s, state.generation)  # another process wrote since: its moves
            state = None if moved is None else state.after(generation, present, moved)
        if state is None or state.generation != generation or state.inventory != present.version:
            if s.info.get(CHANGES):  # GPUs moved in this transaction, before anything was kept
                return FreeState.read(-1, present, self._held_rows(s))
            state = FreeState.read(generation, present, self._held_rows(s))
        self._free_state = state  # as at the transaction's start (what _committed builds on)
        changes = s.info.get(CHANGES)
        if changes:  # GPUs moved in this transaction (an earlier write of a combined turn)
            return state.after(generation, present, changes)
        return state

    def _committed(self, s: Session, before: int, after: int) -> None:
        """After a writing transaction committed (generation ``before`` to ``after``): keep
        the free GPUs for the next one, with what this one took or gave back."""
        state, changes = getattr(self, "_free_state", None), s.info.get(CHANGES)
        if state is None:
            return
        present = getattr(self, "_present_cache", None)  # the session is closed: no reads now
        if (
            present is None
            or state.inventory != s.info.get("inventory")
            or present.version != state.inventory
        ):
            self._free_state = None  # the inventory changed: read it all again
        elif state.generation == before:  # still the newest: this transaction's moves on top
            self._free_state = state.after(after, present, changes) if changes else state.at(after)
        # else another process wrote since it was read: it stays as it was, at its own
        # generation, and the next writing transaction catches up through gpu_moves

    def present_gpus(self) -> list[policy.Gpu]:
        """The GPUs present now, in order."""
        with self._read() as s:
            return list(self._inventory(s))

    def models(self) -> list[str]:
        with self._read() as s:
            return sorted({g.model for g in self._inventory(s)})

    def gpu_census(self) -> tuple[dict[tuple[str, str, str], int], dict[str, tuple[int, float, int]]]:
        """What the metrics scrape reads, from one snapshot and without a record per GPU or per
        allocation (ten thousands on a large cluster): the GPUs counted by (node, model, state:
        ``allocated``, ``sliced`` (held in slices), ``free`` or ``absent``), and per purpose the
        live allocations, the GPUs they hold (a slice: its share) and how many of those are
        borrowed."""
        with self._read() as s:
            present, rows = self._present(s), self._held_rows(s)
            held = {gpu_id for gpu_id, part, _ in rows if not part}
            split = {gpu_id for gpu_id, part, _ in rows if part}
            counts: dict[tuple[str, str, str], int] = {}
            for g, gpu_id in zip(present.gpus, present.ids, strict=True):
                state = "allocated" if gpu_id in held else "sliced" if gpu_id in split else "free"
                key = (g.node, g.model, state)
                counts[key] = counts.get(key, 0) + 1
            absent = (
                select(Node.name, GpuRow.model).join(Node, Node.id == GpuRow.node_id).where(~GpuRow.present)
            )
            for node, model in s.execute(absent):
                counts[(node, model, "absent")] = counts.get((node, model, "absent"), 0) + 1
            live = {
                purpose: (n, 0, borrowed or 0)
                for purpose, n, borrowed in s.execute(
                    select(Allocation.purpose, func.count(), func.sum(Allocation.borrowed))
                    .where(is_live())
                    .group_by(Allocation.purpose)
                )
            }
            named = (
                select(Allocation.purpose, AllocationGpu.parts, func.count())
                .select_from(AllocationGpu)
                .join(Allocation, Allocation.id == AllocationGpu.allocation_id)
                .where(is_live())
                .group_by(Allocation.purpose, AllocationGpu.parts)
            )
            for purpose, parts, gpus in s.execute(named):
                n, before, borrowed = live[purpose]
                live[purpose] = (n, before + (gpus / parts if parts else gpus), borrowed)
        return counts, live

    def gpu_table(self) -> list[GpuStatus]:
        with self._read() as s:
            holders: dict[tuple[str, int], AllocationInfo] = {}
            split: dict[tuple[str, int], list[tuple[policy.Gpu, AllocationInfo]]] = {}
            for info in self._live_infos(s):
                for g in info.gpus:
                    if g.part:
                        split.setdefault((g.node, g.index), []).append((g, info))
                    else:
                        holders[(g.node, g.index)] = info

            def status(g: policy.Gpu, present: bool) -> GpuStatus:
                key = (g.node, g.index)
                return GpuStatus(
                    g, present, holders.get(key), tuple(sorted(split.get(key, ()), key=lambda x: x[0]))
                )

            table = [status(g, True) for g in self._present(s).gpus]
            absent = s.execute(
                select(Node.name, GpuRow.index, GpuRow.model, GpuRow.memory_mib, GpuRow.uuid)
                .join(Node, Node.id == GpuRow.node_id)
                .where(~GpuRow.present)
            ).all()
            if not absent:  # the present GPUs are in order already
                return table
            table += [
                status(policy.Gpu(node, index, model, mem, uuid), False)
                for node, index, model, mem, uuid in absent
            ]
            return sorted(table, key=lambda st: (st.gpu.node, st.gpu.index))
