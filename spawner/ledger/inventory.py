"""The ledger's GPUs and nodes (a part of :class:`spawner.ledger.Ledger`)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from .. import policy
from ..models import (
    AllocationGpu,
    Gpu,
    Node,
)
from .base import AllocationInfo, GpuStatus, _gpu, _info


class InventoryRecords:
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
            for row in s.scalars(select(Gpu).options(selectinload(Gpu.node))):
                key = (row.node.name, row.index)
                seen.add(key)
                if row.node.name not in covered:
                    continue
                g = wanted.get(key)
                row.present = g is not None
                if g is not None:
                    row.model, row.memory_mib, row.uuid = g.model, g.memory_mib, g.uuid
            for key, g in sorted(wanted.items()):
                if key in seen:
                    continue
                node = nodes.get(g.node)
                if node is None:
                    node = nodes[g.node] = Node(name=g.node)
                    s.add(node)
                s.add(
                    Gpu(
                        node=node,
                        index=g.index,
                        model=g.model,
                        memory_mib=g.memory_mib,
                        uuid=g.uuid,
                        present=True,
                    )
                )

    def _inventory(self, s: Session) -> list[policy.Gpu]:
        rows = s.scalars(select(Gpu).where(Gpu.present).options(selectinload(Gpu.node)))
        return sorted(_gpu(g) for g in rows)

    def _held_gpu_ids(self, s: Session) -> set[int]:
        return set(s.scalars(select(AllocationGpu.gpu_id).where(AllocationGpu.held)))

    def _free(self, s: Session) -> list[policy.Gpu]:
        held = self._held_gpu_ids(s)
        rows = s.scalars(select(Gpu).where(Gpu.present).options(selectinload(Gpu.node)))
        return sorted(_gpu(g) for g in rows if g.id not in held)

    def models(self) -> list[str]:
        with self._read() as s:
            return sorted({g.model for g in self._inventory(s)})

    def gpu_table(self) -> list[GpuStatus]:
        with self._read() as s:
            holders: dict[int, AllocationInfo] = {}
            for a in self._active(s):
                info = _info(a)
                for ag in a.gpus:
                    holders[ag.gpu_id] = info
            rows = s.scalars(select(Gpu).options(selectinload(Gpu.node)))
            return sorted(
                (GpuStatus(_gpu(g), g.present, holders.get(g.id)) for g in rows),
                key=lambda st: st.gpu,
            )
