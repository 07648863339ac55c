"""GPU-hours used, per user and over time (a part of :class:`spawner.ledger.Ledger`)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from spawner import policy
from spawner.ledger.db import connection
from spawner.ledger.models import Allocation
from spawner.ledger.transactions import gpus_of

_A = Allocation.__table__
# what one allocation's GPU-hours are read from: its start, creation, end, borrowed part, GPUs
INTERVAL_COLUMNS = (_A.c.started, _A.c.created, _A.c.ended, _A.c.borrowed, gpus_of(_A.c.id))


def usage_interval(started, created, ended, borrowed, n, *, in_limit: bool = False):
    """``(start, end, GPUs)`` of one allocation's row of ``INTERVAL_COLUMNS`` (``in_limit``:
    its borrowed GPUs left out)."""
    return started or created, ended, max(0, n - ((borrowed or 0) if in_limit else 0))


class UsageRecords:
    """What was used, from the allocations' history."""

    def _intervals(self, s: Session, user: str):
        """``(start, end, GPUs)`` of every allocation of ``user``."""
        for row in connection(s).execute(select(*INTERVAL_COLUMNS).where(_A.c.user == user)):
            yield usage_interval(*row)

    def usage_series(
        self, since: datetime, until: datetime, bucket_hours: float = 24.0, user: str | None = None
    ) -> tuple[list[datetime], dict[str, list[float]]]:
        """GPU-hours per user in consecutive buckets from ``since`` to ``until`` (for plots)."""
        step = timedelta(hours=bucket_hours)
        starts = []
        t = since
        while t < until:
            starts.append(t)
            t += step
        out: dict[str, list[float]] = {}
        with self._read() as s:
            users = sorted(set(s.scalars(select(Allocation.user).distinct())))
            for name in users if user is None else [user]:
                intervals = list(self._intervals(s, user=name))
                out[name] = [  # the last bucket may be partial: count only up to ``until``
                    policy.gpu_hours_used(
                        intervals, min(b + step, until), (min(b + step, until) - b).total_seconds() / 3600.0
                    )
                    for b in starts
                ]
        return starts, out

    def usage(
        self, since: datetime, until: datetime | None = None, user: str | None = None
    ) -> dict[str, float]:
        """GPU-hours per user between ``since`` and ``until`` (default: now)."""
        until = until or self.clock()
        window_hours = (until - since).total_seconds() / 3600.0
        out: dict[str, float] = {}
        with self._read() as s:
            users = sorted(set(s.scalars(select(Allocation.user).distinct())))
            for name in users if user is None else [user]:
                out[name] = policy.gpu_hours_used(self._intervals(s, user=name), until, window_hours)
        return out
