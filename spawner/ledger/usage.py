"""GPU-hours used, per user and over time (a part of :class:`spawner.ledger.Ledger`)."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from spawner.ledger.db import connection
from spawner.ledger.models import Allocation
from spawner.ledger.transactions import gpus_of

_A = Allocation.__table__
# what one allocation's GPU-hours are read from: its start, creation, end, borrowed part, GPUs,
# and the parts its GPUs are split in (a slice's GPU-hours are its share of its GPU's)
INTERVAL_COLUMNS = (
    _A.c.started,
    _A.c.created,
    _A.c.ended,
    _A.c.borrowed,
    gpus_of(_A.c.id),
    _A.c.slice_parts,
)


def usage_interval(started, created, ended, borrowed, n, slice_parts, *, in_limit: bool = False):
    """``(start, end, GPUs)`` of one allocation's row of ``INTERVAL_COLUMNS`` (``in_limit``:
    its borrowed GPUs left out); a slice counts as its share of a GPU."""
    gpus = max(0, n - ((borrowed or 0) if in_limit else 0))
    return started or created, ended, gpus / slice_parts if slice_parts else gpus


def _window_query(since: datetime, until: datetime, user: str | None):
    """``(user, *INTERVAL_COLUMNS)`` of the allocations that overlap ``since``..``until``: only
    those, through the indexes on ``ended`` and ``user`` (a year of history is not read for a
    month)."""
    q = select(_A.c.user, *INTERVAL_COLUMNS).where(
        or_(_A.c.ended.is_(None), _A.c.ended > since), _A.c.created < until
    )
    return q if user is None else q.where(_A.c.user == user)


def _clipped(start: datetime, end: datetime | None, until: datetime) -> tuple[datetime, datetime]:
    """An allocation's interval, a live one running to ``until``."""
    return start, min(end or until, until)


class UsageRecords:
    """What was used, from the allocations' history."""

    def _users(self, s: Session, user: str | None) -> list[str]:
        if user is not None:
            return [user]
        return sorted(set(s.scalars(select(Allocation.user).distinct())))

    def usage_series(
        self, since: datetime, until: datetime, bucket_hours: float = 24.0, user: str | None = None
    ) -> tuple[list[datetime], dict[str, list[float]]]:
        """GPU-hours per user in consecutive buckets from ``since`` to ``until`` (for plots); the
        last bucket may be partial: counted only up to ``until``."""
        step = timedelta(hours=bucket_hours)
        starts = []
        t = since
        while t < until:
            starts.append(t)
            t += step
        with self._read() as s:
            out = {name: [0.0] * len(starts) for name in self._users(s, user)}
            for name, *row in connection(s).execute(_window_query(since, until, user)):
                start, end, gpus = usage_interval(*row)
                lo, hi = _clipped(max(start, since), end, until)
                if hi <= lo or not gpus or name not in out:
                    continue
                series = out[name]
                i = int((lo - since) / step)
                while i < len(starts) and starts[i] < hi:
                    b_lo, b_hi = max(lo, starts[i]), min(hi, starts[i] + step, until)
                    if b_hi > b_lo:
                        series[i] += gpus * (b_hi - b_lo).total_seconds() / 3600.0
                    i += 1
        return starts, out

    def usage(
        self, since: datetime, until: datetime | None = None, user: str | None = None
    ) -> dict[str, float]:
        """GPU-hours per user between ``since`` and ``until`` (default: now)."""
        until = until or self.clock()
        with self._read() as s:
            out = dict.fromkeys(self._users(s, user), 0.0)
            for name, *row in connection(s).execute(_window_query(since, until, user)):
                start, end, gpus = usage_interval(*row)
                lo, hi = _clipped(max(start, since), end, until)
                if hi > lo and name in out:
                    out[name] += gpus * (hi - lo).total_seconds() / 3600.0
        return out
