"""Pure decisions and words for a pool that changes size in place (``kernel.resize``): whether
it can shrink, and the cell's report of what happened. No I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_magics.common.ranks import RankSpec
from gpu_magics.common.words import count


def shrink_problem(specs: list[RankSpec], leaving: list[int], remote: bool = False) -> str | None:
    """Why the pool cannot shrink by the ranks ``leaving``; None when it can."""
    ranks = {s.rank for s in specs}
    if not leaving:
        return "no rank leaves"
    if not set(leaving) <= ranks:
        return f"rank {min(set(leaving) - ranks)} is not in the pool"
    if set(leaving) == ranks:
        return "every rank leaves"
    if 0 in leaving:
        return "rank 0 leaves (it holds the rendezvous and the gathered state)"
    if remote:
        return "the ranks run on other machines (a Slurm pool shrinks through Slurm)"
    return None


def leaving_ranks(specs: list[RankSpec], slots: list[str]) -> list[int]:
    """The ranks on the GPUs ``slots`` (labels) that are taken back."""
    taken = set(slots)
    return [s.rank for s in specs if s.slot.label in taken]


@dataclass
class Shrunk:
    old_size: int
    left: list[tuple[int, str]]  # (old rank, GPU label) of each rank that left
    pids: list[int]  # the survivors', in their new rank order
    checked: bool  # the new world group answered a collective on every survivor
    ddp: list[str] = field(default_factory=list)
    ddp_equal: bool = True  # every DDP replica's parameters and buffers equal across ranks
    resharded: dict = field(default_factory=dict)  # engine.reshard's report
    lost_groups: list[str] = field(default_factory=list)
    lost_meshes: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.pids)


def ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def _world_line(size: int, checked: bool) -> str:
    if checked:
        return (
            f"The world group was re-formed at {count(size, 'rank')} and answered a collective on every rank."
        )
    return "The new world group did not answer on every rank: the next cell starts fresh engines."


def _lost_line(groups: list[str], meshes: list[str]) -> list[str]:
    lost = [f"{g} (a process group of the old world)" for g in groups]
    lost += [f"{m} (a DeviceMesh of the old world)" for m in meshes]
    return ["Lost: " + ", ".join(lost) + "; make them again for the new world."] if lost else []


def _resharded_lines(resharded: dict, size: int) -> list[str]:
    """What became of the FSDP2 models in a move (``kernel.resize.Sharded.rebuild``)."""
    lines = []
    for name, info in sorted(resharded.get("models", {}).items()):
        with_opt = info.get("optimizers") or []
        extra = f" with {', '.join(with_opt)}" if with_opt else ""
        lines.append(
            f"Resharded onto {count(size, 'rank')}: {name} (FSDP2){extra}, its full state checked "
            "equal to the state before the move."
        )
    lines += [f"Not resharded: {name} ({why})." for name, why in sorted(resharded.get("refused", {}).items())]
    return lines


def shrink_text(s: Shrunk) -> list[str]:
    """The report's lines: new size, what was kept, what was resharded, what was lost."""
    left = ", ".join(f"{r} (GPU {gpu})" for r, gpu in s.left)
    plural = "s" if len(s.left) > 1 else ""
    lines = [
        f"The pool shrank in place from {s.old_size} to {count(s.size, 'rank')}: rank{plural} "
        f"{left} left; the others kept their processes and every variable (renumbered "
        f"{ranks_text(list(range(s.size)))}; `rank` and `world_size` say so)."
    ]
    lines.append(_world_line(s.size, s.checked))
    if s.ddp:
        if s.ddp_equal:
            lines.append(
                "DDP models go on with the new group from their replicated parameters, checked equal on "
                "every rank: " + ", ".join(s.ddp) + "."
            )
        else:
            lines.append(
                "DDP models moved to the new group, but their parameters differ between ranks: "
                + ", ".join(s.ddp)
                + "; restore them from a checkpoint."
            )
    lines += _resharded_lines(s.resharded, s.size)
    lines += _lost_line(s.lost_groups, s.lost_meshes)
    lines.append(f"Run the next cells with --gpus {s.size}.")
    return lines


def grow_problem(broken: bool, remote: bool, adding: int) -> str | None:
    """Why a pool cannot grow in place; None when it can."""
    if adding <= 0:
        return "no rank is added"
    if broken:
        return "the pool lost a rank or its group"
    if remote:
        return "the ranks run on other machines (a Slurm pool grows through a new job)"
    return None


def extended_specs(specs: list[RankSpec], new_slots: list) -> list[RankSpec]:
    """The pool's ranks as they are, then one rank per new GPU: existing ranks keep their
    numbers (rank 0 stays rank 0); local ranks count on from each node's."""
    slots = [s.slot for s in specs] + list(new_slots)
    per_node: dict[str, int] = {}
    for slot in slots:
        per_node[slot.node] = per_node.get(slot.node, 0) + 1
    nodes = {node: i for i, node in enumerate(dict.fromkeys(s.node for s in slots))}
    seen: dict[str, int] = {}
    first = specs[0]
    out = []
    for rank, slot in enumerate(slots):
        local = seen.get(slot.node, 0)
        seen[slot.node] = local + 1
        out.append(
            RankSpec(
                rank,
                local,
                len(slots),
                per_node[slot.node],
                slot,
                first.master_addr,
                first.master_port,
                group_rank=nodes[slot.node],
                group_world_size=len(nodes),
                run_id=first.run_id,
            )
        )
    return out


@dataclass
class Grown:
    old_size: int
    new: list[tuple[int, str]]  # (rank, GPU label) of each new rank
    pids: list[int]
    checked: bool
    copied: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    ddp: list[str] = field(default_factory=list)
    ddp_equal: bool = True
    adopted_everywhere: bool = True
    resharded: dict = field(default_factory=dict)
    lost_groups: list[str] = field(default_factory=list)
    lost_meshes: list[str] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.pids)


def grow_text(g: Grown) -> list[str]:
    new = ", ".join(f"{r} on GPU {gpu}" for r, gpu in g.new)
    plural = "s" if len(g.new) > 1 else ""
    lines = [
        f"gpuhub: the pool grew in place from {g.old_size} to {count(g.size, 'rank')}: new rank{plural} "
        f"{new}; {ranks_text(list(range(g.old_size)))} kept their processes and every variable."
    ]
    lines.append(_world_line(g.size, g.checked))
    copied = [n for n in g.copied if n not in g.ddp]
    if g.adopted_everywhere and (copied or g.ddp):
        lines.append(
            f"The new rank{plural} got a copy of rank 0's names: "
            + ", ".join([*(f"{n} (DDP)" for n in g.ddp), *copied])
            + ". Values that differ per rank (data shards, generators) are rank 0's there: make them again."
        )
    if g.ddp:
        if g.ddp_equal:
            lines.append(
                "DDP models go on with the new group, checked equal on every rank: " + ", ".join(g.ddp) + "."
            )
        else:
            lines.append(
                "DDP models differ between ranks after the copy: " + ", ".join(g.ddp) + "; rebuild them."
            )
    lines += _resharded_lines(g.resharded, g.size)
    not_copied = {k: v for k, v in g.failed.items() if k not in g.resharded.get("models", {})}
    if not_copied:
        lines.append(
            "Not copied to the new ranks: "
            + "; ".join(f"{k} ({v})" for k, v in sorted(not_copied.items()))
            + "."
        )
    lines += _lost_line(g.lost_groups, [m for m in g.lost_meshes if m not in g.resharded.get("meshes", [])])
    return lines
