"""The frozen records the ledger answers with, and the one request it is asked to admit.

Plain values, with nothing of the database in them: what a spawner, the broker's pages, the
watcher and the CLI read (an allocation, a user's allowance, a queue entry, a notice), so
that code which only shows or decides on them imports no SQL. ``spawner.ledger`` writes them
from its rows; :class:`AllocationRequest` is what its admission passes along.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from fractions import Fraction

from spawner.policy import fairshare, waitline
from spawner.policy.limits import EffectiveLimit, Limit
from spawner.policy.placement import Gpu

ACTIVE_STATES = ("starting", "running")  # an allocation in one of these holds (or will hold) GPUs


@dataclass(frozen=True)
class AllocationRequest:
    """One request for GPUs, as ``Ledger.allocate`` and ``Ledger.request`` take it: built once
    from their keywords and passed along the admission path.

    ``wait``: a request that fits the limit but not the free GPUs joins the queue (``request``)
    rather than being refused (``allocate``). ``deferred``: the backend's scheduler picks the
    GPUs (Slurm); the request holds its count until they are written."""

    user: str
    groups: tuple[str, ...]
    count: int
    purpose: str = "server"
    server_name: str = ""
    model: str | None = None
    max_nodes: int | None = 1
    gpus_per_node: int | None = None
    backend: str = "local"
    lease_seconds: float | None = None
    on_nodes: frozenset[str] | None = None
    deferred: bool = False
    wait: bool = False
    of_server: bool = False  # a burst of server ``server_name``'s kernels: released at its stop
    hours: float | None = None  # the length it asks for (None: the user's longest session)
    time_limit_seconds: float | None = None  # what the admission granted (from ``hours``)
    slice_parts: int | None = None  # one slice of a GPU split in this many parts (None: whole GPUs)

    @property
    def units(self) -> Fraction:
        """What it asks for, in GPUs: its count, or its slice's share of one GPU."""
        return Fraction(self.count, self.slice_parts or 1)


@dataclass(frozen=True)
class AllocationInfo:
    id: int
    user: str
    purpose: str
    server_name: str
    state: str
    created: datetime
    started: datetime | None
    ended: datetime | None
    backend: str
    backend_job_id: str | None
    end_reason: str | None
    gpus: tuple[Gpu, ...]
    lease_expires: datetime | None = None
    gpu_count: int = 0  # GPUs asked for (a queued Slurm job holds its count, not yet GPUs)
    idle_deadline: datetime | None = None  # reclaimed then unless used (its owner was warned)
    borrowed: int = 0  # GPUs of it beyond the limit (lent while idle; may be taken back)
    preempt_due: datetime | None = None  # taken back then (the owner was given notice)
    preempt_reason: str | None = None
    withdrawn: datetime | None = None  # a notice it had was withdrawn then (nobody waits for it)
    withdrawn_reason: str | None = None
    backfill: bool = False  # it started ahead of a reservation that still waits: may be taken back
    of_server: bool = False  # a burst of server ``server_name``'s kernels: released at its stop
    time_limit_seconds: float | None = None  # how long it may run from its start (None: no limit)
    slice_parts: int | None = None  # slices of GPUs split in this many parts (None: whole GPUs)

    @property
    def units(self) -> Fraction:
        """What it counts as against a limit and in GPU-hours, in GPUs (a 1/4 slice: 1/4)."""
        return Fraction(self.gpu_count, self.slice_parts or 1)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def time_ends(self) -> datetime | None:
        """When its time limit runs out (from its start; from its creation until then)."""
        if self.time_limit_seconds is None:
            return None
        return (self.started or self.created) + timedelta(seconds=self.time_limit_seconds)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({g.node for g in self.gpus}))

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g.index) for g in self.gpus)


@dataclass(frozen=True)
class Allowance:
    """What a user holds, may take, and what is free: the facts behind the spawn form."""

    effective: EffectiveLimit
    held: int
    gpu_hours: float
    may_take: int | None  # more GPUs the limit allows; None = unlimited
    total: int
    free: int
    free_by_model: dict[str, int] = field(default_factory=dict)
    fits: int = 0  # what one request on one server could get now
    borrow_allowance: int = 0  # GPUs the user may hold beyond the limit (c.GpuHub.*_borrow)
    borrowed: int = 0  # of those held, how many are borrowed
    waiting: int = 0  # requests waiting in the queue now (borrowing needs none)
    may_borrow_now: int = 0  # more GPUs a request could borrow right now (free, nobody waits)


