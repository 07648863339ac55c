"""Time limits that run out (the ledger's part ``TimeUpRecords``).

Every ``c.GpuBroker.sweep_seconds`` the broker calls :meth:`settle_time_limits`: a burst whose
time limit ran out is ended there and then (its GPUs freed for the next in the queue; its
kernel's reaper stops the engines, and the kernel says so), and the servers whose time ran out
are returned for the broker to stop through the hub (their GPUs go back with the stop, whose
release records the time limit as the reason: ``AllocationRecords._release_in``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import select

from spawner.ledger.models import Allocation, is_live
from spawner.ledger.transactions import _info
from spawner.policy import timelimits
from spawner.policy.records import AllocationInfo


@dataclass
class TimeUp:
    """What one pass found: bursts it ended, servers to stop (their records, as they were)."""

    ended: list[AllocationInfo] = field(default_factory=list)
    servers: list[AllocationInfo] = field(default_factory=list)


LIMITED = select(Allocation).where(is_live(), Allocation.time_limit_seconds.is_not(None))


class TimeUpRecords:
    def settle_time_limits(self) -> TimeUp:
        """One pass of the broker's (see the module's text)."""
        now = self.clock()
        with self._read() as s:  # most sweeps: nothing has run out
            up = [
                a.id
                for a in s.scalars(LIMITED)
                if timelimits.is_up(a.started, a.created, a.time_limit_seconds, now)
            ]
        if not up:
            return TimeUp()
        out = TimeUp()
        with self._tx() as s:
            now = self.clock()
            for a in s.scalars(LIMITED.where(Allocation.id.in_(up))):
                if not timelimits.is_up(a.started, a.created, a.time_limit_seconds, now):
                    continue  # extended meanwhile
                info = _info(a)
                if a.purpose == "server":
                    out.servers.append(info)
                else:  # a burst ends at its time, whatever its lease
                    self._end(a, timelimits.time_up_text(a.time_limit_seconds, info.time_ends))
                    out.ended.append(info)
            s.flush()
        return out
