"""The server extension behind gpuhub's JupyterLab extension: ``gpuhub/api/...`` on the
user's own server, behind JupyterHub's login (only the server's owner, and admins with access
to it, reach it; the browser never holds a broker token).

It asks the broker with the server's own token (``$JUPYTERHUB_API_TOKEN``, whose scopes are
its user's allocations only) and keeps the answer for ``GPUHUB_LAB_CACHE_SECONDS`` (2 s): every
open tab polls this server, and the broker is asked once per period whatever the number of
tabs. Routes:

- ``GET gpuhub/api/status``: :func:`gpu_magics.lab.status.document`, or ``{"available":
  false, "reason": ...}`` while the broker cannot be asked;
- ``POST gpuhub/api/allocations/{id}/release``: give back a ``%%distributed`` burst of this
  server (never the server's own GPUs: stopping the server does that);
- ``POST gpuhub/api/allocations/{id}/extend`` (``{"hours": N}``): more time for this server or
  one of its bursts, as the broker allows (``c.GpuHub.extension_max_hours``);
- ``DELETE gpuhub/api/queue/{id}``: leave the queue.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import UTC, datetime

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from gpu_magics.common import poolstatus
from gpu_magics.kernel.broker import BrokerClient, BrokerError
from gpu_magics.lab import status


class StatusCache:
    """The broker's answers for this server, fetched at most once per ``max_age`` seconds."""

    def __init__(
        self,
        client: BrokerClient | None,
        server_name: str,
        max_age: float = 2.0,
        clock=time.monotonic,
        runtime_dir: str | None = None,
    ):
        self.client, self.server_name, self.max_age, self.clock = client, server_name, max_age, clock
        self.runtime_dir = runtime_dir  # where this user's kernels say what their pools are
        self._doc: dict | None = None
        self._at = -1e18
        self._lock = asyncio.Lock()
        self._waiting: dict[int, dict] = {}  # queue entries seen waiting (their end is told)
        self._ended: dict[int, tuple[float, dict]] = {}  # entries seen to end, and when
        self.fetches = 0  # how often the broker was asked (the tests count it)
        base = os.environ.get("JUPYTERHUB_BASE_URL", "/")
        pages = os.environ.get("GPUHUB_PAGES_PATH")
        self.pages = url_path_join(base, pages) if pages else None  # My GPUs

    async def get(self) -> dict:
        async with self._lock:  # tabs asking at once share one fetch
            if self._doc is None or self.clock() - self._at >= self.max_age:
                self._doc = await asyncio.to_thread(self._fetch)
                self._at = self.clock()
            return self._doc

    def invalidate(self) -> None:
        self._doc = None

    def _fetch(self) -> dict:
        if self.client is None:
            return status.unavailable("this server has no gpuhub broker (GPUHUB_BROKER_URL is not set)")
        self.fetches += 1
        try:
            me = self.client.me()
            util = self.client.utilization()
            queue = self.client.queue().get("queue", [])
            self._follow(queue)
        except BrokerError as e:
            return status.unavailable(e.message)
        now = datetime.now(UTC).replace(tzinfo=None)
        ended = [e for _, e in self._ended.values()]
        pools = poolstatus.read_all(self.runtime_dir) if self.runtime_dir else []
        doc = status.document(me, util, queue, ended, self.server_name, now, pools)
        return doc | {"my_gpus": self.pages}

    def _follow(self, queue: list[dict]) -> None:
        """Remember this server's waiting entries; one gone from the queue is asked about
        once (granted, or ended with its reason) and told for a while."""
        now = self.clock()
        waiting = {q["id"]: q for q in queue if q.get("server_name", "") == self.server_name}
        for entry_id in set(self._waiting) - set(waiting):
            try:
                entry = self.client.queue_entry(entry_id)
            except BrokerError as e:
                if e.status != 404:
                    raise
                entry = {"id": entry_id, "state": "ended", "end_reason": "it is no longer in the queue"}
            entry.setdefault("gpus", self._waiting[entry_id].get("gpus"))
            self._ended[entry_id] = (now, entry)
        self._waiting = waiting
        for entry_id, (at, _) in list(self._ended.items()):
            if now - at > status.RECENT_SECONDS:
                del self._ended[entry_id]


