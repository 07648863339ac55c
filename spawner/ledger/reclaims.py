"""The ledger's record of idle reclaims (a part of :class:`spawner.ledger.Ledger`).

A reclaim is written once per allocation, in the same transaction that checks the
allocation is still live. Its GPUs stay held until whatever uses them has stopped
(releasing them earlier would book them twice): a server's until its spawner stops it; a
burst's until its kernel, refused its next lease renewal, stops the engines and releases
it, or until its lease runs out. Either way the allocation ends with the reclaim's reason.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select

from spawner.ledger.models import Allocation, Reclaim
from spawner.policy.idle import gpu_hours
from spawner.policy.records import ACTIVE_STATES, ReclaimInfo


def _reclaim_info(r: Reclaim) -> ReclaimInfo:
    return ReclaimInfo(
        r.id,
        r.allocation_id,
        r.user,
        r.purpose,
        r.server_name,
        r.gpus,
        r.idle_seconds,
        r.gpu_hours,
        r.reason,
        r.created,
    )


def _record_of(s, allocation_id: int) -> Reclaim | None:
    return s.scalar(select(Reclaim).where(Reclaim.allocation_id == allocation_id))


class ReclaimRecords:
    """Methods of the Ledger (it provides ``_tx``, ``_read``, ``_end``, ``clock``)."""

    def record_reclaim(self, allocation_id: int, idle_seconds: float, reason: str) -> ReclaimInfo | None:
        """Record that a live allocation is reclaimed (its GPUs stay held: see above).

        None when it is no longer live; the existing record when it was recorded before
        (a stop still under way)."""
        with self._tx() as s:
            old = _record_of(s, allocation_id)
            if old is not None:
                return _reclaim_info(old)
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                return None
            gpus = max(a.gpu_count or 0, len(a.gpus))
            r = Reclaim(
                allocation_id=a.id,
                user=a.user,
                purpose=a.purpose,
                server_name=a.server_name,
                gpus=gpus,
                idle_seconds=float(idle_seconds),
                # a slice's idle GPU-hours are its share of its GPU's
                gpu_hours=gpu_hours(gpus / a.slice_parts if a.slice_parts else gpus, idle_seconds),
                reason=reason[:500],
                created=self.clock(),
            )
            s.add(r)
            s.flush()
            return _reclaim_info(r)

    def undo_if_used_in(self, s, allocation_id: int, active_at: datetime | None) -> bool:
        r = _record_of(s, allocation_id)
        if r is None or active_at is None or active_at <= r.created - timedelta(seconds=r.idle_seconds):
            return False
        s.delete(r)
        return True

    def undo_reclaim(self, allocation_id: int) -> bool:
        """Forget the reclaim of an allocation still live (it was used again before whatever
        held its GPUs stopped). False when there is none or the allocation has ended."""
        with self._tx() as s:
            r = _record_of(s, allocation_id)
            a = s.get(Allocation, allocation_id)
            if r is None or a is None or a.state not in ACTIVE_STATES:
                return False
            s.delete(r)
            return True

    def reclaim_reason_in(self, s, allocation_id: int) -> str | None:
        r = _record_of(s, allocation_id)
        return None if r is None else f"reclaimed: {r.reason}"

    def set_idle_deadlines(self, deadlines: dict[int, datetime | None]) -> int:
        """Write when each live allocation will be reclaimed unless used (None: not warned);
        only changes are written. Returns how many changed."""
        changed = 0
        with self._tx() as s:
            for allocation_id, when in deadlines.items():
                a = s.get(Allocation, allocation_id)
                if a is not None and a.state in ACTIVE_STATES and a.idle_deadline != when:
                    a.idle_deadline = when
                    changed += 1
        return changed

    def reclaims(self, user: str | None = None, since: datetime | None = None) -> list[ReclaimInfo]:
        """Reclaims, newest first."""
        q = select(Reclaim).order_by(Reclaim.created.desc(), Reclaim.id.desc())
        if user is not None:
            q = q.where(Reclaim.user == user)
        if since is not None:
            q = q.where(Reclaim.created >= since)
        with self._read() as s:
            return [_reclaim_info(r) for r in s.scalars(q)]

    def reclaim_notices(self, user: str, days: float = 7.0) -> list[ReclaimInfo]:
        """The user's servers reclaimed in the last ``days`` and not started again since:
        what the hub's home page tells them."""
        since = self.clock() - timedelta(days=days)
        with self._read() as s:
            found = list(
                s.scalars(
                    select(Reclaim)
                    .join(Allocation, Allocation.id == Reclaim.allocation_id)
                    # only servers really stopped: a stop the hub refused is no news
                    .where(Reclaim.user == user, Reclaim.purpose == "server", Reclaim.created >= since)
                    .where(Allocation.state == "released")
                    .order_by(Reclaim.created.desc())
                )
            )
            out, seen = [], set()
            for r in found:
                if r.server_name in seen:
                    continue  # one notice per server: the latest
                seen.add(r.server_name)
                newer = s.scalar(
                    select(Allocation.id).where(
                        Allocation.user == user,
                        Allocation.purpose == "server",
                        Allocation.server_name == r.server_name,
                        Allocation.id > r.allocation_id,
                    )
                )
                if newer is None:
                    out.append(_reclaim_info(r))
            return out


def totals(records: list[ReclaimInfo]) -> dict[str, dict[str, float]]:
    """Per user: how many reclaims and the idle GPU-hours they ended."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        t = out.setdefault(r.user, {"reclaims": 0, "gpu_hours": 0.0})
        t["reclaims"] += 1
        t["gpu_hours"] += r.gpu_hours
    return {
        u: {"reclaims": t["reclaims"], "gpu_hours": round(t["gpu_hours"], 4)} for u, t in sorted(out.items())
    }
