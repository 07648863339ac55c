"""The broker's time-limit pass: what ran past its time limit ends.

Every ``c.GpuBroker.sweep_seconds`` it asks the ledger (:meth:`~spawner.ledger.Ledger.settle_time_limits`):
a burst whose time ran out is ended there (its GPUs go to the next in the queue at once; its
kernel's reaper stops the engines, and the kernel says so at its next cell; a Slurm burst's
job is cancelled by the hub's watcher), and a server whose time ran out is stopped through the
hub's REST API (its spawner releases the GPUs as it stops; on Slurm the job's ``--time`` ends
it too).
"""

from __future__ import annotations

import logging
import time

from spawner.broker.reclaimer import ServerStops
from spawner.policy import timelimits

log = logging.getLogger("gpuhub.broker")


class TimeKeeper:
    def __init__(self, broker, clock=time.monotonic):
        self.broker = broker
        self.stops = ServerStops(broker, 60.0, clock)

    async def check(self) -> list[int]:
        """One pass; returns the bursts it ended."""
        broker = self.broker
        up = await broker.run(broker.ledger.settle_time_limits)
        for a in up.ended:
            log.warning(
                "ended %s's burst allocation %s: %s",
                a.user,
                a.id,
                timelimits.time_up_text(a.time_limit_seconds, a.time_ends),
            )
        due = [
            (a.id, a.user, a.server_name, timelimits.time_up_text(a.time_limit_seconds, a.time_ends))
            for a in up.servers
        ]
        await self.stops.stop(due)
        return [a.id for a in up.ended]
