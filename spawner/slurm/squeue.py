"""What ``squeue`` prints, parsed: gpuhub's jobs (:class:`Listing`) and where each
waits in Slurm's queue (:func:`queue_positions`). No I/O here.

Formats relied on (Slurm 22.05 and later):

- ``squeue --json``: every job slurmctld knows (22.05 ignores ``-j``, ``--name`` and ``-t``
  with ``--json``: gpuhub filters by job name itself). Per job: ``job_id``, ``job_state``,
  ``user_name``, ``name``, ``comment`` (where gpuhub tags each job with its allocation,
  ``gpuhub:ID``), ``nodes`` (a hostlist), ``start_time`` (epoch), ``state_reason`` and
  ``gres_detail`` (``gpu:a100:2(IDX:2-3)`` per node, in the hostlist's order): ``IDX`` holds
  the node's own GPU indices, whatever ``CUDA_VISIBLE_DEVICES`` says inside the job (it is
  renumbered under device cgroups). A job's name and comment are its user's own text, and a
  comment may hold a newline: as JSON no field is ever split out of them. When slurmctld
  does not answer, 22.05 still exits 0 and prints ``errors`` with no jobs: that is a failure,
  never "every job is gone".
- Only where ``squeue`` has no ``--json`` (before 21.08): ``squeue -h -a -t all`` with a
  format of ``%i %T %r %N %u %j %S %k`` whose record marker and separators hold a random
  token made for that one query (passed in ``SQUEUE_FORMAT``, so not on a command line that
  other users can read). A job whose text holds a newline or the token is refused (logged and
  skipped), never split into more records.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from spawner.slurm import SlurmError
from spawner.slurm.sinfo import expand_hostlist, parse_index_list

TAG = re.compile(r"gpuhub:([1-9][0-9]{0,17})", re.ASCII)
# waiting for resources (or held): no GPUs yet
PENDING_STATES = frozenset(
    {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
     "POWER_UP_NODE"}
)  # fmt: skip
# holding its nodes and GPUs (a suspended or stopped job keeps them)
RUNNING_STATES = frozenset(
    {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING", "SUSPENDED", "STOPPED", "RESIZING"}
)


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
    gpus: tuple[tuple[str, int], ...] = ()  # (node, node-local index), from gres_detail
    priority: int = 0  # Slurm's priority (multifactor: fair share, age), JSON only
    partition: str = ""  # the partition(s) it runs or waits in, "gpu" or "gpu,interactive"
    expected: datetime | None = None  # a pending job's expected start (naive UTC), JSON only

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


@dataclass(frozen=True)
class QueuedJob:
    """A job of anyone's waiting in Slurm's queue, as positions need it (from JSON only)."""

    job_id: str
    partitions: tuple[str, ...]
    priority: int


def queue_positions(queue: Iterable[QueuedJob], wanted: Iterable[str]) -> dict[str, tuple[int, int, str]]:
    """Where each ``wanted`` pending job stands among the jobs waiting for the same
    partition: (position, of, partition), by Slurm's priority (higher first, then the older
    job id, as Slurm's scheduler sorts). A job waiting in several partitions is placed in
    the first it names. Held jobs (priority 0) compete for nothing and are not counted.
    Backfill may start a smaller job earlier, so this is Slurm's order, not a promise."""
    wanted = {str(j) for j in wanted}
    queue = [q for q in queue if q.priority > 0]
    out = {}
    for job in queue:
        if job.job_id not in wanted or not job.partitions:
            continue
        partition = job.partitions[0]
        rivals = sorted((-q.priority, int(q.job_id), q.job_id) for q in queue if partition in q.partitions)
        place = [j for _, _, j in rivals].index(job.job_id)
        out[job.job_id] = (place + 1, len(rivals), partition)
    return out


_GRES_IDX = re.compile(r"(?:gpu|shard)(?::[^:(,\s]+)*:\d+\(IDX:([0-9,\-]+)\)", re.ASCII)
_STATE = re.compile(r"[A-Z][A-Z_]{0,39}", re.ASCII)
_JOB_ID = re.compile(r"[1-9][0-9]{0,17}", re.ASCII)
_NODES = re.compile(r"[A-Za-z0-9_.\-\[\],]{0,4096}", re.ASCII)
_PARTITION = re.compile(r"[A-Za-z0-9_.\-]{1,200}", re.ASCII)


