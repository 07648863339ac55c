"""Waiting in gpuhub's queue from a notebook: the magics' side of ``POST allocations`` with
``"wait": true``.

The broker answers 202 with the queue entry when the GPUs are all taken; the kernel then
asks ``POST queue/{id}/wait`` every ``poll`` seconds (which also keeps the entry alive)
and shows the entry's line, updated in place in the cell's output ("2nd of 3 waiting for 2
GPUs, expected start about 14:20 ..."). Its turn comes as the allocation. Ctrl-C (the stop
button) leaves the queue; if the turn came at that moment, the GPUs just granted are
released: either way nothing is held, and the cell says so.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gpu_magics.common.words import count
from gpu_magics.kernel.broker import BrokerClient, BrokerError
from gpu_magics.kernel.outcome import DistributedInterrupt


class QueueInterrupt(DistributedInterrupt):
    """The stop button while waiting in the queue, shown as one plain report."""


QueueInterrupt.__name__ = QueueInterrupt.__qualname__ = "KeyboardInterrupt"  # as notebooks name it


class LineDisplay:
    """One line of the cell's output, replaced in place (a print outside a kernel)."""

    def __init__(self):
        self.handle = None

    def show(self, text: str) -> None:
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:  # pragma: no cover - the magics always run in IPython
            get_ipython = None
        if get_ipython is None or get_ipython() is None:
            print(text, flush=True)
            return
        data = {"text/plain": text}
        if self.handle is None:
            self.handle = display(data, raw=True, display_id=True)
        else:
            self.handle.update(data, raw=True)


def wait_for_turn(
    client: BrokerClient,
    queued: dict,
    *,
    magic: str,
    poll: float = 1.0,
    show: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> dict:
    """Wait until the queue grants ``queued`` (the broker's entry); returns the allocation.

    Raises :class:`QueueInterrupt` on Ctrl-C (having left the queue) and ``BrokerError``
    when the entry left the queue for another reason (the reason is its message)."""
    show = show or LineDisplay().show
    entry = queued
    shown = None
    try:
        while True:
            if entry["state"] == "left":
                raise BrokerError(409, f"the request left the queue: {entry['end_reason']}", "left_queue")
            line = f"{magic}: {entry['line']}"
            if line != shown:
                show(line)
                shown = line
            sleep(poll)
            got = client.wait_turn(entry["id"])
            if got["allocation"] is not None:
                show(f"{magic}: your turn came after {got['entry']['waited_seconds']:.0f} s in the queue")
                return got["allocation"]
            entry = got["entry"]
    except KeyboardInterrupt:  # the line stays as it was; the report says what happened
        raise QueueInterrupt(leave(client, entry, magic)) from None


def leave(client: BrokerClient, entry: dict, magic: str) -> str:
    """Leave the queue, giving back GPUs granted at that very moment; the report to show."""
    what = count(entry["gpus"], "GPU")
    try:
        client.leave_queue(entry["id"])
        return f"{magic} stopped while waiting in the queue for {what}: it left the queue; nothing is held."
    except BrokerError as e:
        if e.status != 409:
            return (
                f"{magic} stopped while waiting for {what}, but the queue could not be told ({e.message}); "
                "the entry leaves it by itself once nobody asks about it (c.GpuHub.queue_keepalive_seconds)."
            )
    # no longer waiting: granted just now (then release it) or already gone
    try:
        now = client.queue_entry(entry["id"])
    except BrokerError:
        now = {}
    if now.get("allocation_id"):
        client.release(now["allocation_id"])
        return (
            f"{magic} stopped just as its turn came: the {what} it was given are released; nothing is held."
        )
    return (
        f"{magic} stopped while waiting for {what}: the entry had left the queue "
        f"({now.get('end_reason')}); nothing is held."
    )
