"""A waiter's questions to the queue (a part of :class:`spawner.ledger.Ledger`): has my turn
come (:meth:`QueueAsking.wait_turn`, and :meth:`~QueueAsking.wait_turns` for a hub's waiters at
once), the broker back after an outage (:meth:`~QueueAsking.resume_waiting`), and the sweep of
waits nobody asks about any more (:meth:`~QueueAsking.end_stale_waits`). The queue's order, plan
and entries are :mod:`spawner.ledger.queue`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from fractions import Fraction

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from spawner import policy
from spawner.ledger.models import Allocation, QueueEntry
from spawner.ledger.queue import _groups, entry_info
from spawner.ledger.transactions import _info
from spawner.policy import slices
from spawner.policy.records import Admission


class QueueAsking:
    """Uses ``_tx``/``_read``/``clock``/``expire_in`` (``LedgerBase``), the queue's
    ``_cached_scene``/``scene_in``/``never_fits_in``/``end_stale_in``/``_leave``
    (``QueueRecords``), ``holdings_in``/``_rules`` (limits), ``budget_refusal_in`` (energy) and
    ``grant_in`` (admission)."""

    def resume_waiting(self) -> int:
        """The broker is back: every waiting entry counts as asked about now (how many).

        Waiters ask through the broker; while it was down (a hub restart stops it) none could,
        so the outage must not end them for their keepalive. A waiter that died meanwhile ends
        one keepalive later instead."""
        with self._tx() as s:
            now = self.clock()
            waiting = list(
                s.scalars(select(QueueEntry).where(QueueEntry.state == "waiting", QueueEntry.seen < now))
            )
            for e in waiting:
                e.seen = now
            s.info["changed"] = bool(waiting)  # an entry past its keepalive is kept: a decision
            return len(waiting)

    def _still_waiting_in(self, s: Session, e: QueueEntry, now: datetime) -> Admission | None:
        """The answer to a waiter whose entry simply waits on (asked about lately, still able
        to fit, not started by the plan now), read without the lock; None: ask with it."""
        fresh = e.seen >= now - timedelta(seconds=self.queue_settings.keepalive_seconds / 3)
        if e.state == "waiting" and fresh and self.never_fits_in(s, e) is None:
            scene = self._cached_scene(s, now)
            if e.id not in scene.plan.grants:
                return Admission(entry=scene.info(entry_info(e)))
        return None

    def wait_turns(self, entry_ids: Iterable[int]) -> dict[int, Admission | Exception]:
        """:meth:`wait_turn` for many waiters at once (a hub's waiting spawns, one poller): those
        that simply wait on are answered from one read; the others each as :meth:`wait_turn`.
        Each answer, or the error that entry's ask raised."""
        out: dict[int, Admission | Exception] = {}
        asks = []
        with self._read() as s:
            now = self.clock()
            for entry_id in entry_ids:
                e = s.get(QueueEntry, entry_id)
                quick = None if e is None else self._still_waiting_in(s, e, now)
                if quick is None:
                    asks.append(entry_id)
                else:
                    out[entry_id] = quick
        for entry_id in asks:
            try:
                out[entry_id] = self.wait_turn(entry_id)
            except Exception as e:  # that waiter's, not the others'
                out[entry_id] = e
        return out

    def wait_turn(self, entry_id: int) -> Admission:
        """The waiter's question: has my turn come? Books the GPUs when it has.

        Returns the allocation (granted now or before) or the entry with its place; an entry
        that left the queue comes back with its state ``left`` and the reason."""
        with self._read() as s:  # most asks change nothing: answer them without the lock
            e = s.get(QueueEntry, entry_id)
            if e is None:
                raise LookupError(f"queue entry {entry_id} does not exist")
            quick = self._still_waiting_in(s, e, self.clock())
            if quick is not None:
                return quick
        with self._tx() as s:
            now = self.clock()
            self.expire_in(s)
            e = s.get(QueueEntry, entry_id)
            ended = self.end_stale_in(s, now)  # before this ask counts: a late waiter finds its entry ended
            if e.state == "waiting":
                e.seen = now
                never = self.never_fits_in(s, e)  # a limit lowered below it while it waited
                if never is not None:
                    self._leave(e, never)
            if e.state == "granted":
                a = s.get(Allocation, e.allocation_id)
                return Admission(allocation=_info(a), entry=entry_info(e))
            if e.state == "left":
                return Admission(entry=entry_info(e))
            scene = self.scene_in(s, now)
            gpus = scene.plan.grants.get(e.id)
            if gpus is None:
                s.info["changed"] = bool(ended)  # a keepalive alone changes no decision
                return Admission(entry=scene.info(entry_info(e)))
            eff = policy.effective_limit(e.user, _groups(e.groups), self._rules(s))
            holdings = self.holdings_in(s, e.user, eff.limit)
            room = policy.remaining(eff, holdings)
            if room is not None and Fraction(e.gpu_count, e.slice_parts or 1) > room:
                self._leave(
                    e,
                    f"your limit no longer leaves room for it: you hold {slices.plain(holdings.held)} "
                    f"of {policy.describe_limit(eff)}; stop something you hold and start again"
                    + (
                        f", or start again with {int(room)} or fewer"
                        if int(room) and not e.slice_parts
                        else ""
                    ),
                )
                return Admission(entry=entry_info(e))
            spent = self.budget_refusal_in(s, e.user, _groups(e.groups))
            if spent:  # the energy budget ran out while it waited
                self._leave(e, spent[0].lower() + spent[1:].rstrip("."))
                return Admission(entry=entry_info(e))
            allocation = self.grant_in(s, e, gpus, now, scene.plan.ahead_of.get(e.id, ()))
            return Admission(allocation=allocation, entry=entry_info(e))

    def end_stale_waits(self) -> list[int]:
        """End the waits nobody asked about for the keepalive (their spawn was lost to a hub
        restart, their kernel died) or past the longest wait, without waiting for another ask
        to end them: the broker's sweep. Their ids; a read alone where there is none."""
        qs = self.queue_settings
        with self._read() as s:
            now = self.clock()
            stale = or_(
                QueueEntry.seen < now - timedelta(seconds=qs.keepalive_seconds),
                QueueEntry.created < now - timedelta(hours=qs.max_wait_hours),
            )
            if s.scalar(select(QueueEntry.id).where(QueueEntry.state == "waiting", stale).limit(1)) is None:
                return []
        with self._tx() as s:
            return self.end_stale_in(s, self.clock())
