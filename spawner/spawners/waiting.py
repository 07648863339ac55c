"""A start's wait in gpuhub's queue, and what a cancelled start gives back (a part of
:class:`spawner.spawners.base.GpuSpawnerMixin`).

JupyterHub stops a start that is still pending by cancelling it, waiting one second, and
answering 500 ("pending spawn") if the start has not ended by then (jupyterhub 6.1.1,
``DELETE /users/NAME/server``). A cancelled start therefore ends at once, and what it still
owes the ledger (leaving the queue; giving back GPUs that a ledger call in flight may yet
book, or that a server cut short while it started held) is done after it, in the background:
under a class-start storm each ledger call waits behind hundreds of others. The spawner's next
start waits for that to finish first, so a server never waits twice in the queue nor holds
GPUs from a start that was stopped.
"""

from __future__ import annotations

import asyncio
import contextlib

from spawner import policy
from spawner.ledger import utcnow
from spawner.policy import waitline
from spawner.policy.records import AllocationInfo
from spawner.spawners.queuepoll import poller_for

STOPPED_WAITING = "the server was stopped while it waited"
_RUNNING: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks


class QueueWaiting:
    """The queue's part of a spawner: ``_wait_in_queue`` and the cancelled start's tidy-up."""

    _gpuhub_cleanup: asyncio.Task | None = None

    async def _give_back(self, got, reason: str) -> None:
        """Release what a request got (an allocation, or a place in the queue)."""
        allocation = getattr(got, "allocation", got)
        entry = getattr(got, "entry", None)
        if allocation is not None:
            await self._in_ledger("release", allocation.id, reason)
        if entry is not None and allocation is None:
            await self._in_ledger("leave_queue", entry.id, reason)

    def _give_back_later(
        self, reason: str, pending: asyncio.Future | None = None, entry_id: int = 0, allocation=None
    ) -> None:
        """After a cancelled start: wait for the ledger call still in flight (``pending``),
        give back what it got, or leave the queue entry ``entry_id``, or release ``allocation``."""

        async def finish():
            got = allocation
            if pending is not None:
                with contextlib.suppress(policy.Refusal):
                    got = await pending
            if got is not None:
                await self._give_back(got, reason)
            elif entry_id:
                await self._in_ledger("leave_queue", entry_id, reason)

        async def logged():
            try:
                await finish()
            except Exception as e:
                self.log.error(
                    "Server %s: its cancelled start did not give back its GPUs or its place in the "
                    "queue (%s); a place ends at the queue's keepalive, GPUs at the server's next start",
                    self._log_name,
                    e,
                )

        task = self._gpuhub_cleanup = asyncio.ensure_future(logged())
        _RUNNING.add(task)
        task.add_done_callback(_RUNNING.discard)

    async def _settle_cancelled(self) -> None:
        """Wait until a cancelled start of this server has given back what it got."""
        task = self._gpuhub_cleanup
        if task is not None:
            await asyncio.shield(task)
            self._gpuhub_cleanup = None

    async def _wait_in_queue(self, entry) -> AllocationInfo:
        """Wait in the queue, showing the place and expected start on the spawn page, until
        the ledger grants the GPUs; a stop (the page's button, an admin) leaves the queue."""
        self.queue_entry_id = entry.id
        poll = self.gpuhub.queue_poll_seconds
        shown = None
        asking = None  # the ledger's answer to this waiter's question, while it is worked out
        try:
            while True:
                if entry.state == "left":
                    raise policy.Refusal(
                        waitline.left_message(entry.amount, entry.end_reason), reason="left_queue"
                    )
                line = entry.line(utcnow())
                if line != shown:
                    self._progress(
                        waitline.queue_progress(entry.position, entry.waiting),
                        line,
                        heading=waitline.queue_heading(entry.position, entry.waiting),
                        position=entry.position,
                        waiting=entry.waiting,
                    )
                    shown = line
                if self._gpuhub_stopped:
                    raise asyncio.CancelledError()
                # the hub's one poller asks for every waiting start at once, each poll
                asking = poller_for(self.ledger, poll).ask(entry.id)
                got = await asyncio.shield(asking)
                if self._gpuhub_stopped and got.allocation is None:
                    raise asyncio.CancelledError()
                asking = None
                if got.allocation is not None:
                    if self._gpuhub_stopped:  # stopped while the grant was written
                        await self._in_ledger("release", got.allocation.id, STOPPED_WAITING)
                        raise asyncio.CancelledError()
                    waited = (got.allocation.created - entry.created).total_seconds()
                    self._progress(
                        52,
                        f"Your turn came after {waited:.0f} s in the queue",
                        heading="Your GPUs are free: your server is starting up",
                    )
                    return got.allocation
                entry = got.entry
        except asyncio.CancelledError:
            # JupyterHub cancels the start when the server is stopped (the spawn page's stop
            # button, an admin) and never calls stop() for a server that has no process yet;
            # an ask in flight may still be granted: what it books is given back
            self._give_back_later(STOPPED_WAITING, asking, entry.id)
            raise
        except Exception:
            await asyncio.shield(
                asyncio.ensure_future(
                    self._in_ledger("leave_queue", entry.id, "the spawn failed while it waited")
                )
            )
            raise
        finally:
            self.queue_entry_id = 0
