"""Notices that stand, notices withdrawn, and taking back at the due time (a part of
:class:`spawner.ledger.Ledger`).

The broker's pass calls :meth:`settle_preemptions` before it gives new notices: a notice whose
request no longer waits (served by other GPUs, cancelled, left, gone quiet) is withdrawn, with
the reason, and its allocation lives on; an allocation that started ahead of reservations
(backfill) stops being preemptible once none of them waits; and a notice that is due and still
stands ends a burst there and then (its GPUs go to the waiter; its kernel learns it from the
broker: the allocation is released), or names a server for the broker to stop. The decisions
are :mod:`spawner.policy.borrowing`'s.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from spawner.ledger.borrowing import _preemption_info, select_due
from spawner.ledger.models import Allocation, Preemption, QueueEntry, is_live
from spawner.policy import borrowing
from spawner.policy.records import Settled


class TakeBackRecords:
    """Methods of the Ledger (it provides ``_tx``, ``_read``, ``expire_in``, ``_end``,
    ``end_stale_in``, ``clock``)."""

    def withdraw_unwanted_in(self, s: Session, now: datetime) -> list[Preemption]:
        """Withdraw the standing notices of live allocations whose request no longer waits."""
        rows = s.execute(
            select(Preemption, QueueEntry.state)
            .join(Allocation, Allocation.id == Preemption.allocation_id)
            .outerjoin(QueueEntry, QueueEntry.id == Preemption.entry_id)
            .where(Preemption.withdrawn.is_(None), Preemption.entry_id.is_not(None), is_live())
        ).all()
        out = []
        for p, state in rows:
            why = borrowing.withdrawal(state)
            if why is not None:
                p.withdrawn, p.withdrawn_reason = now, why[:255]
                out.append(p)
        return out

    def _end_backfill(self, s: Session) -> None:
        """A backfilled allocation stays preemptible only for the entries that still wait."""
        live = list(s.scalars(select(Allocation).where(is_live(), Allocation.backfill_for.is_not(None))))
        if not live:
            return
        ids = set().union(*(borrowing.backfill_ids(a.backfill_for) for a in live))
        waiting = set(
            s.scalars(select(QueueEntry.id).where(QueueEntry.id.in_(ids), QueueEntry.state == "waiting"))
        )
        for a in live:
            keep = borrowing.backfill_ids(a.backfill_for) & waiting
            text = borrowing.backfill_text(keep)
            if text != a.backfill_for:
                a.backfill_for = text

    def settle_preemptions(self) -> Settled:
        """One pass of the broker's (see the module's text)."""
        with self._read() as s:  # most sweeps: no notice stands, nothing is backfilled
            notice = s.scalar(
                select(Preemption.id)
                .join(Allocation, Allocation.id == Preemption.allocation_id)
                .where(Preemption.withdrawn.is_(None), is_live())
                .limit(1)
            )
            backfill = s.scalar(
                select(Allocation.id).where(is_live(), Allocation.backfill_for.is_not(None)).limit(1)
            )
            if notice is None and backfill is None:
                return Settled()
        out = Settled()
        with self._tx() as s:
            now = self.clock()
            self.expire_in(s)
            self.end_stale_in(s, now)  # a waiter gone quiet no longer waits
            withdrawn = self.withdraw_unwanted_in(s, now)
            self._end_backfill(s)
            due = s.execute(select_due(now)).all()
            for p, a in due:
                if a.purpose == "server":
                    out.servers.append(_preemption_info(p))
                else:  # a burst ends at its due time, whatever its lease
                    self._end(a, p.reason)
                    out.ended.append(_preemption_info(p))
            s.flush()
            out.withdrawn = [_preemption_info(p) for p in withdrawn]
        return out