def _job_gpus(job_id: str, nodes: list[str], detail) -> tuple[tuple[str, int], ...]:
    """(node, index) pairs of one job: ``gres_detail``'s entry k belongs to the job's k-th
    node, so an index is only ever on one of the job's own nodes."""
    if not isinstance(detail, list) or not all(isinstance(d, str) for d in detail):
        raise SlurmError(f"squeue --json: job {job_id} has no readable nodes and GRES")
    if detail and len(detail) != len(nodes):
        raise SlurmError(f"squeue --json: job {job_id} has {len(detail)} GRES entries for {len(nodes)} nodes")
    out: set[tuple[str, int]] = set()
    for node, gres in zip(nodes, detail, strict=False):
        for idx in _GRES_IDX.findall(gres):
            out.update((node, i) for i in parse_index_list(idx))
    return tuple(sorted(out))


def _hostlist(job_id: str, expr) -> list[str]:
    if expr is None:
        return []
    if not isinstance(expr, str) or not _NODES.fullmatch(expr):
        raise SlurmError(f"squeue --json: job {job_id} has no readable nodes and GRES")
    try:
        return expand_hostlist(expr) if expr else []
    except ValueError:
        raise SlurmError(f"squeue --json: job {job_id} has nodes gpuhub cannot read: {expr[:80]!r}") from None


def _json_jobs(text: str) -> list:
    """The ``jobs`` list of an ``squeue --json`` answer; :class:`SlurmError` for an answer
    that is not one, or that carries Slurm's ``errors`` (slurmctld down: no jobs, exit 0)."""
    try:
        listing = json.loads(text)
    except ValueError as e:
        raise SlurmError(f"squeue --json printed what gpuhub cannot read ({e})") from None
    if not isinstance(listing, dict) or not isinstance(listing.get("jobs"), list):
        raise SlurmError("squeue --json printed what gpuhub cannot read (no list of jobs)")
    errors = listing.get("errors") or []
    if errors:
        first = errors[0] if isinstance(errors, list) else errors
        what = first.get("description") or first.get("error") if isinstance(first, dict) else first
        raise SlurmError(f"squeue --json reports an error: {str(what)[:200]}")
    return listing["jobs"]


def parse_job_gpus_json(text: str, job_id: str) -> list[tuple[str, int]]:
    """Job ``job_id``'s GPUs as (node, node-local index), from ``squeue --json``.

    Slurm's JSON gives ``nodes`` (a hostlist) and ``gres_detail``, one ``gpu:a100:2(IDX:0-1)``
    per node in the hostlist's order. No field is split out of free text, so a comment or a
    name holding a newline and an imitation of scontrol's ``Nodes=... GRES=...(IDX:k)`` lines
    cannot add another user's GPU. A job that is absent, or whose two fields do not line up,
    is a :class:`SlurmError`: the caller keeps what it knew."""
    found = [j for j in _json_jobs(text) if isinstance(j, dict) and str(j.get("job_id")) == str(job_id)]
    if len(found) != 1:
        raise SlurmError(f"squeue --json lists job {job_id} {len(found)} times")
    job = found[0]
    nodes_expr, detail = job.get("nodes") or "", job.get("gres_detail") or []
    if not isinstance(nodes_expr, str):
        raise SlurmError(f"squeue --json: job {job_id} has no readable nodes and GRES")
    return list(_job_gpus(str(job_id), _hostlist(str(job_id), nodes_expr), detail))


@dataclass(frozen=True)
class Listing:
    """gpuhub's jobs in one answer of Slurm's. ``unreadable``: ids of jobs that were listed
    but refused (a field missing or odd, an id twice, text that could fake a record): their
    last known state stands, nothing is decided about them. ``problems``: why, for the log."""

    jobs: dict[str, JobInfo]
    unreadable: frozenset[str] = frozenset()
    problems: tuple[str, ...] = ()
    # every job of the cluster (any user, any name) waiting in Slurm's queue: JSON only
    queue: tuple[QueuedJob, ...] = ()


def _text(raw, what: str, job_id: str, *, empty: bool = True) -> str:
    if raw is None and empty:
        return ""
    if not isinstance(raw, str) or (not empty and not raw):
        raise SlurmError(f"job {job_id}: no readable {what} ({type(raw).__name__})")
    return raw


