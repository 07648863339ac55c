"""What a ``%%distributed`` cell's outcome is and how it is reported: the ranks it runs on
(:func:`parse_targets`), each rank that did not finish and what became of the pool
(:func:`report`), the errors a notebook shows for them (:class:`DistributedError`,
:class:`DistributedInterrupt`, :class:`DistributedPreempted`) and rank 0's result
(:class:`RankResult`)."""

from __future__ import annotations

from IPython.core.error import UsageError

from gpu_magics.kernel.pool import CellOutcome, EnginePool
from gpu_magics.kernel.resizing import ranks_text

NOT_RUN = "This cell did not run; run it again to start new engines."


class DistributedError(Exception):
    """One or more ranks failed; rendered as each rank's report, not the magic's traceback."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report

    def _render_traceback_(self):
        return self.report.splitlines()


class DistributedInterrupt(KeyboardInterrupt):
    """The kernel's interrupt, shown as the ranks' report rather than the magic's frames."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report

    def _render_traceback_(self):
        return ["KeyboardInterrupt: the cell was interrupted.", *self.report.splitlines()]


DistributedInterrupt.__name__ = DistributedInterrupt.__qualname__ = (
    "KeyboardInterrupt"  # as notebooks name it
)


class DistributedPreempted(DistributedError):
    """The pool was stopped because its borrowed GPUs were taken back."""

    def _render_traceback_(self):
        return ["Preempted: the pool's borrowed GPUs were taken back.", *self.report.splitlines()]


DistributedPreempted.__name__ = DistributedPreempted.__qualname__ = "Preempted"


class RankResult:
    """Rank 0's last expression, shown as the cell's result."""

    def __init__(self, execute_result: dict):
        self.data = execute_result.get("data", {})
        self.metadata = execute_result.get("metadata", {})

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data, self.metadata

    def __repr__(self):
        return self.data.get("text/plain", "")


def parse_targets(text: str, world: int) -> list[int]:
    """``0,2-3`` to ``[0, 2, 3]``: ranks only, never evaluated as code."""
    ranks: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise UsageError(f"--targets takes ranks like 0,2-3; got {text!r}")
        a, b = int(lo), int(hi or lo)
        if a > b or b >= world:
            raise UsageError(f"--targets: ranks run from 0 to {world - 1}; got {part!r}")
        ranks.update(range(a, b + 1))
    if not ranks:
        raise UsageError("--targets names no rank")
    return sorted(ranks)


def slurm_preemption(pool: EnginePool) -> str | None:
    """The engines' own line when Slurm preempted their job and they saved at its SIGTERM."""
    launcher = getattr(pool, "launcher", None)
    job, autosave = getattr(launcher, "job_id", ""), getattr(launcher, "autosave", None)
    if not job or not autosave or not autosave[0]:
        return None
    from gpu_magics.launch.slurm import preemption_report

    return preemption_report(autosave[1], job)


def place(pool: EnginePool, rank: int) -> str:
    """Where a rank runs: ``node vm, GPU vm:1, pid 123``."""
    info = pool.infos[rank] if rank < len(pool.infos) else {}
    slot = pool.specs[rank].slot
    return f"node {slot.node}, GPU {slot.label}, pid {info.get('pid', '?')}"


def report(outcome: CellOutcome, pool: EnginePool) -> str:
    """What happened to each rank that did not finish, and to the pool: plain lines."""
    lines = []
    for r in outcome.failed:
        where = outcome.places.get(r.rank) or place(pool, r.rank)
        if r.status == "died":
            lines.append(f"rank {r.rank} ({where}) died: its engine process ended during the cell.")
        elif r.status == "gone":
            lines.append(
                f"rank {r.rank} ({where}) is gone: its engine process ended before the cell; nothing ran."
            )
        elif r.status == "killed":
            lines.append(f"rank {r.rank} ({where}) did not stop when asked and freed; it was killed.")
        elif r.rank in outcome.freed:
            lines.append(
                f"rank {r.rank} ({where}) was waiting in a collective the other ranks did not reach; "
                "it was freed from it."
            )
        elif r.status == "interrupted":
            lines.append(f"rank {r.rank} ({where}) was interrupted.")
        else:
            lines.append(f"rank {r.rank} ({where}) raised {r.ename}: {r.evalue}")
            if r.traceback:
                lines += ["    " + t for t in r.traceback.splitlines()]
    lines += outcome.notes
    preempted = slurm_preemption(pool) if outcome.broken else None
    if preempted:
        lines += [
            preempted,
            "gpuhub: the engines' Slurm job was preempted (borrowed GPUs taken back); restore what "
            "was saved with %distributed restore NAME... in a pool within your limit.",
        ]
    if outcome.broken:
        lost = [r.rank for r in outcome.ranks if r.status in ("died", "killed", "gone")]
        which = ", ".join(map(str, lost)) or "a rank"
        lines.append(
            f"Lost: the process of rank {which} and its variables. A process group cannot go on "
            "without a rank, so the next %%distributed cell starts fresh engines on every rank: "
            "re-run the cells that define your objects, then %distributed restore NAME... what "
            "you saved."
        )
    elif outcome.shrunk:
        lost = [r.rank for r in outcome.ranks if r.status in ("died", "killed", "gone")]
        lines.append(f"Lost: the process of {ranks_text(lost)} and what only it held.")
        lines += outcome.shrunk
    elif outcome.failed or outcome.interrupted:
        lines.append("Every rank's variables are kept, in the same processes.")
    return "\n".join(lines)
