"""Who among the waiting starts now, and when the others may: the queue's schedule (pure).

Input: the waiting requests in the queue's order (:func:`spawner.policy.fairshare.order`), the
GPUs free now, and what is held with when it is expected to end. The plan walks the order
and gives each request the earliest time its GPUs are free, reserving them from then on
for as long as it is expected to run (conservative backfill, as Slurm's backfill
scheduler does with reservations): a request further back starts *now* only on GPUs that
no request ahead of it needs before it would be done, so backfill never delays anyone
ahead. The head always starts the moment its GPUs are free. Nothing yet ends a run at a
time limit, so a grant ahead of a reservation is only as sure as its user's run lengths:
the plan names the reservations each such grant went ahead of (``Plan.ahead_of``), and the
ledger may take it back for them, with notice, at their turn.

Ends are expectations, each with how sure it is, the best known used first:

- ``firm``: a notice's due time (a preemption), an idle reclaim under way or due;
- ``limit``: a time limit's end (``c.GpuHub.*_max_hours``): it ends then at the latest;
- ``guess``: from the user's recent run lengths (:func:`typical_run_hours`);
- ``default``: ``queue_default_run_hours``, for a user with no finished run yet: planned with,
  but said as not known ("cannot tell yet");
- ``None`` end: nothing known (the plan treats it as never, and says so).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpu_magics.common import words
from spawner import policy

SURENESS = ("now", "firm", "limit", "guess", "default", "unknown")  # best to worst
OVERDUE = timedelta(minutes=1)  # when a holding past its expected end is expected to end


@dataclass(frozen=True)
class Waiting:
    id: int
    request: policy.Request
    run_hours: float  # how long it is expected to hold its GPUs once started
    on_nodes: frozenset[str] | None = None
    slice_parts: int | None = None  # one slice of a GPU split in this many (policy.slices plans it)


@dataclass(frozen=True)
class Held:
    gpus: tuple[policy.Gpu, ...]
    ends: datetime | None
    sure: str = "guess"  # "firm", "limit", "guess" or "default"


@dataclass(frozen=True)
class Expected:
    at: datetime | None
    sure: str  # one of SURENESS


@dataclass
class Plan:
    grants: dict[int, tuple[policy.Gpu, ...]] = field(default_factory=dict)  # start now, on these
    expected: dict[int, Expected] = field(default_factory=dict)  # every entry, granted or not
    backfilled: set[int] = field(default_factory=set)  # granted while someone ahead still waits
    # granted ahead of these protected (reserved) entries: with no time limits to end it in
    # time, such a grant may be taken back for them at their turn (spawner/policy/borrowing.py)
    ahead_of: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # the GPUs each protected entry is reserved (the binding reservations): a waiting slice
    # never refills one of them, so a GPU held in slices drains for it (policy.slices)
    reserved: dict[int, tuple[policy.Gpu, ...]] = field(default_factory=dict)

    def position(self, order: Sequence[int], entry_id: int) -> tuple[int, int]:
        """1-based place among those still waiting after this plan's grants, and how many."""
        left = [i for i in order if i not in self.grants]
        return (left.index(entry_id) + 1 if entry_id in left else 0), len(left)


def _worse(a: str, b: str) -> str:
    return a if SURENESS.index(a) > SURENESS.index(b) else b


class _Timeline:
    """Each GPU's busy periods: held now (until its expected end) and reserved ahead."""

    def __init__(self, inventory: Sequence[policy.Gpu], held: Sequence[Held], now: datetime):
        self.now = now
        self.busy: dict[policy.Gpu, list[tuple[datetime, datetime | None, str]]] = {g: [] for g in inventory}
        for h in held:
            ends = h.ends
            if ends is not None and ends <= now:  # overdue: ends any moment, but holds them now
                ends = now + OVERDUE
            for g in h.gpus:
                if g in self.busy:
                    self.busy[g].append((now, ends, h.sure))

    def times(self) -> list[datetime]:
        """When a GPU may become free: now and every expected end of a busy period."""
        found = {self.now}
        for periods in self.busy.values():
            found |= {end for _, end, _ in periods if end is not None and end > self.now}
        return sorted(found)

    def free_over(self, start: datetime, end: datetime) -> list[policy.Gpu]:
        def clear(periods):
            return all(not (lo < end and (hi is None or hi > start)) for lo, hi, _ in periods)

        return [g for g, periods in self.busy.items() if clear(periods)]

    def sureness(self, gpus: Sequence[policy.Gpu], start: datetime) -> str:
        """How sure a start at ``start`` on ``gpus`` is: as sure as the least sure end it waits for."""
        sure = "now" if start <= self.now else "firm"
        for g in gpus:
            for _lo, hi, how in self.busy[g]:
                if hi is not None and hi <= start and hi > self.now:
                    sure = _worse(sure, how)
        return sure

    def reserve(self, gpus: Sequence[policy.Gpu], start: datetime, end: datetime, sure: str) -> None:
        for g in gpus:
            self.busy[g].append((start, end, sure))


