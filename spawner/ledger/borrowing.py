"""Borrowing beyond the limit and taking it back (a part of :class:`spawner.ledger.Ledger`).

The decisions are :mod:`spawner.policy.borrowing`'s. Here: a request beyond the limit but within the
allowance is booked only on GPUs free now and only while nobody waits (it never queues); the
broker's pass calls :meth:`preempt_for_queue`, which gives the owners of borrowed allocations
(and of allocations that started ahead of the head's reservation: backfill) that stand between
the head of the queue and its GPUs a notice with a due time. Until it is due the allocation
lives on (its kernel saves); then, if the request it was for still waits, a burst is ended and
a server is stopped by the broker (``takeback.py``), and the allocation ends with the
preemption's reason. A notice whose request no longer waits is withdrawn instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from gpu_magics.common import words
from spawner import policy
from spawner.ledger.models import Allocation, Preemption, QueueEntry, has_borrowed, is_live
from spawner.ledger.queue import nodes_of
from spawner.ledger.transactions import _gpu
from spawner.policy import borrowing
from spawner.policy.records import Admission, AllocationRequest, PreemptionInfo


def select_due(now: datetime):
    """Standing preemptions due at ``now`` of live allocations, with their allocations: only
    for a request that still waits (a notice for one gone is withdrawn)."""
    return (
        select(Preemption, Allocation)
        .join(Allocation, Allocation.id == Preemption.allocation_id)
        .outerjoin(QueueEntry, QueueEntry.id == Preemption.entry_id)
        .where(
            Preemption.due <= now,
            Preemption.withdrawn.is_(None),
            or_(Preemption.entry_id.is_(None), QueueEntry.state == "waiting"),
            is_live(),
        )
    )


def _preemption_info(p: Preemption) -> PreemptionInfo:
    return PreemptionInfo(
        p.id,
        p.allocation_id,
        p.user,
        p.purpose,
        p.server_name,
        p.gpus,
        p.borrowed,
        p.for_user,
        p.entry_id,
        p.reason,
        p.created,
        p.due,
        p.withdrawn,
        p.withdrawn_reason,
    )


def _standing(a: Allocation) -> Preemption | None:
    """The allocation's notice, unless there is none or it was withdrawn."""
    p = a.preemption
    return p if p is not None and p.withdrawn is None else None


