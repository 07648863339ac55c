"""Writes that wait for the writer's turn together commit together (a part of :class:`Ledger`).

A hub or a broker makes its ledger calls from a pool of threads (``asyncio.to_thread``), so
under load several of its writes wait for the writer's turn at once. Made one by one, each
takes the turn, begins, counts up the lock row, commits and records its GPU moves: on
PostgreSQL five round trips, on SQLite a third of an admission's time, before it decides
anything. Instead the first of them to get the turn (the leader) makes every write of this
process waiting by then, in the order they asked, in one transaction: each decision still
sees every earlier one (same session, same lock), and one commit makes them all durable at
once, so nobody is told "yes" before the database has it. A write that raises (a refusal,
a lost connection) rolls the transaction back; the writes before it are made again in one
transaction, the failing one alone (what it raises then is its caller's answer), and those
after it again together: every caller gets what it would have got alone, in the same order.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session

MAX_BATCH = 64  # writes made in one transaction at most (a longer turn delays readers' news)


class _Write:
    __slots__ = ("done", "error", "fn", "value")

    def __init__(self, fn: Callable[[Session], Any]):
        self.fn, self.done, self.value, self.error = fn, False, None, None


class _Failed(Exception):
    def __init__(self, index: int):
        self.index = index


def carry_flags(info: dict, start: dict) -> None:
    """Set the flags the next write of one transaction starts with (``info``: the session's,
    after a write; ``start``: what the lock row said at the transaction's start).

    A write consumes (pops) a flag when it acts on it: "a lease is due" is then answered
    (the leases due at the start are ended), "someone waits" stays what it was at the start
    unless a write of this transaction queued a request. A flag not consumed stays as it is."""
    if "leases_due" not in info:
        info["leases_due"] = False
    queued = info.pop("queued", False)
    start["waiting"] = start["waiting"] or queued
    if "waiting" not in info or queued:
        info["waiting"] = start["waiting"]


class CombinedWrites:
    """``_write(fn)``: ``fn(session)`` in a writing transaction, shared with the other writes
    of this process that wait at the same moment."""

    def _init_combined(self) -> None:
        self._waiting_writes: deque[_Write] = deque()
        self._queued_lock = threading.Lock()
        self._leader = threading.Lock()
        # writes "combined" (made in one transaction with others) and "made again" (their turn
        # was rolled back by another's error): what the tests and benchmarks read
        self.write_counts: Counter[str] = Counter()

    def _write(self, fn: Callable[[Session], Any]) -> Any:
        w = _Write(fn)
        with self._queued_lock:
            self._waiting_writes.append(w)
        while not w.done:
            with self._leader:
                if w.done:
                    break
                with self._queued_lock:
                    n = min(len(self._waiting_writes), MAX_BATCH)
                    batch = [self._waiting_writes.popleft() for _ in range(n)]
                try:
                    self._make(batch)
                finally:  # never leave a caller waiting for a write nobody will make
                    for lost in batch:
                        if not lost.done:
                            lost.error = RuntimeError("the ledger's write was interrupted before it was made")
                            lost.done = True
        if w.error is not None:
            raise w.error
        return w.value

    def _make(self, batch: list[_Write]) -> None:
        """Make ``batch``'s writes, in order; every one ends done, with its value or error."""
        if not batch:
            return
        if len(batch) == 1:
            w = batch[0]
            try:
                with self._tx() as s:
                    w.value = w.fn(s)
            except BaseException as e:  # the caller raises it, in its own thread
                w.error = e
            w.done = True
            return
        values: list[Any] = []
        try:
            with self._tx() as s:
                start = {"waiting": bool(s.info.get("waiting", True))}
                changed = False
                for i, w in enumerate(batch):
                    s.info.pop("changed", None)
                    try:
                        values.append(w.fn(s))
                    except BaseException as e:
                        raise _Failed(i) from e
                    changed = changed or s.info.pop("changed", True)
                    carry_flags(s.info, start)
                s.info["changed"] = changed
        except _Failed as f:  # rolled back: each caller gets what it would have got alone
            self.write_counts["made again"] += len(batch) - 1
            self._make(batch[: f.index])
            self._make([batch[f.index]])
            self._make(batch[f.index + 1 :])
            return
        except BaseException:  # the commit failed: nothing of it was written
            self.write_counts["made again"] += len(batch)
            for w in batch:
                self._make([w])
            return
        self.write_counts["combined"] += len(batch)
        for w, value in zip(batch, values, strict=True):
            w.value, w.done = value, True
