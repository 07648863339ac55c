"""A kernel of a user's server, driven the way JupyterLab drives it: the server's REST API and
the kernel's websocket (``/user/<name>/api/kernels/<id>/channels``), both through the hub's
proxy. The test never touches the kernel's ZeroMQ ports, which listen on the loopback of the
node the server runs on (a network namespace of the Slurm test cluster: unreachable from here).

:class:`WsKernelClient` offers the part of jupyter_client's ``BlockingKernelClient`` the
tests use (``execute``, ``execute_interactive``, ``get_shell_msg``, ``get_iopub_msg``,
``wait_for_ready``, ``stop_channels``), so :func:`tests.kerneltools.run_cell` works on it.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from datetime import UTC, datetime

from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect


class WsKernelClient:
    def __init__(self, hub, user: str, kernel_id: str):
        self.kernel_id = kernel_id
        self.session = uuid.uuid4().hex
        self.queues = {"shell": queue.Queue(), "iopub": queue.Queue(), "control": queue.Queue(),
                       "stdin": queue.Queue()}  # fmt: skip
        ws_url = hub.url.replace("http://", "ws://", 1) + f"/user/{user}/api/kernels/{kernel_id}/channels"
        self._request = HTTPRequest(
            f"{ws_url}?session_id={self.session}",
            headers={"Authorization": f"token {hub.token}"},
            connect_timeout=30,
        )
        self._loop = asyncio.new_event_loop()
        self._ws = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="ws-kernel")
        self._thread.start()
        self._ws = asyncio.run_coroutine_threadsafe(self._connect(), self._loop).result(timeout=60)

    async def _connect(self):
        ws = await websocket_connect(self._request)
        self._loop.create_task(self._read(ws))
        return ws

    async def _read(self, ws) -> None:
        while True:
            raw = await ws.read_message()
            if raw is None:  # closed
                self._closed.set()
                return
            if isinstance(raw, bytes):  # binary frames carry buffers: not used by these tests
                continue
            msg = json.loads(raw)
            self.queues.get(msg.get("channel", "shell"), self.queues["shell"]).put(msg)

    # the BlockingKernelClient subset ------------------------------------------------------

    def _send(self, channel: str, msg_type: str, content: dict) -> str:
        msg_id = uuid.uuid4().hex
        msg = {
            "header": {
                "msg_id": msg_id, "msg_type": msg_type, "session": self.session, "username": "",
                "date": datetime.now(UTC).isoformat(), "version": "5.3",
            },
            "parent_header": {}, "metadata": {}, "content": content, "channel": channel, "buffers": [],
        }  # fmt: skip
        self._loop.call_soon_threadsafe(self._ws.write_message, json.dumps(msg))
        return msg_id

    def execute(self, code: str, silent: bool = False, store_history: bool = True) -> str:
        return self._send(
            "shell",
            "execute_request",
            {"code": code, "silent": silent, "store_history": store_history, "user_expressions": {},
             "allow_stdin": False, "stop_on_error": True},
        )  # fmt: skip

    def get_shell_msg(self, timeout: float | None = None) -> dict:
        return self._get("shell", timeout)

    def get_iopub_msg(self, timeout: float | None = None) -> dict:
        return self._get("iopub", timeout)

    def _get(self, channel: str, timeout: float | None) -> dict:
        try:
            return self.queues[channel].get(timeout=timeout)
        except queue.Empty:
            closed = self._closed.is_set()
            raise queue.Empty(f"no {channel} message in {timeout} s (websocket closed: {closed})") from None

    def wait_for_ready(self, timeout: float = 60) -> None:
        """A kernel_info reply has come back (the kernel answers its shell channel)."""
        deadline = time.monotonic() + timeout
        msg_id = self._send("shell", "kernel_info_request", {})
        while True:
            msg = self.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") == msg_id:
                return

    def execute_interactive(self, code: str, timeout: float | None = None, output_hook=None) -> dict:
        """Run ``code``; every iopub message of it goes to ``output_hook`` until the kernel is
        idle again; returns the execute reply (as jupyter_client's does)."""
        msg_id = self.execute(code)
        deadline = None if timeout is None else time.monotonic() + timeout

        def left():
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        while True:
            msg = self.get_iopub_msg(timeout=left())
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
            if output_hook is not None:
                output_hook(msg)
        while True:
            reply = self.get_shell_msg(timeout=left())
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply

    def stop_channels(self) -> None:
        if self._ws is not None:
            self._loop.call_soon_threadsafe(self._ws.close)
            self._closed.wait(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def server_kernel(hub, user: str, kernel: str = "python3-gpus") -> tuple[WsKernelClient, str]:
    """A new kernel of ``user``'s running server (as JupyterLab starts one), connected through
    the proxy and ready: (client, kernel id). The caller stops its channels."""
    r = hub.api_url_request("POST", f"/user/{user}/api/kernels", json={"name": kernel})
    assert r.status_code == 201, r.text
    kid = r.json()["id"]
    kc = WsKernelClient(hub, user, kid)
    kc.wait_for_ready(timeout=60)
    return kc, kid