def _start_time(raw, job_id: str) -> str:
    """Epoch seconds (22.05) or ``{"set": .., "number": ..}`` (23.02 and later) to the local
    ``2026-11-29T18:00:00`` squeue prints; "" while unknown (0)."""
    if isinstance(raw, dict):
        raw = raw.get("number") if raw.get("set", True) and not raw.get("infinite") else 0
    if raw is None:
        return ""
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise SlurmError(f"job {job_id}: no readable start_time ({type(raw).__name__})")
    if raw <= 0:
        return ""
    try:
        return datetime.fromtimestamp(raw).strftime("%Y-%m-%dT%H:%M:%S")
    except (OverflowError, OSError, ValueError):
        return ""


def _number(raw, what: str, job_id: str) -> int:
    """An integer of ``squeue --json``: plain (22.05) or ``{"set", "infinite", "number"}``
    (23.02 and later); 0 when unset."""
    if isinstance(raw, dict):
        raw = raw.get("number", 0) if raw.get("set", True) and not raw.get("infinite") else 0
    if raw is None:
        return 0
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        raise SlurmError(f"job {job_id}: no readable {what} ({str(raw)[:40]!r})")
    return raw


def epoch_utc(seconds: int) -> datetime | None:
    """Epoch seconds to a naive-UTC time; None for 0 (Slurm: not known yet) or nonsense."""
    if seconds <= 0:
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC).replace(tzinfo=None)
    except (OverflowError, OSError, ValueError):
        return None


def _partitions(raw, job_id: str) -> tuple[str, ...]:
    text = _text(raw, "partition", job_id)
    parts = tuple(p for p in text.split(",") if p)
    if any(not _PARTITION.fullmatch(p) for p in parts):
        raise SlurmError(f"job {job_id}: no readable partition ({text[:40]!r})")
    return parts


def _state(raw, job_id: str) -> str:
    if isinstance(raw, list) and raw:  # 23.02 and later: ["RUNNING", "COMPLETING", ...], base first
        raw = raw[0]
    state = raw.split()[0] if isinstance(raw, str) and raw.strip() else None
    if state is None or not _STATE.fullmatch(state):
        raise SlurmError(f"job {job_id}: no readable job_state ({str(raw)[:40]!r})")
    return state


def job_from_json(raw: dict, job_id: str) -> JobInfo:
    """One job of ``squeue --json``; :class:`SlurmError` when a field is missing or odd."""
    user = _text(raw.get("user_name"), "user_name", job_id, empty=False)
    if any(ch.isspace() or not ch.isprintable() for ch in user):
        raise SlurmError(f"job {job_id}: no readable user_name ({user[:40]!r})")
    nodes = _hostlist(job_id, raw.get("nodes"))
    state = _state(raw.get("job_state"), job_id)
    return JobInfo(
        job_id=job_id,
        state=state,
        reason=_text(raw.get("state_reason"), "state_reason", job_id),
        nodes=tuple(nodes),
        user=user,
        name=_text(raw.get("name"), "name", job_id, empty=False),
        start_time=_start_time(raw.get("start_time"), job_id),
        comment=_text(raw.get("comment"), "comment", job_id),
        gpus=_job_gpus(job_id, nodes, raw.get("gres_detail") or []),
        priority=_number(raw.get("priority"), "priority", job_id),
        partition=",".join(_partitions(raw.get("partition"), job_id)),
        expected=(
            epoch_utc(_number(raw.get("start_time"), "start_time", job_id)) if state == "PENDING" else None
        ),
    )


def queued_from_json(raw: dict, job_id: str) -> QueuedJob | None:
    """A job waiting in Slurm's queue (``PENDING``), any user's; None for one that is not.
    :class:`SlurmError` for one whose fields cannot be read."""
    if _state(raw.get("job_state"), job_id) != "PENDING":
        return None
    return QueuedJob(
        job_id, _partitions(raw.get("partition"), job_id), _number(raw.get("priority"), "priority", job_id)
    )


def _json_job_id(raw) -> str | None:
    if not isinstance(raw, dict):
        return None
    job_id = raw.get("job_id")
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not _JOB_ID.fullmatch(str(job_id)):
        return None
    return str(job_id)