class _Handler(APIHandler):
    @property
    def cache(self) -> StatusCache:
        return self.settings["gpuhub_lab_cache"]

    def answer(self, code: int, body: dict) -> None:
        self.set_status(code)
        self.finish(json.dumps(body))

    async def broker_call(self, fn, *args) -> None:
        if self.cache.client is None:
            return self.answer(503, {"message": "this server has no gpuhub broker"})
        try:
            result = await asyncio.to_thread(fn, *args)
        except BrokerError as e:
            code = e.status if 400 <= e.status < 600 else 502
            return self.answer(code, {"message": e.message, "reason": e.reason})
        self.cache.invalidate()
        self.answer(200, result or {})

    async def doc_or_refuse(self) -> dict | None:
        """The status an action checks its allocation against; None (and a 503 sent) while the
        broker cannot be asked: then nothing is known to be this server's."""
        doc = await self.cache.get()
        if not doc.get("available"):
            self.answer(503, {"message": f"GPU status unavailable: {doc.get('reason', '')}"})
            return None
        return doc


class StatusHandler(_Handler):
    @web.authenticated
    async def get(self):
        self.finish(json.dumps(await self.cache.get()))


class ReleaseHandler(_Handler):
    @web.authenticated
    async def post(self, allocation_id: str):
        if (doc := await self.doc_or_refuse()) is None:
            return
        bursts = {p["id"] for p in doc.get("pools", ())}
        if int(allocation_id) not in bursts:
            own = doc.get("server") and doc["server"]["id"] == int(allocation_id)
            why = (
                "this is the server's own allocation: stop the server from the hub's home page"
                if own
                else f"allocation {allocation_id} is not a %%distributed burst of this server"
            )
            return self.answer(404 if not own else 400, {"message": why})
        await self.broker_call(self.cache.client.release, int(allocation_id))


class ExtendHandler(_Handler):
    @web.authenticated
    async def post(self, allocation_id: str):
        if (doc := await self.doc_or_refuse()) is None:
            return
        mine = {p["id"] for p in doc.get("pools", ())} | (
            {doc["server"]["id"]} if doc.get("server") else set()
        )
        if int(allocation_id) not in mine:
            return self.answer(404, {"message": f"allocation {allocation_id} is not this server's"})
        try:
            hours = float(json.loads(self.request.body or b"{}").get("hours"))
        except (TypeError, ValueError, AttributeError):
            return self.answer(400, {"message": 'send {"hours": N}: how many hours more'})
        await self.broker_call(self.cache.client.extend, int(allocation_id), hours)


class LeaveQueueHandler(_Handler):
    @web.authenticated
    async def delete(self, entry_id: str):
        await self.broker_call(self.cache.client.leave_queue, int(entry_id))


def setup(serverapp) -> None:
    web_app = serverapp.web_app
    base = web_app.settings["base_url"]
    url, token = os.environ.get("GPUHUB_BROKER_URL"), os.environ.get("JUPYTERHUB_API_TOKEN")
    cache = StatusCache(
        BrokerClient(url, token, timeout=5) if url and token else None,  # a hung broker: a few s
        os.environ.get("JUPYTERHUB_SERVER_NAME", ""),
        max_age=float(os.environ.get("GPUHUB_LAB_CACHE_SECONDS", "2")),
        runtime_dir=serverapp.runtime_dir,
    )
    web_app.settings["gpuhub_lab_cache"] = cache
    ident = r"(\d{1,18})"
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "gpuhub/api/status"), StatusHandler),
            (url_path_join(base, f"gpuhub/api/allocations/{ident}/release"), ReleaseHandler),
            (url_path_join(base, f"gpuhub/api/allocations/{ident}/extend"), ExtendHandler),
            (url_path_join(base, f"gpuhub/api/queue/{ident}"), LeaveQueueHandler),
        ],
    )
