"""Ranks for ``%%distributed``: torchrun's environment for each GPU, as pure functions.

The contract is ``torch/distributed/run.py``'s: every rank gets ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (plus, here,
``CUDA_VISIBLE_DEVICES`` naming its one GPU, in PCI bus order), so code written for torchrun
runs unchanged. Ranks run node by node, GPU index by GPU index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Slot:
    """One GPU a rank will use: ``node`` as the ledger names it, ``index`` on that node."""

    node: str
    index: int

    @classmethod
    def parse(cls, label: str) -> Slot:
        node, _, index = label.rpartition(":")
        if not node or not index.isdigit():
            raise ValueError(f"a GPU label is node:index; got {label!r}")
        return cls(node, int(index))

    @property
    def label(self) -> str:
        return f"{self.node}:{self.index}"


@dataclass(frozen=True)
class RankSpec:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    slot: Slot
    master_addr: str
    master_port: int
    group_rank: int = 0
    group_world_size: int = 1
    run_id: str = "gpuhub"

    def env(self) -> dict[str, str]:
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            # the rest of what torchrun (torchelastic) sets for a single-role job
            "GROUP_RANK": str(self.group_rank),
            "GROUP_WORLD_SIZE": str(self.group_world_size),
            "ROLE_NAME": "default",
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "CUDA_VISIBLE_DEVICES": str(self.slot.index),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "GPUHUB_RANK_GPU": self.slot.label,
        }


def make_rank_specs(
    slots: Sequence[Slot], master_addr: str, master_port: int, run_id: str = "gpuhub"
) -> list[RankSpec]:
    """One rank per GPU; the lowest node's lowest GPU is rank 0; nodes are torchrun's groups."""
    ordered = sorted(slots)
    if len(set(ordered)) != len(ordered):
        raise ValueError("a GPU appears twice in the placement")
    per_node: dict[str, int] = {}
    for s in ordered:
        per_node[s.node] = per_node.get(s.node, 0) + 1
    groups = {node: i for i, node in enumerate(sorted(per_node))}
    seen: dict[str, int] = {}
    specs = []
    for rank, s in enumerate(ordered):
        local = seen.get(s.node, 0)
        seen[s.node] = local + 1
        specs.append(
            RankSpec(
                rank,
                local,
                len(ordered),
                per_node[s.node],
                s,
                master_addr,
                master_port,
                group_rank=groups[s.node],
                group_world_size=len(groups),
                run_id=run_id,
            )
        )
    return specs


def choose_slots(server_gpus: Sequence[str], wanted: int) -> list[Slot] | None:
    """The session's own GPUs when it holds enough (the first ``wanted``), else None."""
    slots = sorted(Slot.parse(g) for g in server_gpus if g)
    return slots[:wanted] if wanted <= len(slots) else None
