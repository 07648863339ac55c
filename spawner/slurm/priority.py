"""Slurm's own queue, configured from gpuhub's fair share and shown as gpuhub's wait line.

On the Slurm backend gpuhub runs no queue of its own: Slurm's ``priority/multifactor``
orders the waiting jobs. The same model as the local queue (:mod:`spawner.policy.fairshare`):

- each user association's ``Fairshare`` is their gpuhub share (``c.GpuHub.default_share``,
  ``group_shares``, ``user_shares``; written by :mod:`.accounting`);
- usage is GPU-seconds (``TRESBillingWeights=GRES/gpu=1.0`` on each partition: a job bills
  its GPUs, so a CPU-only server uses nothing), decayed with ``PriorityDecayHalfLife`` =
  ``c.GpuHub.fairshare_half_life_hours``;
- ``PriorityFlags=NO_FAIR_TREE``: Slurm's classic factor ``2 ** -(U/S)``, gpuhub's formula;
- ``PriorityWeightFairshare`` / ``PriorityWeightAge`` / ``PriorityMaxAge`` are gpuhub's
  ``priority_weight_fairshare`` / ``priority_weight_age`` / ``priority_max_age_hours``;
  every other factor weighs 0.

:func:`slurm_priority_conf` renders those ``slurm.conf`` lines (``gpuhub slurm priority``
prints them for a hub's config). :func:`wait_message` is what the spawn page and
``%%distributed`` show while a job waits: its place among the jobs waiting for the same
partition by Slurm's priority (:func:`.squeue.queue_positions`) and Slurm's own expected start
(the pending job's ``start_time``, what ``squeue --start`` prints), both from
``squeue --json`` only.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from spawner.policy.fairshare import Weights
from spawner.policy.waitline import wait_line
from spawner.slurm.squeue import JobInfo


def slurm_duration(hours: float) -> str:
    """Hours as Slurm's ``days-hh:mm:ss`` (rounded to the second): 168 -> ``7-00:00:00``."""
    if not hours >= 0 or hours == float("inf"):
        raise ValueError(f"a duration must be 0 hours or more; got {hours!r}")
    seconds = round(hours * 3600)
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    clock = f"{h:02d}:{m:02d}:{s:02d}"
    return f"{days}-{clock}" if days else clock


def slurm_priority_conf(weights: Weights, calc_period_minutes: int = 5) -> dict[str, str]:
    """The ``slurm.conf`` settings that make Slurm order waiting jobs by gpuhub's fair-share
    model (pure). ``calc_period_minutes``: how often Slurm recomputes the factors
    (``PriorityCalcPeriod``, whole minutes, 1 or more; Slurm's default 5)."""
    if (
        isinstance(calc_period_minutes, bool)
        or not isinstance(calc_period_minutes, int)
        or calc_period_minutes < 1
    ):
        raise ValueError(f"PriorityCalcPeriod is whole minutes, 1 or more; got {calc_period_minutes!r}")
    return {
        "PriorityType": "priority/multifactor",
        "PriorityFlags": "NO_FAIR_TREE",
        "PriorityDecayHalfLife": slurm_duration(weights.half_life_hours),
        "PriorityMaxAge": slurm_duration(weights.max_age_hours),
        "PriorityCalcPeriod": str(calc_period_minutes),
        "PriorityWeightFairshare": str(weights.fairshare),
        "PriorityWeightAge": str(weights.age),
        "PriorityWeightJobSize": "0",
        "PriorityWeightPartition": "0",
        "PriorityWeightQOS": "0",
        "PriorityFavorSmall": "NO",
    }


PARTITION_SETTING = "TRESBillingWeights=GRES/gpu=1.0"  # on every PartitionName line


def render_priority_conf(weights: Weights, calc_period_minutes: int = 5) -> str:
    lines = [f"{k}={v}" for k, v in slurm_priority_conf(weights, calc_period_minutes).items()]
    lines.append(f"# and on every PartitionName line: {PARTITION_SETTING}")
    return "\n".join(lines) + "\n"


# Slurm sets a pending job's start time a year ahead where its scheduler found none (a job that
# cannot start until running ones end, beyond the backfill window): that is no estimate
NO_ESTIMATE = timedelta(days=300)


def slurm_estimate(expected: datetime | None, now: datetime) -> datetime | None:
    """Slurm's expected start, or None where it is Slurm's "a year ahead" (none found)."""
    return expected if expected is not None and expected - now < NO_ESTIMATE else None


PLACE_HIDDEN = "your place among other users' jobs is private on this cluster (Slurm's PrivateData)"


def wait_message(
    job: JobInfo,
    position: tuple[int, int, str] | None,
    gpus: int | str,
    now: datetime,
    what: str = "job",
    place_hidden: bool = False,
) -> str:
    """The line for a job waiting in Slurm's queue, e.g. ``Queued in Slurm as job 42 in
    partition gpu: 2nd of 3 waiting for 2 GPUs, expected start about 14:20 (in 12 min;
    Slurm's estimate, not a promise). Slurm's reason: Resources``. Without a position
    (the job is held, or this Slurm has no JSON), Slurm's state and reason as before. With
    ``place_hidden`` (the caller sees only its own jobs: ``PrivateData=jobs``) no place is
    counted, and the line says why."""
    if not job.pending or (position is None and not place_hidden):
        return job.describe()
    reason = job.reason if job.reason and job.reason != "None" else "waiting"
    if place_hidden:
        partition = job.partition.split(",")[0] or "?"
        line = wait_line(None, 0, gpus, slurm_estimate(job.expected, now), "slurm", now)
        return (
            f"Queued in Slurm as {what} {job.job_id} in partition {partition}: {line}; {PLACE_HIDDEN}. "
            f"Slurm's reason: {reason}"
        )
    n, of, partition = position
    line = wait_line(n, of, gpus, slurm_estimate(job.expected, now), "slurm", now)
    return (
        f"Queued in Slurm as {what} {job.job_id} in partition {partition}: {line}. Slurm's reason: {reason}"
    )
