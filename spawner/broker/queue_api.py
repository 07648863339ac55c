"""The queue in the broker's REST API (``openapi.yaml``): what waits for GPUs.

- ``GET queue``: the waiting entries in the queue's order, with place, expected start and
  fair-share factors: every user's for an admin, the caller's own otherwise.
- ``GET queue/{id}``, ``DELETE queue/{id}``: one entry; leave the queue (the owner) or
  cancel it (an admin).
- ``POST queue/{id}/wait``: the waiter's poll (the magics call it every
  ``c.GpuHub.queue_poll_seconds``): keeps the entry alive and, when its turn has come,
  books the GPUs and answers the allocation.
- ``POST queue/{id}/front``: an admin moves an entry ahead of every other.
"""

from __future__ import annotations

from tornado import web

from spawner.broker import access
from spawner.broker import responses as views
from spawner.broker.handlers import APIHandler
from spawner.ledger import utcnow


class _QueueHandler(APIHandler):
    async def find_entry(self, entry_id: str):
        """The caller and the entry, or 404: another user's is not even confirmed to exist."""
        caller = self.require_caller()
        q = await self.broker.run(self.broker.ledger.queue_entry, int(entry_id))
        if q is None or not access.may_see(caller, q.user):
            raise web.HTTPError(404, f"No queue entry {entry_id} of yours.")
        return caller, q


class QueueHandler(_QueueHandler):
    async def get(self):
        who = self.whose("queue entries")
        entries = await self.broker.run(self.broker.ledger.queue, who)
        now = utcnow()
        self.finish({"queue": [views.queue_json(q, now) for q in entries]})


class QueueEntryHandler(_QueueHandler):
    async def get(self, entry_id: str):
        _caller, q = await self.find_entry(entry_id)
        self.finish(views.queue_json(q, utcnow()))

    async def delete(self, entry_id: str):
        caller, q = await self.find_entry(entry_id)
        why = (
            "its owner left the queue" if caller.name == q.user else f"an admin ({caller.name}) cancelled it"
        )
        if not await self.broker.run(self.broker.ledger.leave_queue, q.id, why):
            q = await self.broker.run(self.broker.ledger.queue_entry, q.id)
            return self.fail(409, f"Queue entry {q.id} no longer waits ({q.end_reason}).", "not_waiting")
        self.finish(views.queue_json(await self.broker.run(self.broker.ledger.queue_entry, q.id), utcnow()))


class QueueWaitHandler(_QueueHandler):
    async def post(self, entry_id: str):
        caller, q = await self.find_entry(entry_id)
        if caller.name != q.user:
            raise web.HTTPError(403, "Only the entry's owner waits in it.")
        got = await self.broker.run(self.broker.ledger.wait_turn, q.id)
        allocation = None if got.allocation is None else self.allocation_json(got.allocation)
        self.finish({"entry": views.queue_json(got.entry, utcnow()), "allocation": allocation})


class QueueFrontHandler(_QueueHandler):
    async def post(self, entry_id: str):
        caller, q = await self.find_entry(entry_id)
        if not access.is_admin(caller):
            raise web.HTTPError(403, "This needs the custom:gpuhub:admin scope.")
        try:
            await self.broker.run(self.broker.ledger.move_to_front, q.id)
        except LookupError:
            return self.fail(409, f"Queue entry {q.id} no longer waits ({q.end_reason}).", "not_waiting")
        self.finish(views.queue_json(await self.broker.run(self.broker.ledger.queue_entry, q.id), utcnow()))
