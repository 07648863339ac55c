"""What Slurm prints, parsed; what gpuhub asks Slurm, as argument lists. No I/O here.

Formats relied on (Slurm 22.05 and later):

- ``sinfo -h -N -o '%N|%G|%P|%T'``: one line per node and partition, e.g.
  ``gpu-node1|gpu:a100:4(S:0)|gpu*|idle`` (``*`` marks the default partition).
- ``squeue -h -a -t all -o '%i|%T|%r|%N|%u|%j|%S|%k'``: one line per job, e.g.
  ``12|PENDING|Resources||alice|gpuhub-server|N/A|gpuhub:7`` (``%k``: the comment, where
  gpuhub tags each job with its allocation; last, since it is the user's own text).
- ``squeue --json``: a job's ``nodes`` and ``gres_detail`` (``gpu:a100:2(IDX:2-3)`` per
  node): ``IDX`` holds the node's own GPU indices, whatever ``CUDA_VISIBLE_DEVICES`` says
  inside the job (it is renumbered under device cgroups). Read as JSON, never from
  ``scontrol -d show job``'s text, where a comment with a newline can imitate a GRES line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass

from ..policy import Gpu

SQUEUE_FORMAT = "%i|%T|%r|%N|%u|%j|%S|%k"  # the comment (user text) last
SINFO_FORMAT = "%N|%G|%P|%T"
# waiting for resources (or held): no GPUs yet
TAG = re.compile(r"gpuhub:([1-9][0-9]{0,17})", re.ASCII)
JOB_LINE = re.compile(r"[0-9]{1,18}\|[A-Z_]+(?: by [0-9]+)?\|", re.ASCII)

PENDING_STATES = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
     "POWER_UP_NODE"}
)  # fmt: skip
# holding its nodes and GPUs (a suspended or stopped job keeps them)
RUNNING_STATES = frozenset(
    {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "SUSPENDED", "STOPPED", "RESIZING"}
)


class SlurmError(RuntimeError):
    """A Slurm command failed or printed something gpuhub cannot read."""


def expand_hostlist(expr: str) -> list[str]:
    """``gpu-node[1-2,4],login01`` to its host names (Slurm's hostlist syntax, zero padding kept)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", expr.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                for rest in expand_hostlist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{n:0{width}d}{rest}")
    return hosts


def parse_index_list(text: str) -> list[int]:
    """``0-1,3`` to ``[0, 1, 3]``."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, _, hi = item.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


# nodes and GPUs --------------------------------------------------------------------------


@dataclass(frozen=True)
class GresEntry:
    type: str | None  # "a100", or None for untyped GPUs
    count: int


def parse_gres(text: str) -> list[GresEntry]:
    """The GPU entries of a node's GRES string: ``gpu:a100:4(S:0),gpu:2`` -> entries in order."""
    out = []
    for item in re.split(r",(?![^(]*\))", text or ""):
        item = re.sub(r"\(.*\)$", "", item.strip())
        fields = item.split(":")
        if fields[0] != "gpu" or len(fields) < 2:
            continue
        count = fields[-1]
        if not count.isdigit():
            continue
        out.append(GresEntry(fields[1] if len(fields) == 3 else None, int(count)))
    return out


@dataclass(frozen=True)
class SlurmNode:
    name: str
    gres: tuple[GresEntry, ...]
    partitions: tuple[str, ...]
    state: str

    def gpus(self, untyped_model: str = "GPU") -> list[Gpu]:
        """The node's GPUs, indexed as Slurm indexes them (gres.conf order, from 0)."""
        out, index = [], 0
        for entry in self.gres:
            for _ in range(entry.count):
                out.append(Gpu(self.name, index, entry.type or untyped_model))
                index += 1
        return out


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[SlurmNode, ...]
    partitions: tuple[str, ...]  # the default partition first, then by name
    default_partition: str | None

    def partition_nodes(self, partition: str) -> set[str]:
        return {n.name for n in self.nodes if partition in n.partitions}

    def inventory(self, untyped_model: str = "GPU") -> list[Gpu]:
        return [g for n in self.nodes for g in n.gpus(untyped_model)]


def parse_sinfo(text: str) -> Cluster:
    nodes: dict[str, dict] = {}
    partitions: list[str] = []
    default = None
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 4:
            raise SlurmError(f"unexpected sinfo line: {line!r}")
        name, gres, partition, state = (f.strip() for f in fields)
        if partition.endswith("*"):
            partition = partition[:-1]
            default = partition
        if partition not in partitions:
            partitions.append(partition)
        node = nodes.setdefault(name, {"gres": tuple(parse_gres(gres)), "partitions": [], "state": state})
        node["partitions"].append(partition)
    return Cluster(
        nodes=tuple(
            SlurmNode(name, d["gres"], tuple(d["partitions"]), d["state"].rstrip("*~#$@+^-"))
            for name, d in sorted(nodes.items())
        ),
        partitions=tuple(sorted(partitions, key=lambda p: (p != default, p))),
        default_partition=default,
    )


# jobs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # Slurm's long state: PENDING, RUNNING, COMPLETED, CANCELLED, ...
    reason: str = ""
    nodes: tuple[str, ...] = ()
    user: str = ""
    name: str = ""
    start_time: str = ""  # expected start of a pending job, when Slurm knows it
    comment: str = ""

    @property
    def allocation_id(self) -> int | None:
        """The ledger allocation gpuhub tagged the job with (``--comment=gpuhub:ID``)."""
        m = TAG.fullmatch(self.comment.strip())
        return int(m.group(1)) if m else None

    @property
    def pending(self) -> bool:
        return self.state in PENDING_STATES

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    @property
    def ended(self) -> bool:
        return not (self.pending or self.running)

    def describe(self, position: tuple[int, int, str] | None = None) -> str:
        """For the spawn page: ``Queued in Slurm as job 12 (Resources), 2nd of 3 waiting in
        partition gpu, expected start 2026-11-29T18:00:00``."""
        if self.pending:
            reason = self.reason if self.reason and self.reason != "None" else "waiting"
            text = f"Queued in Slurm as job {self.job_id} ({reason})"
            if position is not None:
                n, of, partition = position
                text += f", {_ordinal(n)} of {of} waiting in partition {partition}"
            if self.start_time and self.start_time not in ("N/A", "Unknown"):
                text += f", expected start {self.start_time}"
            return text
        if self.running:
            return f"Slurm job {self.job_id} running on {', '.join(self.nodes)}"
        return f"Slurm job {self.job_id} ended ({self.state.lower()})"


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


PENDING_FORMAT = "%i|%P|%Q"


def pending_argv() -> list[str]:
    """Every pending job of the cluster (any user), with its partition and priority."""
    return ["squeue", "-h", "-a", "-t", "PENDING", "-o", PENDING_FORMAT]


def queue_positions(text: str, wanted) -> dict[str, tuple[int, int, str]]:
    """Where each ``wanted`` pending job stands in its partition: (position, of, partition),
    by Slurm's priority (higher first, then older). The order the scheduler starts jobs in
    may differ (backfill), so this is what Slurm's priorities say, not a promise."""
    by_partition: dict[str, list[tuple[int, int, str]]] = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        job_id, partitions, priority = fields
        prio = int(priority) if priority.isdigit() else 0
        for partition in partitions.split(","):  # a job may wait in several partitions
            by_partition.setdefault(partition, []).append((-prio, int(job_id), job_id))
    out = {}
    for partition, queue in by_partition.items():
        queue.sort()
        for i, (_, _, job_id) in enumerate(queue):
            if job_id in wanted and job_id not in out:
                out[job_id] = (i + 1, len(queue), partition)
    return out


def parse_squeue(text: str) -> dict[str, JobInfo]:
    """Jobs by id. A comment is the user's own text: lines that are not job lines (a comment
    with a newline) are skipped, and an answer naming a job twice (a forged line) is refused
    with :class:`SlurmError` rather than trusted."""
    jobs: dict[str, JobInfo] = {}
    for line in text.splitlines():
        if not JOB_LINE.match(line):
            continue
        fields = line.split("|", 7)
        if len(fields) < 8:
            continue
        job_id, state, reason, nodes, user, name, start = (f.strip() for f in fields[:7])
        if job_id in jobs:
            raise SlurmError(f"squeue named job {job_id} twice (a job comment imitating a job line?)")
        comment = fields[7].strip()
        jobs[job_id] = JobInfo(
            job_id=job_id,
            state=state.split()[0] if state else "UNKNOWN",
            reason=reason,
            nodes=tuple(expand_hostlist(nodes)) if nodes and nodes != "(null)" else (),
            user=user,
            name=name,
            start_time=start,
            comment="" if comment == "(null)" else comment,
        )
    return jobs


_GRES_IDX = re.compile(r"gpu(?::[^:(,\s]+)*:\d+\(IDX:([0-9,\-]+)\)", re.ASCII)


def parse_job_gpus_json(text: str, job_id: str) -> list[tuple[str, int]]:
    """Job ``job_id``'s GPUs as (node, node-local index), from ``squeue --json``.

    Slurm's JSON gives ``nodes`` (a hostlist) and ``gres_detail``, one ``gpu:a100:2(IDX:0-1)``
    per node in the hostlist's order. No field is split out of free text, so a comment or a
    name holding a newline and an imitation of scontrol's ``Nodes=... GRES=...(IDX:k)`` lines
    cannot add another user's GPU. A job that is absent, or whose two fields do not line up,
    is a :class:`SlurmError`: the caller keeps what it knew."""
    try:
        listing = json.loads(text)
        found = [j for j in listing["jobs"] if str(j.get("job_id")) == str(job_id)]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SlurmError(f"squeue --json printed what gpuhub cannot read ({e})") from None
    if len(found) != 1:
        raise SlurmError(f"squeue --json lists job {job_id} {len(found)} times")
    job = found[0]
    nodes_expr, detail = job.get("nodes") or "", job.get("gres_detail") or []
    if not isinstance(nodes_expr, str) or not isinstance(detail, list):
        raise SlurmError(f"squeue --json: job {job_id} has no readable nodes and GRES")
    nodes = expand_hostlist(nodes_expr) if nodes_expr else []
    if detail and len(detail) != len(nodes):
        raise SlurmError(f"squeue --json: job {job_id} has {len(detail)} GRES entries for {len(nodes)} nodes")
    out: list[tuple[str, int]] = []
    for node, gres in zip(nodes, detail, strict=False):
        for idx in _GRES_IDX.findall(str(gres)):
            out.extend((node, i) for i in parse_index_list(idx))
    return sorted(set(out))


def gres_request(count: int, model: str | None) -> str:
    """``--gres`` value: ``gpu:a100:2``, or ``gpu:2`` for any type."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"a GPU job needs a count of 1 or more; got {count!r}")
    if model is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", model):
        raise ValueError(f"not a Slurm GPU type: {model!r}")
    return f"gpu:{model}:{count}" if model else f"gpu:{count}"


# commands -------------------------------------------------------------------------------


def squeue_argv(names: Iterable[str]) -> list[str]:
    """Every gpuhub job in one call (recently ended ones too, for their final state)."""
    return ["squeue", "-h", "-a", "-t", "all", "--name", ",".join(sorted(names)), "-o", SQUEUE_FORMAT]


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