def parse_squeue_json(text: str, names: Iterable[str]) -> Listing:
    """gpuhub's jobs (``names``) from ``squeue --json``. An answer that is not a job list, or
    that reports an error, is a :class:`SlurmError` (the caller keeps what it knew); one job
    that gpuhub cannot read is logged and skipped (``Listing.unreadable``), never fatal."""
    names = frozenset(names)
    found: dict[str, JobInfo] = {}
    unreadable: set[str] = set()
    problems: list[str] = []
    seen: set[str] = set()
    queue: dict[str, QueuedJob | None] = {}  # None: listed twice or unreadable (not counted)
    for n, raw in enumerate(_json_jobs(text)):
        job_id = _json_job_id(raw)
        if job_id is None:
            problems.append(f"squeue --json: entry {n} has no readable job_id; skipped")
            continue
        try:
            queued = queued_from_json(raw, job_id)
        except SlurmError:
            queued = None  # another user's odd job: not counted (a gpuhub job is logged below)
        if queued is not None or job_id in queue:
            queue[job_id] = None if job_id in queue else queued
        name = raw.get("name")
        if isinstance(name, str) and name not in names:
            continue  # not gpuhub's
        if job_id in seen:
            problems.append(f"squeue --json lists job {job_id} twice; both skipped")
            found.pop(job_id, None)
            unreadable.add(job_id)
            continue
        seen.add(job_id)
        try:
            found[job_id] = job_from_json(raw, job_id)
        except SlurmError as e:
            problems.append(f"squeue --json: {e}; skipped")
            unreadable.add(job_id)
    waiting = tuple(q for q in queue.values() if q is not None)
    return Listing(found, frozenset(unreadable), tuple(problems), waiting)


def json_unsupported(error: str) -> bool:
    """Whether a failed ``squeue --json`` says this Slurm has no JSON output (an older
    squeue's usage error, or no JSON plugin), rather than that slurmctld is not answering."""
    return bool(
        re.search(
            r"unrecognized option|invalid option|unknown option|serializer|data_parser|plugin", error, re.I
        )
    )


# text fallback: one query's own token marks records and separates fields ------------------

TEXT_FIELDS = ("%i", "%T", "%r", "%N", "%u", "%j", "%S", "%k")  # the comment (user text) last


@dataclass(frozen=True)
class TextFormat:
    token: str  # random, for one query

    @classmethod
    def new(cls) -> TextFormat:
        return cls(secrets.token_hex(16))

    @property
    def record(self) -> str:
        return f"@R{self.token}@"

    @property
    def sep(self) -> str:
        return f"@S{self.token}@"

    @property
    def end(self) -> str:
        return f"@E{self.token}@"

    @property
    def format(self) -> str:
        return self.record + self.sep.join(TEXT_FIELDS) + self.end


def parse_squeue_text(text: str, fmt: TextFormat, names: Iterable[str]) -> Listing:
    """gpuhub's jobs from the text fallback. A record is ``RECORD f1 SEP f2 ... SEP f8 END``;
    a record that does not have exactly that shape, or whose fields hold a newline, a ``|``
    or the token, is refused: its job id (when readable) goes to ``Listing.unreadable``."""
    names = frozenset(names)
    found: dict[str, JobInfo] = {}
    unreadable: set[str] = set()
    problems: list[str] = []
    chunks = text.split(fmt.record)
    if chunks[0].strip():
        problems.append(f"squeue printed text before its first job: {chunks[0][:80]!r}; ignored")
    for chunk in chunks[1:]:
        body, ended, rest = chunk.partition(fmt.end)
        fields = body.split(fmt.sep)
        job_id = fields[0] if _JOB_ID.fullmatch(fields[0]) else None
        bad = None
        if not ended or rest.strip() or len(fields) != len(TEXT_FIELDS):
            bad = "is not one record"
        elif any(bad in f for f in fields for bad in ("\n", "\r", "|", fmt.token)):
            bad = "holds a newline, a '|' or the record marker (a comment imitating a job?)"
        elif job_id is None:
            bad = "has no readable job id"
        if bad is not None:
            problems.append(f"squeue: job {job_id or '?'} {bad}; skipped")
            if job_id is not None:
                unreadable.add(job_id)
            continue
        _, state, reason, nodes, user, name, start, comment = (f.strip() for f in fields)
        if name not in names:
            continue
        if job_id in found or job_id in unreadable:
            problems.append(f"squeue lists job {job_id} twice; both skipped")
            found.pop(job_id, None)
            unreadable.add(job_id)
            continue
        try:
            info = JobInfo(
                job_id=job_id,
                state=_state(state, job_id),
                reason=reason,
                nodes=tuple(_hostlist(job_id, "" if nodes == "(null)" else nodes)),
                user=_text(user, "user", job_id, empty=False),
                name=name,
                start_time="" if start in ("N/A", "Unknown") else start,
                comment="" if comment == "(null)" else comment,
            )
        except SlurmError as e:
            problems.append(f"squeue: {e}; skipped")
            unreadable.add(job_id)
            continue
        found[job_id] = info
    return Listing(found, frozenset(unreadable), tuple(problems))
