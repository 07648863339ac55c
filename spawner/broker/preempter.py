"""The broker's preemption pass: GPUs taken back for requests that wait within their limit.

Every ``c.GpuBroker.sweep_seconds`` it settles the notices given before
(:meth:`~spawner.ledger.Ledger.settle_preemptions`: a notice whose request no longer waits is
withdrawn, a burst whose notice is due is ended there and then, its GPUs freed for the
waiter), stops the servers whose notice is due, and gives notice to the allocations (borrowed
ones, and those that started ahead of the queue's reservations) that stand between the head of
the queue and its GPUs (:meth:`~spawner.ledger.Ledger.preempt_for_queue`). A burst's kernel
learns of the end from the broker (its allocation is released: its renewals and checks say
so) and stops its engines; of a withdrawn notice, the same way (the allocation's
``preemption`` is gone, ``preemption_withdrawn`` says why).
"""

from __future__ import annotations

import logging
import time

from gpu_magics.common.words import clock, count
from spawner.broker.reclaimer import ServerStops

log = logging.getLogger("gpuhub.broker")
RETRY_SECONDS = 60.0


class Preempter:
    def __init__(self, broker, clock=time.monotonic):
        self.broker = broker
        self.stops = ServerStops(broker, RETRY_SECONDS, clock)

    async def check(self) -> list[int]:
        """One pass; returns the allocations given notice in it."""
        broker = self.broker
        settled = await broker.run(broker.ledger.settle_preemptions)
        for p in settled.withdrawn:
            log.warning(
                "withdrew the notice to allocation %s of %s (%s): %s",
                p.allocation_id,
                p.user,
                p.purpose,
                p.withdrawn_reason,
            )
        for p in settled.ended:
            log.warning(
                "ended %s's burst allocation %s at its due time: %s", p.user, p.allocation_id, p.reason
            )
        made = await broker.run(broker.ledger.preempt_for_queue)
        for p in made:
            broker.metrics.preemptions.labels(purpose=p.purpose).inc()
            log.warning(
                "preempting allocation %s of %s (%s, %s, %s borrowed) for %s; due %s",
                p.allocation_id,
                p.user,
                p.purpose,
                count(p.gpus, "GPU"),
                p.borrowed,
                p.for_user,
                clock(p.due),
            )
        await self.stops.stop([(p.allocation_id, p.user, p.server_name, p.reason) for p in settled.servers])
        return [p.allocation_id for p in made]
