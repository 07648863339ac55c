"""Waiting for GPUs: the queue (a part of :class:`spawner.ledger.Ledger`).

A request that fits its user's limit but not the free GPUs becomes a ``queue_entries`` row.
Its waiter (the hub's spawn, a notebook's magic through the broker) asks :meth:`wait_turn`
every ``c.GpuHub.queue_poll_seconds``; each ask computes the queue's order
(:mod:`spawner.policy.fairshare`) and schedule (:mod:`spawner.policy.schedule`) from the ledger as it is
and, when the schedule starts this entry now, books its GPUs in the same transaction. So
only a live waiter is ever given GPUs (nothing is booked for a spawn that is gone), the
head starts within one poll of its GPUs freeing, and no entry is granted out of the
policy's order: a grant is the plan's, computed under the ledger's write lock.

A direct :meth:`allocate` goes through the same plan (``spawner/ledger/admission.py``): it gets
GPUs only where a new entry would start at once, so nobody passes the queue by not joining it.

Entries end (state ``left``, with the reason) when their waiter leaves (stop button,
Ctrl-C), when nobody asked about them for ``queue_keepalive_seconds`` (the spawn was lost
to a hub restart, the kernel died), after ``queue_max_wait_hours``, when an admin cancels
them, or when a limit lowered meanwhile can never let them start (at the waiter's next ask,
with the new limit and what to do: ``schedule.limit_ends_wait``; one that fits the new limit
but not beside what its user holds at its turn ends then).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from spawner import policy
from spawner.ledger.models import Allocation, KnownUser, Preemption, QueueEntry, Reclaim
from spawner.ledger.transactions import _gpu
from spawner.policy import fairshare, timelimits
from spawner.policy import schedule as queueplan
from spawner.policy.records import QueueInfo

NEW = 2**63 - 1  # the id a request not yet in the queue has in the plan (last on ties: it asked last)
HISTORY_DAYS = 30  # run lengths are read from allocations ended this recently
RUNS_PER_USER = 20
OVERDUE_MIN = timedelta(minutes=5)
SCENE_SECONDS = timedelta(seconds=1)  # how long a read-only answer may reuse a computed scene


def nodes_of(text: str | None) -> frozenset[str] | None:
    """The nodes a queue entry's ``on_nodes`` names (None: anywhere)."""
    return None if text is None else frozenset(n for n in text.split(",") if n)


def _groups(text: str) -> list[str]:
    return [g for g in text.split(",") if g]


def entry_info(e: QueueEntry) -> QueueInfo:
    return QueueInfo(
        id=e.id,
        user=e.user,
        purpose=e.purpose,
        server_name=e.server_name,
        gpu_count=e.gpu_count,
        model=e.model,
        state=e.state,
        created=e.created,
        seen=e.seen,
        front=e.front,
        ended=e.ended,
        end_reason=e.end_reason,
        allocation_id=e.allocation_id,
        slice_parts=e.slice_parts,
    )


@dataclass
class _Scene:
    """The queue's order and schedule at one moment, with the rows behind them."""

    order: list[int]
    plan: queueplan.Plan
    factors: dict[int, fairshare.Factors]
    free: list[policy.Gpu]

    def info(self, base: QueueInfo) -> QueueInfo:
        position, waiting = self.plan.position(self.order, base.id) if base.state == "waiting" else (0, 0)
        expected = self.plan.expected.get(base.id, queueplan.Expected(None, "unknown"))
        return replace(
            base,
            position=position,
            waiting=waiting,
            expected=expected.at,
            sure=expected.sure,
            factors=self.factors.get(base.id),
        )


def known_end(a: Allocation, now: datetime, reclaimed: bool, due: datetime | None):
    """When a holding ends by what is known of it, best first (``(None, None)``: nothing):
    an idle reclaim under way or due, a notice's due time, then its time limit's end."""
    if reclaimed:  # being stopped for idleness: ends within moments
        return now + timedelta(minutes=1), "firm"
    found = []
    if a.idle_deadline is not None:  # warned: reclaimed then unless used again
        found.append((max(a.idle_deadline, now), "firm"))
    if due is not None:  # taken back then (a borrowed or backfilled holding)
        found.append((max(due, now), "firm"))
    ends = timelimits.ends_at(a.started, a.created, a.time_limit_seconds)
    if ends is not None:  # it ends then whatever else happens
        found.append((max(ends, now), "limit"))
    return min(found, default=(None, None), key=lambda f: f[0])