@dataclass(frozen=True)
class GpuStatus:
    gpu: Gpu
    present: bool
    holder: AllocationInfo | None  # the whole GPU's (None where it is free or held in slices)
    # a GPU held in slices: each slice held (a Gpu with its part) and its holder, by part
    slices: tuple[tuple[Gpu, AllocationInfo], ...] = ()

    def mine(self, user: str) -> GpuStatus | None:
        """What ``user`` may see of it: the GPU with only their own holdings (None: none)."""
        own = tuple((g, h) for g, h in self.slices if h.user == user)
        if self.holder is not None and self.holder.user == user:
            return replace(self, slices=())
        return replace(self, holder=None, slices=own) if own else None


@dataclass(frozen=True)
class LimitEntry:
    scope: str
    name: str
    limit: Limit
    origin: str  # "config" or "ledger"


@dataclass(frozen=True)
class QueueInfo:
    """One queue entry as its user and the admins see it."""

    id: int
    user: str
    purpose: str
    server_name: str
    gpu_count: int
    model: str | None
    state: str
    created: datetime
    seen: datetime
    front: datetime | None
    ended: datetime | None
    end_reason: str | None
    allocation_id: int | None
    position: int = 0  # 1-based among those waiting; 0 once it no longer waits
    waiting: int = 0  # how many wait in all
    expected: datetime | None = None
    sure: str = "unknown"
    factors: fairshare.Factors | None = None
    slice_parts: int | None = None  # one slice of a GPU split in this many parts

    @property
    def amount(self) -> int | str:
        """What it waits for: a count of GPUs, or a slice as ``1/4 GPU``."""
        return f"1/{self.slice_parts} GPU" if self.slice_parts else self.gpu_count

    def line(self, now: datetime) -> str:
        return waitline.wait_line(self.position, self.waiting, self.amount, self.expected, self.sure, now)


@dataclass(frozen=True)
class Admission:
    """What a request got: an allocation now, or a place in the queue (exactly one)."""

    allocation: AllocationInfo | None = None
    entry: QueueInfo | None = None


@dataclass(frozen=True)
class PreemptionInfo:
    id: int
    allocation_id: int
    user: str
    purpose: str
    server_name: str
    gpus: int
    borrowed: int
    for_user: str
    entry_id: int | None
    reason: str
    created: datetime
    due: datetime
    withdrawn: datetime | None = None  # the notice was withdrawn then: nobody waits for it now
    withdrawn_reason: str | None = None


@dataclass(frozen=True)
class PreemptionNotice:
    """A preemption its owner is told about: pending (its allocation still lives; it ends at
    ``preemption.due``) or done (``ended``: when the allocation ended)."""

    preemption: PreemptionInfo
    ended: datetime | None  # None: the allocation still lives (the notice's grace runs)
    end_reason: str | None = None

    @property
    def pending(self) -> bool:
        return self.ended is None and self.preemption.withdrawn is None

    @property
    def withdrawn(self) -> bool:
        """The notice was withdrawn (the request it was for no longer waits): nothing is taken."""
        return self.preemption.withdrawn is not None


@dataclass
class Settled:
    """What one pass of ``Ledger.settle_preemptions`` did: notices withdrawn, bursts ended at
    their due time, servers due (filled in as the pass goes: not frozen)."""

    withdrawn: list[PreemptionInfo] = field(default_factory=list)
    ended: list[PreemptionInfo] = field(default_factory=list)  # released in the ledger
    servers: list[PreemptionInfo] = field(default_factory=list)  # due: the broker stops them


@dataclass(frozen=True)
class ReclaimInfo:
    id: int
    allocation_id: int
    user: str
    purpose: str
    server_name: str
    gpus: int
    idle_seconds: float
    gpu_hours: float
    reason: str
    created: datetime


@dataclass(frozen=True)
class ExtensionInfo:
    """One extension of an allocation's time limit: who asked (``by``: its user or an admin),
    when, by how much, and the limit before and after it."""

    id: int
    allocation_id: int
    user: str
    by: str
    at: datetime
    seconds: float
    before_seconds: float
    after_seconds: float


class GpuConflict(RuntimeError):
    """A scheduler gave a GPU (or a part of one) that a live job of its own still holds
    (``Ledger.record_gpus``): nothing was written."""