def _earliest(timeline: _Timeline, w: Waiting, inventory, now: datetime, run: timedelta):
    """The earliest (time, GPUs) at which ``w`` fits ``timeline``; (None, None) if never."""
    usable = [g for g in inventory if w.on_nodes is None or g.node in w.on_nodes]
    free_now = set(timeline.free_over(now, now + run))
    for t in timeline.times():
        free = [g for g in timeline.free_over(t, t + run) if w.on_nodes is None or g.node in w.on_nodes]
        placed = None
        if t > now:  # a reservation ahead: on GPUs busy now where it can, leaving the
            # free ones to requests that can start on them now without delaying it
            placed = policy.place(w.request, [g for g in free if g not in free_now], usable)
        placed = placed or policy.place(w.request, free, usable)
        if placed is not None:
            return t, placed
    return None, None


def plan(
    waiting: Sequence[Waiting],
    inventory: Sequence[policy.Gpu],
    held: Sequence[Held],
    now: datetime,
    reservations: int = 1,
) -> Plan:
    """The schedule for ``waiting``, already in the queue's order (see the module's text).

    ``reservations``: how many of the first requests that cannot start now get a reservation
    that backfill may not delay: 1 is EASY backfill (only the head is protected, as the
    queue promises), a large number conservative backfill (everyone ahead is). Expected
    starts are always the conservative schedule's: where every request ahead keeps its turn."""
    binding = _Timeline(inventory, held, now)  # what grants must respect
    shown = _Timeline(inventory, held, now)  # every request's turn, for expected starts
    out = Plan()
    protected: list[int] = []  # the entries holding a reservation that grants must respect
    for w in waiting:
        run = timedelta(hours=max(w.run_hours, 1 / 60))
        t, placed = _earliest(binding, w, inventory, now, run)
        if t is not None and t <= now:
            sure = binding.sureness(placed, t)
            for timeline in (binding, shown):
                timeline.reserve(placed, t, t + run, "guess")  # its end: a run length, a guess
            out.expected[w.id] = Expected(t, sure)
            out.grants[w.id] = placed
            if protected or len(out.grants) < len(out.expected):
                out.backfilled.add(w.id)
            if protected:
                out.ahead_of[w.id] = tuple(protected)
            continue
        t, placed = _earliest(shown, w, inventory, now, run)
        if t is None:
            out.expected[w.id] = Expected(None, "unknown")
            continue
        sure = shown.sureness(placed, t)
        out.expected[w.id] = Expected(t, sure)
        shown.reserve(placed, t, t + run, _worse(sure, "guess"))
        if len(protected) < reservations:
            binding.reserve(placed, t, t + run, _worse(sure, "guess"))
            protected.append(w.id)
            out.reserved[w.id] = tuple(placed)
    return out


@dataclass(frozen=True)
class Run:
    """An ended allocation, as a sample of how long its user runs."""

    started: datetime | None
    ended: datetime
    ended_by_gpuhub: bool = False  # reclaimed for idleness, or taken back (preempted)


def counts(run: Run, min_seconds: float) -> bool:
    """Whether ``run`` says how long its user runs: it started, it lasted ``min_seconds`` at
    least (GPUs taken and given back at once say nothing), and its user ended it (gpuhub's
    idle reclaim ends GPUs that were not used; a preemption ends it early)."""
    if run.started is None or run.ended_by_gpuhub:
        return False
    return (run.ended - run.started).total_seconds() >= min_seconds


def typical_run_hours(runs: Sequence[Run], min_seconds: float, keep: int = 20) -> float | None:
    """The median length in hours of the newest ``keep`` runs (``runs`` newest first) that
    count (:func:`counts`); None when none does (the default run length then applies)."""
    import statistics

    got = [(r.ended - r.started).total_seconds() / 3600.0 for r in runs if counts(r, min_seconds)]
    return statistics.median(got[:keep]) if got else None


def limit_ends_wait(gpus: int, eff: policy.EffectiveLimit) -> str | None:
    """Why a waiting request must leave the queue now: its user's limit, lowered while it
    waited, can never let it start (None: it may still start, so it waits).

    Only the limit on GPUs held at once decides it: GPUs the user holds now are given back in
    time, and a GPU-hours quota used up frees as older use leaves the window, so a request
    that fits the limit itself waits (what can wait waits; only what can never fit ends)."""
    most = eff.limit.max_gpus
    if most is None or gpus <= most:
        return None
    again = "without GPUs (0)" if most == 0 else f"with {most} or fewer"
    return (
        f"your limit is now {words.count(most, 'GPU')} ({eff.source}); your request for "
        f"{words.count(gpus, 'GPU')} can never fit: start again {again}, or ask an admin to raise "
        "the limit"
    )
