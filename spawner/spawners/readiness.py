"""Seeing at once that a started server answers.

JupyterHub waits for a started server with exponential back-off and full jitter (each pause
drawn from 0-0.2 s, then 0-0.4 s, 0-0.8 s, ... up to 5 s), so a server that answers 2 s
after its start is seen up to 1.5 s later. gpuhub's spawners wait themselves, asking the
server every ``c.Spawner.ready_poll_seconds`` (a refused connection costs nothing; once the
server listens, one request waits for its answer), before they hand it to JupyterHub, whose
own wait then succeeds at its first try. The rule is JupyterHub's: any answer below 500, at
the server's ``api`` URL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import aiohttp

ANSWERED, GONE, TIMEOUT = "answered", "gone", "timeout"


def probe_url(started, proto: str, base_url: str) -> str:
    """The URL JupyterHub's own wait asks: what ``start()`` returned (a URL or ``(ip, port)``)
    with the server's base URL and ``api``."""
    if isinstance(started, tuple):
        ip, port = started
        host = f"[{ip}]" if ":" in (ip or "") else (ip or "127.0.0.1")
        root = f"{proto}://{host}:{port}"
    else:
        parts = urlsplit(started)
        root = f"{parts.scheme}://{parts.netloc}"
    path = "/".join(part for part in (base_url.strip("/"), "api") if part)
    return f"{root}/{path}"


def is_answer(status: int) -> bool:
    """JupyterHub's rule: any response but a server error means the server is up."""
    return status < 500


async def wait_answering(
    url: str,
    timeout: float,
    interval: float,
    alive: Callable[[], Awaitable[bool]],
    fetch: Callable[..., Awaitable],
    ssl_context=None,
) -> str:
    """Ask ``url`` every ``interval`` s until it answers (``ANSWERED``), ``alive()`` says the
    server is gone (``GONE``), or ``timeout`` s pass (``TIMEOUT``)."""
    deadline = time.monotonic() + timeout
    extra = {"ssl": ssl_context} if ssl_context is not None else {}
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return TIMEOUT
        try:
            response = await fetch(
                url,
                raise_for_status=False,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=remaining),
                **extra,
            )
        except (aiohttp.ClientError, OSError, TimeoutError):
            pass  # not listening yet
        else:
            response.release()
            if is_answer(response.status):
                return ANSWERED
        if not await alive():
            return GONE
        await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
