"""What gpuhub asks Slurm, as argument lists (no shell), and what it decides from Slurm's
answers before acting: ``sbatch``'s job id, whether a job may be cancelled, the QOS and GRES a
job asks for. No I/O here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from spawner.slurm import SlurmError
from spawner.slurm.sinfo import SINFO_FORMAT
from spawner.slurm.squeue import JobInfo, Listing, TextFormat


def squeue_json_argv() -> list[str]:
    """Every job as JSON (``parse_squeue_json``); 22.05 ignores filters with ``--json``."""
    return ["squeue", "--json", "-a"]


def sinfo_argv() -> list[str]:
    return ["sinfo", "-h", "-a", "-N", "-o", SINFO_FORMAT]


def sbatch_argv(allocation_id: int) -> list[str]:
    """sbatch for gpuhub's jobs: never requeued (a requeued job would come back on other
    GPUs), and tagged with the ledger allocation, on the command line so that an admin's own
    template cannot drop them."""
    return ["sbatch", "--parsable", "--no-requeue", f"--comment=gpuhub:{int(allocation_id)}"]


def job_detail_argv(job_id: str) -> list[str]:
    """The job's GPUs as JSON (``parse_job_gpus_json``). Slurm 22.05 lists every job with
    ``--json`` whatever the filters say; the filters cut the answer where Slurm honours them."""
    return ["squeue", "--json", "-a", "-t", "all", "-j", str(job_id)]


def parse_sbatch(output: str) -> str:
    """``sbatch --parsable`` prints ``ID`` or ``ID;cluster``; anything else is an error."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if not lines:
        raise SlurmError("sbatch printed no job id")
    job_id = lines[-1].split(";")[0].strip()
    if not job_id.isdigit():
        raise SlurmError(f"sbatch printed no job id: {output.strip()[-200:]!r}")
    return job_id


def squeue_text_argv(names: Iterable[str]) -> list[str]:
    """Every gpuhub job in one call (recently ended ones too, for their final state); the
    format goes in the environment (``squeue_text_env``), where other users cannot read it."""
    return ["squeue", "-h", "-a", "-t", "all", "--name", ",".join(sorted(names))]


def squeue_text_env(fmt: TextFormat, base: dict[str, str]) -> dict[str, str]:
    return {**base, "SQUEUE_FORMAT": fmt.format}


def gres_request(count: int, model: str | None, name: str = "gpu") -> str:
    """``--gres`` value: ``gpu:a100:2``, or ``gpu:2`` for any type; ``name="shard"``: Slurm's
    shards of GPUs of that type (a slice, ``spawner.slurm.shards``)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"a GPU job needs a count of 1 or more; got {count!r}")
    if model is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", model):
        raise ValueError(f"not a Slurm GPU type: {model!r}")
    return f"{name}:{model}:{count}" if model else f"{name}:{count}"


def job_qos(borrowed: int, borrow_qos: str) -> str:
    """The QOS a job is submitted under: the borrow QOS when any of its GPUs is borrowed
    (Slurm preempts whole jobs), else none (the association's default)."""
    return borrow_qos if borrowed > 0 and borrow_qos else ""


# before a cancel ------------------------------------------------------------------------


def cancel_refusal(
    listing: Listing, job_id: str, user: str, allocation_id: int, names: Iterable[str]
) -> str | None:
    """Why job ``job_id`` must not be cancelled for ``user``'s allocation ``allocation_id``
    (read again just before): None when Slurm lists it, readable, of that user, with one of
    gpuhub's names, tagged with that allocation and not ended."""
    job_id = str(job_id)
    if job_id in listing.unreadable:
        return f"Slurm's listing of job {job_id} cannot be read"
    job = listing.jobs.get(job_id)
    if job is None:
        return f"Slurm does not list job {job_id} as one of gpuhub's"
    if job.user != user:
        return f"job {job_id} belongs to {job.user!r}, allocation {allocation_id} to {user!r}"
    if job.name not in frozenset(names):
        return f"job {job_id} is named {job.name!r}, not one of gpuhub's"
    if job.allocation_id != allocation_id:
        tag = f"allocation {job.allocation_id}" if job.allocation_id else "no gpuhub allocation"
        return f"job {job_id}'s comment names {tag}, not allocation {allocation_id}"
    if job.ended:
        return f"job {job_id} ended already ({job.state.lower()})"
    return None


def scancel_argv(prefix: list[str], job: JobInfo) -> list[str]:
    """``scancel`` of one job, run through ``prefix`` (``sudo -E -u OWNER``: Slurm itself
    refuses another user's job) and filtered by the job's owner and name as well (scancel
    signals only jobs that match every filter)."""
    return [*prefix, "scancel", f"--user={job.user}", f"--name={job.name}", str(job.job_id)]


def job_time(seconds: float | None, runtime: str = "") -> str:
    """A job's ``--time`` (pure): gpuhub's time limit in whole minutes, rounded up (Slurm's
    own unit), which is the job's end; without one, the admin's ``req_runtime`` as written."""
    if seconds is None:
        return runtime
    return str(max(1, math.ceil(seconds / 60 - 1e-9)))


def time_limit_argv(job_id: str, seconds: float) -> list[str]:
    """``scontrol update`` of a job's TimeLimit to gpuhub's (extended) time limit, in whole
    minutes as ``job_time``; only Slurm's operators and admins (the hub) may raise it."""
    return ["scontrol", "update", f"JobId={job_id}", f"TimeLimit={job_time(seconds)}"]
