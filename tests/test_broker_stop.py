"""The broker's stop (SIGTERM: a hub restart stops its services) lets the requests in flight
finish before the ledger closes, and a request its own stop breaks answers 503 (try again),
not 500. A real Tornado server of the broker's handlers; the soak found a limit change
answered 500 as the hub restarted."""

from __future__ import annotations

import asyncio
import json

from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port
from tornado.web import Application

from spawner.broker.handlers import APIHandler, Broker


class Slow(APIHandler):
    """A request that waits for the test, then fails or answers."""

    async def prepare(self):
        self.count_in()  # as BaseHandler.prepare, without the hub login

    async def get(self, what):
        await self.application.settings["go"].wait()
        if what == "fail":
            raise RuntimeError("the ledger was closed")
        self.finish({"ok": True})


async def test_a_stopping_broker_finishes_what_is_in_flight_and_says_503_for_what_its_stop_broke():
    broker = Broker(None, None, None, "http://127.0.0.1:1/hub/api", "token", "/services/gpuhub/")
    go = asyncio.Event()
    app = Application([(r"/(ok|fail)", Slow, {"broker": broker})], go=go)
    sock, port = bind_unused_port()
    server = HTTPServer(app)
    server.add_sockets([sock])
    client = AsyncHTTPClient()
    try:
        calls = [
            asyncio.ensure_future(client.fetch(f"http://127.0.0.1:{port}/{w}", raise_error=False))
            for w in ("ok", "fail")
        ]
        while broker.in_flight < 2:
            await asyncio.sleep(0.01)
        broker.stopping = True
        server.stop()  # as the broker's stop: no new requests
        assert not await broker.drained(0.2)  # both still in flight
        go.set()
        assert await broker.drained(5) and broker.in_flight == 0
        ok, failed = [await c for c in calls]
        assert ok.code == 200
        assert failed.code == 503, failed.body
        assert json.loads(failed.body)["message"] == "The GPU service is restarting; try again in a moment."
        # not stopping: the same failure is the broker's own, a 500
        broker.stopping = False
        sock2, port2 = bind_unused_port()
        server2 = HTTPServer(app)
        server2.add_sockets([sock2])
        failed = await client.fetch(f"http://127.0.0.1:{port2}/fail", raise_error=False)
        assert failed.code == 500 and b"Internal error in the gpuhub broker" in failed.body
        server2.stop()
    finally:
        server.stop()