def guessed_end(a: Allocation, now: datetime, typical_hours: float | None, default_hours: float):
    """A holding's end from its user's typical run length (``"guess"``), or from the default
    run length when its user has no finished run yet (``"default"``: said as not known)."""
    typical = timedelta(hours=typical_hours if typical_hours is not None else default_hours)
    start = a.started or a.created
    ends = start + typical
    if ends < now + OVERDUE_MIN:  # running past its user's usual: as long again as it has
        # run past it, halved (never "any moment now", which would hold free GPUs back from
        # backfill for ever)
        ends = now + max(OVERDUE_MIN, (now - start - typical) / 2 + OVERDUE_MIN)
    if a.lease_expires is not None:
        ends = max(ends, a.lease_expires)
    return ends, "guess" if typical_hours is not None else "default"


def run_length(hours: float, time_limit_seconds: float | None) -> float:
    """How long a waiting request is expected to run: its user's typical length, never past
    its time limit."""
    return hours if time_limit_seconds is None else min(hours, time_limit_seconds / 3600)


class QueueRecords:
    """The queue's scene, a waiter's turn, leaving and reordering, and the queue's reads.

    Uses ``_tx``/``_read``/``_active``/``_generation`` (``LedgerBase``), ``_rules``
    (``LimitRecords``), ``_inventory``/``_free`` (``GpuRecords``), ``expire_in``
    (``AllocationRecords``), ``holdings_in``/``grant_in`` (``AdmissionRecords``). Admission
    calls ``live_waiting_in`` and ``scene_in``; borrowing and taking back call ``end_stale_in``."""

    # the scene ------------------------------------------------------------------------

    def end_stale_in(self, s: Session, now: datetime) -> list[int]:
        return self.live_waiting_in(s, now)[0]

    def never_fits_in(self, s: Session, e: QueueEntry) -> str | None:
        """Why ``e`` can never start under its user's limit as it is now (a limit lowered
        while it waited, by the CLI, the API or the config), or None
        (:func:`spawner.policy.schedule.limit_ends_wait`)."""
        if e.slice_parts:  # the slice it waits for is no longer offered (the setting changed)
            offer = self.slice_offers.get(e.model or "")
            if offer is None or offer.count != e.slice_parts:
                return (
                    f"{e.model} GPUs are no longer split in {e.slice_parts} here (c.GpuHub.gpu_slices); "
                    "start again with what the form offers now"
                )
        eff = policy.effective_limit(e.user, _groups(e.groups), self._rules(s))
        return queueplan.limit_ends_wait(e.gpu_count, eff)

    def live_waiting_in(self, s: Session, now: datetime) -> tuple[list[int], list[QueueEntry]]:
        """End the entries past their keepalive or longest wait: their ids, and the entries
        that still wait. (One that its limit can never let start ends at its waiter's ask,
        :meth:`wait_turn`: that process has the hub's configured limits, which a bare
        ``Ledger`` of a script may not.)"""
        qs = self.queue_settings
        quiet = now - timedelta(seconds=qs.keepalive_seconds)
        oldest = now - timedelta(hours=qs.max_wait_hours)
        ended, live = [], []
        if not s.info.pop("waiting", True) and not (s.new or s.dirty or s.deleted):
            return ended, live  # nobody waited when the transaction began (read with the lock row)
        for e in s.scalars(select(QueueEntry).where(QueueEntry.state == "waiting")):
            if e.seen < quiet:
                self._leave(
                    e, f"nobody waited for it any more (not asked about for {qs.keepalive_seconds:g} s)"
                )
            elif e.created < oldest:
                self._leave(
                    e,
                    f"it waited the longest allowed ({qs.max_wait_hours:g} h, c.GpuHub.queue_max_wait_hours)",
                )
            else:
                live.append(e)
                continue
            ended.append(e.id)
        return ended, live

    def _leave(self, e: QueueEntry, reason: str) -> None:
        e.state, e.ended, e.end_reason = "left", self.clock(), reason[:255]

    def _usage_and_runs(self, s: Session, now: datetime) -> tuple[dict[str, float], dict[str, float]]:
        """Decayed GPU-hours per user, and each user's median run length in hours."""
        w = self.queue_settings.weights
        cutoff = now - timedelta(hours=8 * w.half_life_hours)  # older use weighs under 0.4 %
        history = now - timedelta(days=HISTORY_DAYS)
        recent = Allocation.ended >= history
        taken = set(  # ended by gpuhub: reclaimed for idleness, or taken back after a notice
            s.scalars(
                select(Reclaim.allocation_id)
                .join(Allocation, Allocation.id == Reclaim.allocation_id)
                .where(recent)
            )
        )
        taken.update(
            s.scalars(
                select(Preemption.allocation_id)
                .join(Allocation, Allocation.id == Preemption.allocation_id)
                .where(recent, Preemption.withdrawn.is_(None))
            )
        )
        rows = s.execute(
            select(
                Allocation.user,
                Allocation.created,
                Allocation.started,
                Allocation.ended,
                Allocation.gpu_count,
                Allocation.id,
                Allocation.slice_parts,
            )
            .where(or_(Allocation.ended.is_(None), Allocation.ended >= min(cutoff, history)))
            .order_by(Allocation.id.desc())
        ).all()
        intervals: dict[str, list] = {}
        runs: dict[str, list[queueplan.Run]] = {}
        least = self.queue_settings.min_run_seconds
        for user, created, started, ended, count, aid, parts in rows:
            start = started or created
            if ended is None or ended >= cutoff:
                # a slice's use is its share of a GPU's
                intervals.setdefault(user, []).append((start, ended, (count or 0) / (parts or 1)))
            if ended is not None and ended >= history:
                run = queueplan.Run(started, ended, aid in taken)
                got = runs.setdefault(user, [])
                if len(got) < RUNS_PER_USER and queueplan.counts(run, least):  # only those that count
                    got.append(run)
        usage = {u: fairshare.decayed_usage(iv, now, w.half_life_hours) for u, iv in intervals.items()}
        typical = {u: queueplan.typical_run_hours(r, least, RUNS_PER_USER) for u, r in runs.items()}
        return usage, {u: h for u, h in typical.items() if h is not None}

    def scene_in(
        self,
        s: Session,
        now: datetime,
        new: tuple[fairshare.Candidate, queueplan.Waiting] | None = None,
        new_groups: Iterable[str] = (),
        new_time_limit: float | None = None,
    ) -> _Scene:
        qs = self.queue_settings
        # an entry past its keepalive or its longest wait is gone, whether or not a write has
        # ended it yet: a read-only answer must not plan around it
        quiet = now - timedelta(seconds=qs.keepalive_seconds)
        oldest = now - timedelta(hours=qs.max_wait_hours)
        rows = [
            e
            for e in s.scalars(select(QueueEntry).where(QueueEntry.state == "waiting"))
            if e.seen >= quiet and e.created >= oldest
        ]
        usage, runs = self._usage_and_runs(s, now)
        known = {u.name: _groups(u.groups) for u in s.scalars(select(KnownUser))}
        groups = {**known, **{e.user: _groups(e.groups) for e in rows}}
        candidates = [fairshare.Candidate(e.id, e.user, e.created, e.front) for e in rows]
        default_run = qs.default_run_hours
        waiting = {
            e.id: queueplan.Waiting(
                e.id,
                policy.Request(e.user, e.gpu_count, e.model, e.max_nodes, e.gpus_per_node),
                run_length(runs.get(e.user, default_run), e.time_limit_seconds),
                nodes_of(e.on_nodes),
                e.slice_parts,
            )
            for e in rows
        }
        if new is not None:  # a request not yet in the queue, with its user's run length
            candidates.append(new[0])
            waiting[new[0].id] = replace(
                new[1], run_hours=run_length(runs.get(new[0].user, default_run), new_time_limit)
            )
            groups[new[0].user] = list(new_groups)  # its share as it will have once it waits
        # shares are parts of every known user's (as Slurm's of every association): who waits
        # now does not move anyone's factor
        users = set(usage) | set(known) | {c.user for c in candidates}
        share = {u: fairshare.effective_share(u, groups.get(u, ()), qs.shares)[0] for u in users}
        found = fairshare.factors(candidates, usage, share, now, qs.weights)
        ordered = fairshare.order(candidates, found)
        held = []
        live = self._active(s)
        ids = [a.id for a in live]
        reclaimed = set(s.scalars(select(Reclaim.allocation_id).where(Reclaim.allocation_id.in_(ids))))
        notices = dict(
            s.execute(
                select(Preemption.allocation_id, Preemption.due).where(
                    Preemption.allocation_id.in_(ids), Preemption.withdrawn.is_(None)
                )
            ).all()
        )
        # when slices free up: each slice held, and each GPU of a split model held whole (all
        # its slices), by its expected end (the waiting slices' expected starts)
        frees: dict[str, list[tuple[datetime, str, int]]] = {}
        for a in live:
            gpus = tuple(sorted(_gpu(ag.gpu) for ag in a.gpus if ag.held))
            if not gpus:
                continue
            ends, sure = known_end(a, now, a.id in reclaimed, notices.get(a.id))
            if ends is None:  # nothing known: its user's run lengths, a guess
                ends, sure = guessed_end(a, now, runs.get(a.user), default_run)
            held.append(queueplan.Held(gpus, ends, sure))
            for g in gpus:
                offer = self.slice_offers.get(g.model)
                if offer is not None:
                    frees.setdefault(g.model, []).append((ends, sure, 1 if a.slice_parts else offer.count))
        in_order = [waiting[c.id] for c in ordered]
        plan = queueplan.plan(
            [w for w in in_order if not w.slice_parts], self._inventory(s), held, now, qs.reservations
        )
        order = [c.id for c in ordered]
        if any(w.slice_parts for w in in_order):  # the slices' part of the plan (ledger/slices.py)
            self.plan_slices_in(s, plan, order, in_order, now, frees)
        return _Scene(order, plan, found, self._free(s))

    def _cached_scene(self, s: Session, now: datetime) -> _Scene:
        """The scene, computed at most once per ``SCENE_SECONDS`` while the ledger does not
        change (its generation): the waiters of one process, polling each second, share it
        instead of each recomputing the whole queue (read-only answers; a grant recomputes)."""
        generation = self._generation(s)
        cached = getattr(self, "_scene_cache", None)
        if cached is not None:
            gen, at, scene = cached
            if gen == generation and timedelta(0) <= now - at < SCENE_SECONDS:
                return scene
        scene = self.scene_in(s, now)
        self._scene_cache = (generation, now, scene)
        return scene

    def leave_queue(self, entry_id: int, reason: str = "left the queue") -> bool:
        """End a waiting entry (stop button, Ctrl-C, an admin). False when it no longer waits."""
        with self._tx() as s:
            e = s.get(QueueEntry, entry_id)
            if e is None or e.state != "waiting":
                return False
            self._leave(e, reason)
            return True

    def leave_queue_of(self, user: str, server_name: str, reason: str) -> list[int]:
        """End the waiting spawn entries of one server (the server was stopped or deleted)."""
        with self._tx() as s:
            found = list(
                s.scalars(
                    select(QueueEntry).where(
                        QueueEntry.state == "waiting",
                        QueueEntry.user == user,
                        QueueEntry.purpose == "server",
                        QueueEntry.server_name == server_name,
                    )
                )
            )
            for e in found:
                self._leave(e, reason)
            return [e.id for e in found]

    def move_to_front(self, entry_id: int) -> QueueInfo:
        """An admin's: this entry goes ahead of every other (the latest moved first)."""
        with self._tx() as s:
            e = s.get(QueueEntry, entry_id)
            if e is None or e.state != "waiting":
                raise LookupError(f"queue entry {entry_id} is not waiting")
            e.front = self.clock()
            return entry_info(e)

    def queue_entry(self, entry_id: int) -> QueueInfo | None:
        with self._read() as s:
            e = s.get(QueueEntry, entry_id)
            if e is None:
                return None
            if e.state != "waiting":
                return entry_info(e)
            return self.scene_in(s, self.clock()).info(entry_info(e))

    def queue(self, user: str | None = None) -> list[QueueInfo]:
        """Every waiting entry (or a user's), in the queue's order, with place and factors."""
        with self._read() as s:
            now = self.clock()
            rows = {e.id: e for e in s.scalars(select(QueueEntry).where(QueueEntry.state == "waiting"))}
            if not rows:  # nothing to order: no scene (it reads every user's usage)
                return []
            scene = self.scene_in(s, now)
            out = [scene.info(entry_info(rows[i])) for i in scene.order]
        return [q for q in out if user is None or q.user == user]

    def queue_history(self, since: datetime) -> list[QueueInfo]:
        """Entries that stopped waiting since ``since`` (for wait-time metrics and tests)."""
        with self._read() as s:
            q = select(QueueEntry).where(QueueEntry.state != "waiting", QueueEntry.ended >= since)
            return [entry_info(e) for e in s.scalars(q.order_by(QueueEntry.id))]
