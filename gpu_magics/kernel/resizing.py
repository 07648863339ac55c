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


def shrink_text(s: Shrunk) -> list[str]:
    """The report's lines: new size, what was kept, what was resharded, what was lost."""
    left = ", ".join(f"{r} (GPU {gpu})" for r, gpu in s.left)
    plural = "s" if len(s.left) > 1 else ""
    lines = [
        f"The pool shrank in place from {s.old_size} to {count(s.size, 'rank')}: rank{plural} "
        f"{left} left; the others kept their processes and every variable (renumbered "
        f"{ranks_text(list(range(s.size)))}; `rank` and `world_size` say so)."
    ]
    if s.checked:
        lines.append(
            f"The world group was re-formed at {count(s.size, 'rank')} and answered a collective on "
            "every rank."
        )
    else:
        lines.append("The new world group did not answer on every rank: the next cell starts fresh engines.")
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
    for name, info in sorted(s.resharded.get("models", {}).items()):
        with_opt = info.get("optimizers") or []
        extra = f" with {', '.join(with_opt)}" if with_opt else ""
        lines.append(
            f"Resharded onto {count(s.size, 'rank')}: {name} (FSDP2){extra}, checked against the "
            "gathered state."
        )
    for name, why in sorted(s.resharded.get("refused", {}).items()):
        lines.append(f"Not resharded: {name} ({why}).")
    lost = [f"{g} (a process group of the old world)" for g in s.lost_groups]
    lost += [f"{m} (a DeviceMesh of the old world)" for m in s.lost_meshes]
    if lost:
        lines.append("Lost: " + ", ".join(lost) + "; make them again for the new world.")
    lines.append(f"Run the next cells with --gpus {s.size}.")
    return lines
