"""What the broker has heard about GPU use: a short per-GPU history and one
:class:`spawner.policy.idle.Watch` per live allocation. In memory: a restarted broker starts every
idle clock again, which can only delay a reclaim, never hasten one.

Readings are *decisive* (they move the idle clocks, and the grid shows them) or the owner's
own (kept per GPU in ``reported`` for the owner's view, deciding nothing): with
``c.GpuReclaim.readings = "sampler"`` only gpuhub's sampler, which the user cannot write to,
is decisive (:mod:`.sampling`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from spawner.policy.idle import Verdict, Watch, after_activity, after_samples
from spawner.policy.records import AllocationInfo


@dataclass(frozen=True)
class Reading:
    t: float
    utilization: float
    memory_used_mib: int
    memory_total_mib: int | None


@dataclass(frozen=True)
class Sample:
    node: str
    index: int
    utilization: float
    memory_used_mib: int
    memory_total_mib: int | None
    power_watts: float | None = None  # the board's draw now (None: not read)
    energy_mj: int | None = None  # NVML's total-energy counter, millijoules since the driver loaded


def epoch(t: datetime) -> float:
    return t.replace(tzinfo=UTC).timestamp()


def rate_wait(times: deque[float], now: float, limit: int, window: float = 60.0) -> float:
    """Seconds until one more event fits ``limit`` per ``window`` (0: it fits now, and is
    counted). ``times`` holds the counted events' times, oldest first."""
    while times and times[0] <= now - window:
        times.popleft()
    if len(times) >= limit:
        return times[0] + window - now
    times.append(now)
    return 0.0


class Utilization:
    """Bounded: per GPU, one reading per ``min_interval`` (a faster reporter's readings replace
    the last one) for ``history_seconds``; per allocation, ``reports_per_gpu_minute`` reports
    per GPU it holds (``admit``)."""

    def __init__(
        self,
        history_seconds: float = 3600.0,
        clock: Callable[[], float] = time.time,
        min_interval: float = 1.0,
        reports_per_gpu_minute: int = 600,
    ):
        self.history_seconds = history_seconds
        self.clock = clock
        self.min_interval = min_interval
        self.reports_per_gpu_minute = reports_per_gpu_minute
        self.gpus: dict[tuple[str, int], deque[Reading]] = {}
        self.reported: dict[tuple[str, int], deque[Reading]] = {}  # owners' own, when not decisive
        self.watches: dict[int, Watch] = {}
        self.verdicts: dict[int, Verdict] = {}
        self.reports: dict[int, deque[float]] = {}

    def admit(self, a: AllocationInfo) -> float:
        """0 when one more report of ``a`` is within its rate, else the seconds to wait."""
        limit = self.reports_per_gpu_minute * max(1, a.gpu_count, len(a.gpus))
        return rate_wait(self.reports.setdefault(a.id, deque()), self.clock(), limit)

    def watch(self, a: AllocationInfo) -> Watch:
        w = self.watches.get(a.id)
        gpus = max(a.gpu_count, len(a.gpus))
        if w is None or w.gpus != gpus:  # a queued Slurm job's GPUs arrive later
            started = epoch(a.started or a.created)
            w = Watch(a.id, a.user, a.purpose, gpus, started) if w is None else replace(w, gpus=gpus)
            self.watches[a.id] = w
        return w

    def add_samples(
        self,
        a: AllocationInfo,
        samples: Iterable[Sample],
        threshold: float,
        stale_after: float,
        decisive: bool = True,
    ) -> Watch:
        """Store ``samples`` of ``a``'s GPUs; decisive ones also move ``a``'s idle clock."""
        samples = list(samples)
        self.record(samples, decisive)
        if not decisive:
            return self.watch(a)
        busy = any(s.utilization >= threshold for s in samples)
        w = after_samples(self.watch(a), busy, self.clock(), stale_after)
        self.watches[a.id] = w
        return w

    def record(self, samples: Iterable[Sample], decisive: bool = True) -> None:
        """Add readings to their GPUs' histories (no allocation's clock moves)."""
        now = self.clock()
        histories = self.gpus if decisive else self.reported
        for s in samples:
            history = histories.setdefault((s.node, s.index), deque())
            reading = Reading(now, s.utilization, s.memory_used_mib, s.memory_total_mib)
            if len(history) > 1 and history[-1].t - history[-2].t < self.min_interval:
                history[-1] = reading  # the newest is provisional until min_interval after the last
            else:
                history.append(reading)
            while history and history[0].t < now - self.history_seconds:
                history.popleft()

    def add_activity(self, a: AllocationInfo, idle_seconds: float) -> Watch:
        w = after_activity(self.watch(a), idle_seconds, self.clock())
        self.watches[a.id] = w
        return w

    def warn(self, allocation_id: int) -> None:
        w = self.watches.get(allocation_id)
        if w is not None:
            self.watches[allocation_id] = replace(w, warned_at=self.clock())

    def latest(
        self, node: str, index: int, fresh_for: float, since: float = 0.0, reported: bool = False
    ) -> Reading | None:
        """The last (decisive, or the owner's ``reported``) reading if fresh, and taken ``since``
        (a holder's start: never the last holder's)."""
        history = (self.reported if reported else self.gpus).get((node, index))
        if not history or self.clock() - history[-1].t > fresh_for or history[-1].t < since:
            return None
        return history[-1]

    def history(self, node: str, index: int, since: float = 0.0) -> list[Reading]:
        return [r for r in self.gpus.get((node, index), ()) if r.t >= since]

    def mean(self, gpus: Iterable[tuple[str, int]], since: float) -> float | None:
        """Mean utilization of these GPUs' readings since ``since`` (None: no reading)."""
        values = [r.utilization for key in gpus for r in self.gpus.get(key, ()) if r.t >= since]
        return sum(values) / len(values) if values else None

    def forget(self, live_ids: set[int]) -> None:
        """Drop what is known about allocations that ended (their GPUs' history stays)."""
        for ident in (set(self.watches) | set(self.reports)) - live_ids:
            self.watches.pop(ident, None)
            self.verdicts.pop(ident, None)
            self.reports.pop(ident, None)
