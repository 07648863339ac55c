"""The broker's preemption pass: borrowed GPUs taken back for requests within their limit.

Every ``c.GpuBroker.sweep_seconds`` it asks the ledger to give notice to the borrowed
allocations that stand between the head of the queue and its GPUs
(:meth:`~spawner.ledger.Ledger.preempt_for_queue`), and stops the servers whose notice is
due (a burst's kernel is refused its next renewal instead, stops its engines and releases).
"""

from __future__ import annotations

import logging
import time

from .reclaimer import stop_server

log = logging.getLogger("gpuhub.broker")
RETRY_SECONDS = 60.0


class Preempter:
    def __init__(self, broker, clock=time.monotonic):
        self.broker = broker
        self.clock = clock
        self._asked: dict[int, float] = {}  # allocation id -> when its server's stop was asked

    async def check(self) -> list[int]:
        """One pass; returns the allocations given notice in it."""
        broker = self.broker
        made = await broker.run(broker.ledger.preempt_for_queue)
        for p in made:
            broker.metrics.preemptions.labels(purpose=p.purpose).inc()
            log.warning(
                "preempting allocation %s of %s (%s, %s borrowed GPU(s)) for %s; due %s UTC",
                p.allocation_id,
                p.user,
                p.purpose,
                p.borrowed,
                p.for_user,
                f"{p.due:%H:%M:%S}",
            )
        due = await broker.run(broker.ledger.due_preemptions)
        live = {p.allocation_id for p, _ in due}
        for gone in set(self._asked) - live:
            del self._asked[gone]
        for p, is_server in due:
            if not is_server:
                continue  # its renewals are refused now: its kernel stops the engines
            asked = self._asked.get(p.allocation_id)
            if asked is not None and self.clock() - asked < RETRY_SECONDS:
                continue
            self._asked[p.allocation_id] = self.clock()
            if await stop_server(broker, p.user, p.server_name):
                log.warning("stopped %s's server %r: %s", p.user, p.server_name, p.reason)
        return [p.allocation_id for p in made]
