"""One poller for every start of a hub that waits in gpuhub's queue.

Each waiting start asks the ledger every ``c.GpuHub.queue_poll_seconds`` whether its turn has
come (``Ledger.wait_turn``). Asked one by one, in a worker thread each, a class-start storm's
hundred waiters made a hundred ledger reads a second, and the hub's own API answered in
seconds (``docs/reliability.md``). Here the asks of one round go to the ledger together
(``Ledger.wait_turns``: one read for those that simply wait on), once per poll, in one thread;
each waiter gets its own answer, as it would have alone.
"""

from __future__ import annotations

import asyncio

from spawner.policy.records import Admission

_POLLERS: dict[tuple[int, str], QueuePoller] = {}  # (event loop, ledger URL): its poller


class QueuePoller:
    def __init__(self, ledger, poll_seconds: float):
        self.ledger = ledger
        self.poll_seconds = poll_seconds
        self.asks: dict[int, list[asyncio.Future]] = {}
        self.task: asyncio.Task | None = None

    def ask(self, entry_id: int) -> asyncio.Future:
        """The ledger's answer for ``entry_id`` (an ``Admission``) at the next round, within
        ``poll_seconds``; the future holds the error where that entry's ask raised."""
        answer = asyncio.get_running_loop().create_future()
        self.asks.setdefault(entry_id, []).append(answer)
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._rounds())
        return answer

    async def _rounds(self) -> None:
        while self.asks:
            await asyncio.sleep(self.poll_seconds)
            asks, self.asks = self.asks, {}
            try:
                answers = await asyncio.to_thread(self.ledger.wait_turns, list(asks))
            except Exception as e:  # the ledger could not be read at all: every ask's error
                answers = dict.fromkeys(asks, e)
            for entry_id, futures in asks.items():
                got = answers.get(entry_id, LookupError(f"queue entry {entry_id} was not answered"))
                for f in futures:
                    if f.done():
                        continue
                    if isinstance(got, Admission):
                        f.set_result(got)
                    else:
                        f.set_exception(got)


def poller_for(ledger, poll_seconds: float) -> QueuePoller:
    """This hub's poller of ``ledger`` (one per event loop and ledger)."""
    key = (id(asyncio.get_running_loop()), ledger.url)
    poller = _POLLERS.get(key)
    if poller is None or poller.ledger is not ledger:
        poller = _POLLERS[key] = QueuePoller(ledger, poll_seconds)
    poller.poll_seconds = poll_seconds
    return poller
