"""What the pages tell about borrowing and preemption (a part of :class:`spawner.ledger.Ledger`).

Reads only: the notices a borrower is shown (the hub's home page, My GPUs, ``GET me``) and
the accounting per user (borrowed GPU-hours and preemptions: the admin page, ``GET usage``,
``GET preemptions``, metrics).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select

from spawner.ledger.borrowing import _preemption_info
from spawner.ledger.models import Allocation, Preemption
from spawner.policy.records import ACTIVE_STATES, PreemptionNotice


class BorrowingReads:
    """Methods of the Ledger (it provides ``_read`` and ``clock``)."""

    def preemption_notices(self, user: str, days: float = 7.0) -> list[PreemptionNotice]:
        """The user's preemptions to tell them about, newest first: every one whose allocation
        still lives (notice given, grace running or due, or withdrawn), and servers taken back
        in the last ``days`` and not started again since (one per server: the latest)."""
        since = self.clock() - timedelta(days=days)
        with self._read() as s:
            rows = s.execute(
                select(Preemption, Allocation)
                .join(Allocation, Allocation.id == Preemption.allocation_id)
                .where(Preemption.user == user)
                .order_by(Preemption.created.desc(), Preemption.id.desc())
            ).all()
            out, seen = [], set()
            for p, a in rows:
                if a.state in ACTIVE_STATES:
                    out.append(PreemptionNotice(_preemption_info(p), None))
                    continue
                if p.withdrawn is not None:  # nothing was taken back: told while it lived
                    continue
                if p.purpose != "server" or p.created < since or p.server_name in seen:
                    continue
                seen.add(p.server_name)
                newer = s.scalar(
                    select(Allocation.id).where(
                        Allocation.user == user,
                        Allocation.purpose == "server",
                        Allocation.server_name == p.server_name,
                        Allocation.id > p.allocation_id,
                    )
                )
                if newer is None:
                    out.append(PreemptionNotice(_preemption_info(p), a.ended, a.end_reason))
            return out

    def preemption_records(
        self, user: str | None = None, since: datetime | None = None, until: datetime | None = None
    ) -> list[PreemptionNotice]:
        """Preemptions (newest first) with when each allocation ended (None: still live)."""
        q = select(Preemption).order_by(Preemption.created.desc(), Preemption.id.desc())
        if user is not None:
            q = q.where(Preemption.user == user)
        if since is not None:
            q = q.where(Preemption.created >= since)
        if until is not None:
            q = q.where(Preemption.created <= until)
        with self._read() as s:
            found = list(s.scalars(q))
            # their allocations by id (a join lets a planner walk every allocation ever made)
            ids = [p.allocation_id for p in found]
            ends = {
                aid: (state, ended, reason)
                for aid, state, ended, reason in s.execute(
                    select(Allocation.id, Allocation.state, Allocation.ended, Allocation.end_reason).where(
                        Allocation.id.in_(ids)
                    )
                )
            }
            out = []
            for p in found:
                state, ended, reason = ends[p.allocation_id]
                live = state in ACTIVE_STATES
                out.append(
                    PreemptionNotice(_preemption_info(p), None if live else ended, None if live else reason)
                )
            return out

    def borrowing_totals(
        self, since: datetime, until: datetime | None = None, user: str | None = None
    ) -> dict[str, dict[str, float]]:
        """Per user (sorted): ``borrowed_gpu_hours`` between ``since`` and ``until`` and
        ``preemptions`` given notice then; only users with either."""
        until = until or self.clock()
        hours = self.borrowed_hours(since, until)
        counts: dict[str, int] = {}
        for n in self.preemption_records(user, since, until):
            if not n.withdrawn:  # a withdrawn notice took nothing back
                counts[n.preemption.user] = counts.get(n.preemption.user, 0) + 1
        users = {u for u, h in hours.items() if h > 0} | set(counts)
        if user is not None:
            users &= {user}
        return {
            u: {"borrowed_gpu_hours": round(hours.get(u, 0.0), 4), "preemptions": counts.get(u, 0)}
            for u in sorted(users)
        }
