"""What the Slurm watcher decides from one answer of Slurm's: pure functions, no I/O.

- :func:`reconcile`: what the ledger must do for each live Slurm allocation (write the GPUs
  of a job that started, attach a job found by its ``gpuhub:ID`` tag, release an allocation
  whose job ended or left Slurm);
- :func:`orphans`: gpuhub jobs still in Slurm that no live allocation accounts for (to cancel);
- :func:`next_interval`: the pause before the next ``squeue``.

:mod:`spawner.slurm.watcher` runs the queries and carries out the :class:`Action` s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from spawner.policy.records import AllocationInfo
from spawner.slurm.squeue import JobInfo


@dataclass(frozen=True)
class Action:
    kind: str  # "record" (write the job's GPUs), "attach" (its job id), "release", "cancel"
    allocation: AllocationInfo
    job_id: str | None
    reason: str = ""


def reconcile(
    allocations: Iterable[AllocationInfo],
    listed: dict[str, JobInfo],
    now: datetime,
    never_submitted_after: timedelta = timedelta(minutes=5),
) -> list[Action]:
    """What the ledger must do given Slurm's answer. ``allocations``: live Slurm ones, read
    before the query; ``listed``: the query's jobs; ``now``: the ledger's clock (naive UTC)."""
    tagged: dict[int, JobInfo | None] = {}
    for j in listed.values():
        if j.allocation_id and not j.ended:  # two live jobs with one tag: attach neither
            tagged[j.allocation_id] = None if j.allocation_id in tagged else j
    actions = []
    for a in allocations:
        job = listed.get(a.backend_job_id) if a.backend_job_id else None
        if a.backend_job_id is None:
            found = tagged.get(a.id)
            if found is not None and found.user == a.user:
                # submitted, but its id never reached the ledger (a hub stopped, a cancelled spawn)
                actions.append(Action("attach", a, found.job_id, "found by its gpuhub tag"))
            elif now - a.created > never_submitted_after:
                actions.append(
                    Action("release", a, None, "never reached Slurm (hub stopped while submitting)")
                )
        elif job is None:
            actions.append(Action("release", a, a.backend_job_id, f"Slurm job {a.backend_job_id} is gone"))
        elif job.ended:
            actions.append(
                Action("release", a, job.job_id, f"Slurm job {job.job_id} ended ({job.state.lower()})")
            )
        elif job.running and len(a.gpus) < a.gpu_count and job.user == a.user:
            actions.append(Action("record", a, job.job_id))
    return actions


def next_interval(
    previous: float,
    changed: bool,
    waiting: bool,
    starting_ages: Iterable[float],
    min_interval: float,
    max_interval: float,
    start_interval: float,
) -> float:
    """The pause before the next ``squeue``. ``previous``: the last pause; ``changed``: the
    last answer changed something; ``waiting``: a spawner waits for an answer;
    ``starting_ages``: seconds since each tracked job that has not started yet was submitted.

    The usual rule is ``min_interval``, doubling up to ``max_interval`` while nothing changes.
    A job not started yet is asked about at a tenth of its age, from ``start_interval`` up to
    ``min_interval``: polling is fast in the second after a submit, when a free cluster
    starts the job, and no faster than usual for a job that queues."""
    usual = min_interval if changed or waiting else min(max_interval, previous * 2)
    ages = list(starting_ages)
    if not ages:
        return usual
    return min(usual, max(start_interval, min(min_interval, 0.1 * min(ages))))


def orphans(
    live: Iterable[AllocationInfo],
    others: Iterable[AllocationInfo],
    listed: dict[str, JobInfo],
    now: datetime,
    recent: timedelta = timedelta(days=1),
) -> list[Action]:
    """gpuhub jobs still in Slurm that no live allocation accounts for: cancel them.

    ``live``: live Slurm allocations; ``others``: released ones, found by the jobs' ids or
    tags. A job is cancelled when its allocation was released (recently: job ids wrap
    around), or when its tag names a live allocation that runs another job. Only jobs of
    the allocation's own user are touched.
    """
    live = {a.id: a for a in live}
    by_job = {a.backend_job_id: a for a in others if a.backend_job_id}
    by_id = {a.id: a for a in others}
    out = []
    for job in listed.values():
        if job.ended or job.state == "COMPLETING":
            continue  # ending already: cancelling again changes nothing
        a = by_job.get(job.job_id)
        if a is not None and a.user == job.user and a.ended and now - a.ended < recent:
            out.append(Action("cancel", a, job.job_id, f"its allocation was released ({a.end_reason})"))
            continue
        tag = job.allocation_id
        if tag is None:
            continue
        owner = live.get(tag)
        if owner is not None:
            if owner.user == job.user and owner.backend_job_id not in (None, job.job_id):
                out.append(
                    Action("cancel", owner, job.job_id, f"allocation {tag} runs job {owner.backend_job_id}")
                )
            continue
        a = by_id.get(tag)
        if a is not None and a.user == job.user and not a.active:
            out.append(Action("cancel", a, job.job_id, f"its allocation was released ({a.end_reason})"))
    return out