class BorrowingRecords:
    """Borrowing beyond the limit (for admission: ``borrow_allowance``, ``borrowed_part_in``,
    ``borrow_now_in``) and notices for the queue's head.

    Uses ``_tx``/``_read``/``_active`` (``LedgerBase``), ``scene_in``/``end_stale_in``
    (``QueueRecords``), ``_free``/``_inventory`` (``GpuRecords``), ``expire_in``
    (``AllocationRecords``), ``book_in`` (``AdmissionRecords``)."""

    def borrow_allowance(self, user: str, groups: Iterable[str]) -> tuple[int, str]:
        """GPUs the user may hold beyond the limit, and where that allowance comes from."""
        return borrowing.effective_borrow(user, groups, self.borrow_settings.rules)

    def borrowed_part_in(self, s: Session, user, groups, eff, holdings, count: int) -> int:
        """GPUs of a request beyond the limit (0: within it), or a refusal beyond the allowance."""
        # ``holdings.held`` is what counts against the limit (borrowed GPUs left out); a part of a
        # GPU held in slices takes a whole GPU's room from whole GPUs (borrowing lends whole ones)
        allowance, source = self.borrow_allowance(user, groups)
        max_gpus = eff.limit.max_gpus
        if not allowance or max_gpus is None or holdings.held + count <= max_gpus:
            return 0
        held = math.ceil(holdings.held)
        held_borrowed = sum(a.borrowed or 0 for a in self._active(s, user=user))
        got = borrowing.split(count, held, 0, max_gpus, allowance - held_borrowed)
        if got is None:
            most = max(0, max_gpus - held) + max(0, allowance - held_borrowed)
            also = f" and {held_borrowed} borrowed" if held_borrowed else ""
            raise policy.Refusal(
                f"You asked for {words.count(count, 'GPU')}, but you hold {holdings.held}{also} of "
                f"{policy.describe_limit(eff)} and may borrow at most {allowance} beyond it "
                f"({source}): " + (f"ask for {most} or fewer." if most else "you may take no more now."),
                reason="over_limit",
                fits=most,
            )
        return got.borrowed

    def borrow_now_in(
        self,
        s: Session,
        req: AllocationRequest,
        request: policy.Request,
        free,
        inventory,
        *,
        borrowed: int,
        within: int,
    ) -> Admission:
        """Book a request beyond the limit (``borrowed`` GPUs of it) on GPUs free now, or refuse
        it: GPUs are lent only while nobody waits (it never queues)."""
        now = self.clock()
        self.end_stale_in(s, now)
        quiet = now - timedelta(seconds=self.queue_settings.keepalive_seconds)
        waiting = [
            e for e in s.scalars(select(QueueEntry).where(QueueEntry.state == "waiting")) if e.seen >= quiet
        ]
        if waiting:
            raise policy.Refusal(
                f"{borrowed} of the {words.count(request.count, 'GPU')} you asked for "
                f"{'is' if borrowed == 1 else 'are'} beyond your limit: GPUs are lent beyond a limit only "
                f"while nobody waits for them, and {words.count(len(waiting), 'request')} "
                f"{'waits' if len(waiting) == 1 else 'wait'} now. Ask for {within} or fewer to wait "
                "in the queue within your limit.",
                reason="no_borrowing",
                fits=within,
            )
        placed = policy.place(request, free, inventory)
        if placed is None:
            fits = policy.largest_placeable(free, request.model, request.max_nodes)
            raise policy.Refusal(
                borrow_not_free_message(borrowed, request.count, fits, within),
                reason="no_borrowing",
                fits=fits,
            )
        return Admission(allocation=self.book_in(s, req, placed, now=now, borrowed=borrowed))

    # taking back ------------------------------------------------------------------------

    def preempt_for_queue(self) -> list[PreemptionInfo]:
        """Give notice to the borrowed allocations, and those that started ahead of the head
        (backfill), standing between the head of the queue and GPUs it could start on now
        (newest first, as few GPUs as will do). A notice withdrawn before is given again.

        Only the first entry that cannot start is served per call; nothing is preempted when
        what is already being taken back will do, or when no choice of borrowed allocations
        would let it start."""
        with self._read() as s:  # the broker asks every sweep: most of the time, nothing to do
            waits = s.scalar(select(QueueEntry.id).where(QueueEntry.state == "waiting").limit(1))
            lent = s.scalar(
                select(Allocation.id)
                .where(is_live(), or_(has_borrowed(), Allocation.backfill_for.is_not(None)))
                .limit(1)
            )
            if waits is None or lent is None:
                return []
        with self._tx() as s:
            now = self.clock()
            self.expire_in(s)
            self.end_stale_in(s, now)
            scene = self.scene_in(s, now)
            head = next((i for i in scene.order if i not in scene.plan.grants), None)
            if head is None:
                return []
            e = s.get(QueueEntry, head)
            live = self._active(s)
            taken = [a for a in live if _standing(a) is not None]
            nodes = nodes_of(e.on_nodes)
            inventory = [g for g in self._inventory(s) if nodes is None or g.node in nodes]
            coming = list(scene.free) + [_gpu(ag.gpu) for a in taken for ag in a.gpus if ag.held]
            coming = [g for g in coming if nodes is None or g.node in nodes]
            # borrowed GPUs, and those that started ahead of this very entry (backfill)
            candidates = [
                borrowing.Borrowed(a.id, a.created, tuple(_gpu(ag.gpu) for ag in a.gpus if ag.held))
                for a in live
                if ((a.borrowed or 0) > 0 or e.id in borrowing.backfill_ids(a.backfill_for))
                and _standing(a) is None
                and a.user != e.user
            ]
            request = policy.Request(e.user, e.gpu_count, e.model, e.max_nodes, e.gpus_per_node)
            chosen = borrowing.victims(request, coming, inventory, candidates)
            if not chosen:
                return []
            grace = timedelta(seconds=self.borrow_settings.grace_seconds)
            by_id = {a.id: a for a in live}
            made = []
            for allocation_id in chosen:
                a = by_id[allocation_id]
                gpus = max(a.gpu_count or 0, len(a.gpus))
                backfill = not a.borrowed
                # a notice withdrawn before is the same row, given again (one per allocation)
                p = a.preemption or Preemption(allocation_id=a.id)
                p.user, p.purpose, p.server_name = a.user, a.purpose, a.server_name
                p.gpus, p.borrowed, p.for_user, p.entry_id = gpus, a.borrowed or 0, e.user, e.id
                p.reason = borrowing.notice_reason(p.borrowed, gpus, backfill, e.gpu_count, e.created)
                p.created, p.due, p.withdrawn, p.withdrawn_reason = now, now + grace, None, None
                if p.id is None:
                    s.add(p)
                made.append(p)
            s.flush()
            return [_preemption_info(p) for p in made]

    def preempt_reason_in(self, s: Session, allocation_id: int, now: datetime | None = None) -> str | None:
        """The preemption's reason once it is due (None before, or when there is none)."""
        p = s.scalar(
            select(Preemption).where(
                Preemption.allocation_id == allocation_id, Preemption.withdrawn.is_(None)
            )
        )
        if p is None or (now is not None and now < p.due):
            return None
        return p.reason

    def due_preemptions(self) -> list[tuple[PreemptionInfo, bool]]:
        """Preemptions due now whose allocation still lives, with whether it is a server's
        (the broker stops those servers; a burst's kernel is refused its next renewal)."""
        with self._read() as s:
            return [
                (_preemption_info(p), a.purpose == "server") for p, a in s.execute(select_due(self.clock()))
            ]

    def preemptions(self, user: str | None = None, since: datetime | None = None) -> list[PreemptionInfo]:
        with self._read() as s:
            q = select(Preemption).order_by(Preemption.id)
            if user is not None:
                q = q.where(Preemption.user == user)
            if since is not None:
                q = q.where(Preemption.created >= since)
            return [_preemption_info(p) for p in s.scalars(q)]

    def borrowed_hours(self, since: datetime, until: datetime | None = None) -> dict[str, float]:
        """Borrowed GPU-hours per user between ``since`` and ``until`` (default: now)."""
        until = until or self.clock()
        out: dict[str, float] = {}
        with self._read() as s:
            q = select(Allocation).where(has_borrowed())
            for a in s.scalars(q):
                start, end = max(a.started or a.created, since), min(a.ended or until, until)
                if end > start:
                    out[a.user] = out.get(a.user, 0.0) + a.borrowed * (end - start).total_seconds() / 3600
        return out


def borrow_not_free_message(borrowed: int, count: int, free: int, within: int) -> str:
    """Why a request beyond the limit is refused when too few GPUs are free to lend, and what
    the user may ask for instead (pure): fewer GPUs now, or a request within the limit that
    waits."""
    if borrowed == count:
        which = "The GPU you asked for is" if count == 1 else f"All {count} GPUs you asked for are"
    else:
        which = f"{borrowed} of the {count} GPUs you asked for {'is' if borrowed == 1 else 'are'}"
    head = f"{which} beyond your limit, and only GPUs free now are lent"
    now = "none is free" if free == 0 else f"{free} {'is' if free == 1 else 'are'} free"
    options = []
    if free:
        options.append(f"ask for {min(free, count)} or fewer to start now")
    if within:
        options.append(f"ask for {within} or fewer to wait in the queue within your limit")
    if not options:
        options.append("try again when GPUs are free, or ask an admin to raise your limit")
    todo = ", or ".join(options)
    return f"{head}: {now}. {todo[0].upper()}{todo[1:]}."
