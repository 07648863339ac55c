"""A working day on a full machine: gpuhub's fair-share queue against refuse-and-retry, in one run.

    .venv/bin/python benchmarks/queue_day.py [--seed 1] [--seeds 1] [--users 30] [--heavy 4]
        [--gpus 8] [--limit 4] [--hours 24] [--step 1] [--history-days 1]
        [--weight-fairshare 1000] [--weight-age 1000] [--max-age-hours 2]

A seeded generator writes one day's trace: a few heavy users who ask often and run long,
many light ones; arrivals peak in the morning and the afternoon; 1, 2 and sometimes 4 GPUs.
The same trace then runs, in simulated time (the ledger's injected clock, one step a
simulated minute), through two policies, each against a real :class:`spawner.ledger.Ledger`
on its own temporary SQLite file holding one node of ``--gpus`` GPUs:

- **queue** (gpuhub now): ``request(...)``; a request that does not start at once waits,
  and its waiter asks ``wait_turn`` until granted. The hub's waiters ask every second
  (``c.GpuHub.queue_poll_seconds``), far more often than a simulated minute, so each step
  asks every waiting entry, in random order, until a round grants nothing more;
- **retry** (before the queue): ``allocate(...)``, refused with ``no_capacity`` while
  the GPUs are taken; every refused user tries again each simulated minute, in random order
  (whoever retries first wins).

Both: a started run releases its GPUs after its run length (``release``); a user never asks
for more than their limit (``--limit``) lets them hold and wait for together: such a job waits
at the user's side until an own run ends ("held back by own limit"). The wait is from the
trace's request (the user wants to start) to the run's start; "at the ledger" leaves out the
time held back by the user's own limit. A request never started by the end of the day counts
with its wait so far (a lower bound). Before the day, yesterday's
trace (the same users, another draw) is replayed into both ledgers' history, so the fair
share starts from recent use, as on a real machine.

While running, after each step: no GPU held by two allocations, nobody over their limit,
the ledger's live allocations are exactly the runs the simulation started (a broken one fails
loudly); in the queue, a head that waits while enough GPUs are free is reported as a problem.
Also counted: GPU-minutes left free while a waiting request would fit on them (the cost of
conservative backfill's reservations and of run-length guesses), and each ledger call's time.

Prints a table with the ratio queue / retry for each measure.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spawner.ledger import BorrowSettings, Ledger, QueueSettings
from spawner.policy.borrowing import BorrowRules
from spawner.policy.fairshare import Weights
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu

DAY = datetime(2026, 12, 2)  # midnight: minute 0 of the simulated day
NODE = "node0"


class Failure(RuntimeError):
    """An invariant broke: the benchmark stops and says which."""


class Clock:
    """The ledger's clock: simulated minutes from ``DAY``."""

    def __init__(self) -> None:
        self.now = DAY

    def __call__(self) -> datetime:
        return self.now

    def at(self, minute: float) -> None:
        self.now = DAY + timedelta(minutes=minute)


# the trace ----------------------------------------------------------------------------


@dataclass
class Profile:
    name: str
    heavy: bool
    jobs_per_day: float
    run_median_min: float
    run_sigma: float
    sizes: tuple[tuple[int, float], ...]


@dataclass
class Job:
    id: int
    user: str
    arrival: int  # minute of the day
    count: int
    run: int  # minutes
    # what happened (one policy's run)
    submitted: int | None = None
    started: int | None = None
    ended: int | None = None
    allocation: int | None = None
    entry: int | None = None
    left: str | None = None  # the queue ended the entry, with this reason
    expected: int | None = None  # the expected start the queue gave when it was asked (minute)
    expected_sure: str = ""
    # borrowing (the borrow policy): runs on borrowed GPUs may be taken back
    first_started: int | None = None
    done: int = 0  # run minutes saved by earlier, preempted stints
    stints: list[tuple[int, int]] = field(default_factory=list)  # earlier (start, stop), preempted
    borrowed: int = 0  # stints started on borrowed GPUs
    preempted: int = 0
    lost: int = 0  # run minutes lost to preemptions (redone)


def profiles(users: int, heavy: int) -> list[Profile]:
    out = []
    for k in range(users):
        if k < heavy:
            out.append(Profile(f"heavy{k:02d}", True, 4.0, 120.0, 0.6, ((1, 0.3), (2, 0.4), (4, 0.3))))
        else:
            out.append(Profile(f"light{k:02d}", False, 1.5, 40.0, 0.7, ((1, 0.7), (2, 0.25), (4, 0.05))))
    return out


def _poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k += 1
        p *= rng.random()
    return k


def _arrival(rng: random.Random) -> int:
    """A minute of the working day: peaks around 10:30 and 14:30, some spread 07:00-20:00."""
    if rng.random() < 0.7:
        hour = rng.gauss(10.5 if rng.random() < 0.5 else 14.5, 1.5)
    else:
        hour = rng.uniform(7.0, 20.0)
    return int(min(21.0, max(6.0, hour)) * 60)


def trace(seed: int, users: list[Profile], limit: int) -> list[Job]:
    rng = random.Random(seed)
    jobs = []
    for p in users:
        for _ in range(_poisson(rng, p.jobs_per_day)):
            sizes, weights = zip(*p.sizes, strict=True)
            count = min(limit, rng.choices(sizes, weights)[0])
            run = int(min(600, max(5, rng.lognormvariate(math.log(p.run_median_min), p.run_sigma))))
            jobs.append(Job(0, p.name, _arrival(rng), count, run))
    jobs.sort(key=lambda j: (j.arrival, j.user))
    for k, j in enumerate(jobs):
        j.id = k
    return jobs


# one policy's day -----------------------------------------------------------------------


@dataclass
class Day:
    policy: str
    jobs: list[Job]
    wall_s: float = 0.0
    calls: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    idle_fitting_gpu_min: float = 0.0  # free GPU-minutes while a waiting request fits on them
    idle_sliding_gpu_min: float = 0.0  # of which: the head's expected start was now + 5 min
    queued_starts: int = 0  # started after waiting in the queue
    backfilled: int = 0  # of which: started while an entry ahead of it (last step's order) still waited
    aged_behind: tuple = ()  # the longest-waiting entry still behind younger ones: (minute, info, n)
    head_blocked: list[str] = field(default_factory=list)  # the head waited with its GPUs free
    own_limit_min: int = 0  # job-minutes held back by the user's own limit
    notices: int = 0  # preemption notices given (borrow policy)
    wait_turn_by_queue: list[tuple[int, float]] = field(default_factory=list)


class Simulation:
    def __init__(self, policy: str, seed: int, jobs: list[Job], history: list[Job], args, path: Path):
        self.policy, self.args = policy, args
        self.rng = random.Random(seed * 1000 + {"queue": 1, "retry": 2, "borrow": 3, "limits": 4}[policy])
        self.clock = Clock()
        step_s = 60.0 * args.step
        self.allowance = args.borrow if policy == "borrow" else 0
        self.ledger = Ledger(
            f"sqlite:///{path}",
            config_rules=LimitRules(default=Limit(max_gpus=args.limit)),
            clock=self.clock,
            borrow=BorrowSettings(
                rules=BorrowRules(default=self.allowance), grace_seconds=60.0 * args.grace_minutes
            ),
            # a waiter asks at least once a step: the entry must outlive a step unasked
            queue=QueueSettings(
                weights=Weights(
                    fairshare=args.weight_fairshare, age=args.weight_age, max_age_hours=args.max_age_hours
                ),
                keepalive_seconds=10 * step_s,
                reservations=args.reservations,
            ),
        )
        self.ledger.sync_inventory([Gpu(NODE, i, "A100", 81920) for i in range(args.gpus)])
        self.day = Day(policy, [Job(j.id, j.user, j.arrival, j.count, j.run) for j in jobs])
        self._replay(history)
        self.running: dict[int, Job] = {}  # allocation id -> job
        self.pending: list[Job] = []  # at the ledger, not started (queued or being retried)
        self.last_order: list[int] = []  # the queue's order at the end of the last step

    def _replay(self, history: list[Job]) -> None:
        """Yesterday's runs, one after another, as usage history (each alone on the GPUs)."""
        for j in history:
            self.clock.at(j.arrival - 24 * 60)
            a = self.ledger.allocate(j.user, [], j.count, server_name=f"y{j.id}")
            self.ledger.mark_running(a.id)
            self.clock.at(j.arrival - 24 * 60 + j.run)
            self.ledger.release(a.id)

    def _call(self, kind: str, fn, *a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            self.day.calls[kind].append(time.perf_counter() - t)

    # the day ------------------------------------------------------------------------

    def run(self) -> Day:
        args = self.args
        end = int(args.hours * 60)
        arrivals = sorted(self.day.jobs, key=lambda j: j.arrival)
        at_user: list[Job] = []  # arrived, held back by the user's own limit
        k = 0
        t0 = time.perf_counter()
        for minute in range(0, end + 1, args.step):
            self.clock.at(minute)
            changed = self._end_runs(minute)
            if self.policy == "borrow":
                for j in self._stop_preempted(minute):
                    at_user.append(j)  # what is left of it is asked for again
                    changed = True
            while k < len(arrivals) and arrivals[k].arrival <= minute:
                at_user.append(arrivals[k])
                k += 1
            ready = []
            for j in list(at_user):
                if self._room(j.user, ready) >= j.count:
                    at_user.remove(j)
                    if j.submitted is None:  # a preempted job asks again: its first ask counts
                        j.submitted = minute
                    ready.append(j)
                else:
                    self.day.own_limit_min += args.step
            if ready or self.pending or changed or (self.policy == "borrow" and at_user):
                if self.policy == "retry":
                    self._retry_step(minute, ready)
                else:
                    self._queue_step(minute, ready)
                if self.policy == "borrow":
                    if self.pending:  # the broker's pass
                        self.day.notices += len(self._call("preempt", self.ledger.preempt_for_queue))
                    elif at_user:
                        self._borrow_step(minute, at_user)
                self._check(minute)
        self.day.wall_s = time.perf_counter() - t0
        self.ledger.close()
        return self.day

    def _room(self, user: str, ready: list[Job]) -> int:
        mine = sum(j.count for j in self.running.values() if j.user == user)
        mine += sum(j.count for j in self.pending + ready if j.user == user)
        return self.args.limit - mine

    def _end_runs(self, minute: int) -> bool:
        done = [j for j in self.running.values() if j.started + j.run - j.done <= minute]
        for j in done:
            if not self._call("release", self.ledger.release, j.allocation):
                raise Failure(f"minute {minute}: release of allocation {j.allocation} found it not live")
            j.ended = minute
            del self.running[j.allocation]
        return bool(done)

    def _start(self, j: Job, allocation, minute: int) -> None:
        if allocation.user != j.user or len(allocation.gpus) != j.count:
            raise Failure(f"minute {minute}: job {j.id} ({j.user}, {j.count}) got {allocation}")
        self._call("mark_running", self.ledger.mark_running, allocation.id)
        j.started, j.allocation = minute, allocation.id
        if j.first_started is None:
            j.first_started = minute
        j.borrowed += bool(allocation.borrowed)
        self.running[allocation.id] = j

    def _borrow_step(self, minute: int, at_user: list[Job]) -> bool:
        """Jobs held back by their user's own limit ask beyond it while GPUs are free and
        nobody waits (the spawn form shows what may be borrowed now); the ledger decides."""
        started = False
        free = self.args.gpus - sum(j.count for j in self.running.values())
        for j in sorted(at_user, key=lambda j: j.arrival):
            if j.count > free:
                continue
            try:
                a = self._call("allocate", self.ledger.allocate, j.user, [], j.count, server_name=f"j{j.id}b")
            except Refusal as r:
                if r.reason not in ("no_borrowing", "over_limit"):
                    raise Failure(f"minute {minute}: job {j.id} refused for {r.reason}: {r.message}") from r
                continue
            at_user.remove(j)
            j.submitted = j.submitted if j.submitted is not None else minute
            self._start(j, a, minute)
            free -= j.count
            started = True
        return started

    def _stop_preempted(self, minute: int) -> list[Job]:
        """Due preemptions: the broker stops the server. With ``--autosave`` the run saved
        when the notice came (the grace minutes are lost); else it keeps only its last
        checkpoint (every ``--checkpoint-minutes`` of its run)."""
        stopped = []
        for p, _server in self._call("due_preemptions", self.ledger.due_preemptions):
            j = self.running.pop(p.allocation_id)
            if not self._call("release", self.ledger.release, p.allocation_id, "server stopped"):
                raise Failure(f"minute {minute}: preempted allocation {p.allocation_id} was not live")
            reason = self.ledger.get(p.allocation_id).end_reason
            if not reason.startswith("preempted: "):
                raise Failure(f"minute {minute}: allocation {p.allocation_id} ended with {reason!r}")
            worked = minute - j.started
            notice = round((p.created - DAY).total_seconds() / 60) - j.started
            cp = self.args.checkpoint_minutes
            saved = max(notice if self.args.autosave else 0, (worked // cp) * cp if cp else 0)
            saved = min(saved, worked)
            j.done += saved
            j.lost += worked - saved
            j.stints.append((j.started, minute))
            j.preempted += 1
            j.started = j.allocation = None
            stopped.append(j)
        return stopped

    def _queue_step(self, minute: int, ready: list[Job]) -> None:
        self.rng.shuffle(ready)
        for j in ready:
            hours = limit_hours(j.run) if self.policy == "limits" else None  # the user's own time limit
            got = self._call(
                "request", self.ledger.request, j.user, [], j.count, server_name=f"j{j.id}", hours=hours
            )
            if got.allocation is not None:
                self._start(j, got.allocation, minute)
            else:
                j.entry = got.entry.id
                if got.entry.expected is not None:
                    j.expected = round((got.entry.expected - DAY).total_seconds() / 60)
                j.expected_sure = got.entry.sure
                self.pending.append(j)
        granted = True
        while granted and self.pending:  # the waiters' polls within this minute
            granted = False
            order = list(self.pending)
            self.rng.shuffle(order)
            for j in order:
                t = time.perf_counter()
                got = self._call("wait_turn", self.ledger.wait_turn, j.entry)
                self.day.wait_turn_by_queue.append((len(self.pending), time.perf_counter() - t))
                if got.allocation is not None:
                    self.pending.remove(j)
                    self._start(j, got.allocation, minute)
                    granted = True
                    self.day.queued_starts += 1
                    if j.entry in self.last_order:
                        ahead = self.last_order[: self.last_order.index(j.entry)]
                        if any(p.entry in ahead for p in self.pending):
                            self.day.backfilled += 1
                elif got.entry.state != "waiting":
                    self.pending.remove(j)
                    j.left = got.entry.end_reason or got.entry.state

    def _retry_step(self, minute: int, ready: list[Job]) -> None:
        tries = self.pending + ready
        self.rng.shuffle(tries)
        self.pending = []
        for j in tries:
            try:
                a = self._call("allocate", self.ledger.allocate, j.user, [], j.count, server_name=f"j{j.id}")
            except Refusal as r:
                if r.reason != "no_capacity":
                    raise Failure(f"minute {minute}: job {j.id} refused for {r.reason}: {r.message}") from r
                self.pending.append(j)
                continue
            self._start(j, a, minute)

    # invariants -------------------------------------------------------------------------

    def _check(self, minute: int) -> None:
        live = self.ledger.active()
        held: dict[tuple[str, int], int] = {}
        per_user: Counter[str] = Counter()
        for a in live:
            for g in a.gpus:
                if (g.node, g.index) in held:
                    raise Failure(
                        f"minute {minute}: GPU {g.node}:{g.index} held by allocations "
                        f"{held[(g.node, g.index)]} and {a.id}"
                    )
                held[(g.node, g.index)] = a.id
            per_user[a.user] += a.gpu_count
        lent: Counter[str] = Counter()
        for a in live:
            lent[a.user] += a.borrowed
        for user, n in per_user.items():  # beyond the limit only by borrowed GPUs, within the allowance
            if n > self.args.limit + min(lent[user], self.allowance):
                raise Failure(
                    f"minute {minute}: {user} holds {n} GPUs, over the limit of {self.args.limit} "
                    f"({lent[user]} borrowed, allowance {self.allowance})"
                )
        if {a.id for a in live} != set(self.running):
            raise Failure(
                f"minute {minute}: the ledger's live allocations {sorted(a.id for a in live)} are not "
                f"the runs started {sorted(self.running)}"
            )
        if self.policy == "retry" or not self.pending:
            self.last_order = []
            return
        free = self.args.gpus - len(held)
        waiting = self.ledger.queue()
        self.last_order = [q.id for q in waiting]
        if len(waiting) != len(self.pending):
            raise Failure(
                f"minute {minute}: {len(waiting)} entries wait in the ledger, {len(self.pending)} here"
            )
        head = waiting[0]
        if head.gpu_count <= free:
            self.day.head_blocked.append(
                f"minute {minute}: head entry {head.id} ({head.user}, {head.gpu_count} GPUs) waits "
                f"with {free} free; expected {head.expected} ({head.sure})"
            )
        if any(q.gpu_count <= free for q in waiting):
            self.day.idle_fitting_gpu_min += free * self.args.step
            if head.expected == self.clock.now + timedelta(minutes=5):
                self.day.idle_sliding_gpu_min += free * self.args.step
        max_age = timedelta(hours=self.args.max_age_hours)
        for k, q in enumerate(waiting):
            waited = self.clock.now - q.created
            younger = sum(1 for p in waiting[:k] if self.clock.now - p.created < max_age)
            if (
                waited >= max_age
                and younger
                and (not self.day.aged_behind or waited > self.day.aged_behind[0])
            ):
                self.day.aged_behind = (waited, minute, q, younger, waiting[:k])


# the report ---------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def _mean(values: list[float]) -> float:
    return statistics.mean(values) if values else float("nan")


@dataclass
class Measures:
    util_day: float
    util_peak: float
    median_wait: float
    p95_wait: float
    ledger_median_wait: float
    light_wait: float
    heavy_wait: float
    wait_by_size: dict[int, float]
    never: int
    wall_s: float
    borrowed_starts: int = 0
    notices: int = 0
    preempted: int = 0
    lost_gpu_h: float = 0.0

    @property
    def light_heavy(self) -> float:
        return self.light_wait / self.heavy_wait if self.heavy_wait else float("nan")


def measure(days: list[Day], args) -> Measures:
    """Pooled over the days (one per seed). A wait runs from the trace's request (the user
    wants to start) to the start; a request not started by the end counts until the end."""
    end = int(args.hours * 60)
    used_day = used_peak = 0.0
    waits, ledger_waits, light, heavy = [], [], [], []
    by_size: dict[int, list[float]] = defaultdict(list)
    never = 0
    borrowed = preempted = lost = 0
    for day in days:
        for j in day.jobs:
            stints = list(j.stints)  # earlier, preempted stints (their lost work counts as use)
            if j.started is not None:
                stints.append((j.started, j.ended if j.ended is not None else j.started + j.run - j.done))
            for start, stop in stints:
                used_day += j.count * max(0, min(stop, end) - start)
                used_peak += j.count * max(0, min(stop, 18 * 60) - max(start, 9 * 60))
            if j.first_started is None:
                never += 1
            borrowed += j.borrowed
            preempted += j.preempted
            lost += j.count * j.lost
        hours: Counter[str] = Counter()
        for j in day.jobs:
            hours[j.user] += j.count * j.run / 60
        ranked = sorted(hours, key=lambda u: (hours[u], u))
        q = max(1, len(ranked) // 4)
        lightest, heaviest = set(ranked[:q]), set(ranked[-q:])
        for j in day.jobs:
            first = j.first_started if j.first_started is not None else end
            w = first - j.arrival
            waits.append(w)
            by_size[j.count].append(w)
            if j.submitted is not None:
                ledger_waits.append(first - j.submitted)
            if j.user in lightest:
                light.append(w)
            if j.user in heaviest:
                heavy.append(w)
    n = len(days)
    return Measures(
        util_day=used_day / (args.gpus * end * n),
        util_peak=used_peak / (args.gpus * 9 * 60 * n),
        median_wait=statistics.median(waits),
        p95_wait=_pct(waits, 0.95),
        ledger_median_wait=statistics.median(ledger_waits) if ledger_waits else float("nan"),
        light_wait=_mean(light),
        heavy_wait=_mean(heavy),
        wait_by_size={k: _mean(v) for k, v in sorted(by_size.items())},
        never=never,
        wall_s=sum(d.wall_s for d in days),
        borrowed_starts=borrowed,
        notices=sum(d.notices for d in days),
        preempted=preempted,
        lost_gpu_h=lost / 60,
    )


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b):
        return "n/a"
    if b == 0:
        return "n/a (0)" if a else "1.00x"
    return f"{a / b:.2f}x"


def table(qm: Measures, rm: Measures) -> list[tuple[str, str, str, str]]:
    def row(name, a, b, fmt):
        return (name, fmt(a), fmt(b), _ratio(a, b))

    def minutes(v):
        return "n/a" if math.isnan(v) else f"{v:.0f}"

    rows = [
        row("GPU utilisation, whole day", qm.util_day, rm.util_day, "{:.1%}".format),
        row("GPU utilisation, 09:00-18:00", qm.util_peak, rm.util_peak, "{:.1%}".format),
        row("median wait (min)", qm.median_wait, rm.median_wait, minutes),
        row("95th-percentile wait (min)", qm.p95_wait, rm.p95_wait, minutes),
        row("median wait at the ledger (min)", qm.ledger_median_wait, rm.ledger_median_wait, minutes),
        (
            "mean wait, lightest / heaviest quartile (min)",
            f"{qm.light_wait:.0f} / {qm.heavy_wait:.0f} = {qm.light_heavy:.2f}",
            f"{rm.light_wait:.0f} / {rm.heavy_wait:.0f} = {rm.light_heavy:.2f}",
            _ratio(qm.light_heavy, rm.light_heavy),
        ),
    ]
    for k in sorted(set(qm.wait_by_size) | set(rm.wait_by_size)):
        a, b = qm.wait_by_size.get(k, float("nan")), rm.wait_by_size.get(k, float("nan"))
        rows.append(row(f"mean wait of {k}-GPU requests (min)", a, b, minutes))
    rows.append(row("never started by the end of the day", qm.never, rm.never, str))
    if qm.borrowed_starts or rm.borrowed_starts:
        rows.append(row("runs started on borrowed GPUs", qm.borrowed_starts, rm.borrowed_starts, str))
        rows.append(
            (
                "preemption notices / runs stopped",
                f"{qm.notices} / {qm.preempted}",
                f"{rm.notices} / {rm.preempted}",
                "",
            )
        )
        rows.append(
            row("GPU-hours of work lost to preemption", qm.lost_gpu_h, rm.lost_gpu_h, "{:.1f}".format)
        )
    rows.append(row("wall time of the simulation", qm.wall_s, rm.wall_s, "{:.1f} s".format))
    return rows


def report(args, traces: list[list[Job]], days: dict[str, list[Day]]) -> None:
    jobs = [j for t in traces for j in t]
    offered = sum(j.count * j.run for j in jobs) / 60
    sizes = Counter(j.count for j in jobs)
    seeds = f"seed {args.seed}" if args.seeds == 1 else f"seeds {args.seed}-{args.seed + args.seeds - 1}"
    print(
        f"{seeds}: {args.users} users ({args.heavy} heavy), {len(jobs)} requests "
        f"({', '.join(f'{sizes[s]} x {s} GPU' for s in sorted(sizes))}), {offered:.0f} GPU-hours asked "
        f"for; {args.gpus} GPUs on one node, limit {args.limit} each; {args.hours:g} h days in "
        f"{args.step}-minute steps; priority weights fairshare {args.weight_fairshare}, age "
        f"{args.weight_age}, max age {args.max_age_hours:g} h, reservations {args.reservations}"
    )
    qm, rm = measure(days["queue"], args), measure(days["retry"], args)
    print()
    print("| | gpuhub queue | refuse-and-retry | queue / retry |")
    print("|---|---|---|---|")
    for r in table(qm, rm):
        print("| " + " | ".join(r) + " |")
    print()
    if "borrow" in days:
        bm = measure(days["borrow"], args)
        print(
            f"borrowing: every user may borrow {args.borrow} beyond the limit; grace "
            f"{args.grace_minutes:g} min; a preempted run keeps "
            + ("the work up to the notice (--autosave)" if args.autosave else "nothing but its checkpoints")
            + (f", checkpoints every {args.checkpoint_minutes} min" if args.checkpoint_minutes else "")
        )
        print()
        print("| | queue with borrowing | gpuhub queue | borrowing / queue |")
        print("|---|---|---|---|")
        for r in table(bm, qm):
            print("| " + " | ".join(r) + " |")
        print()
    if "limits" in days:
        print("time limits: every request asks for its run + 25%, rounded up to the half hour (firm ends)")
        print()
        expected_table(days)
    for p, ds in days.items():
        calls: dict[str, list[float]] = defaultdict(list)
        for d in ds:
            for kind, ts in d.calls.items():
                calls[kind] += ts
        text = ", ".join(
            f"{kind} {len(ts)} x {statistics.median(ts) * 1e3:.1f} ms (p95 {_pct(ts, 0.95) * 1e3:.1f})"
            for kind, ts in sorted(calls.items())
        )
        print(f"{p}: ledger calls: {text}")
        print(f"{p}: job-minutes held back by the user's own limit: {sum(d.own_limit_min for d in ds)}")
    queue = days["queue"]
    by: dict[int, list[float]] = defaultdict(list)
    for d in queue:
        for n, t in d.wait_turn_by_queue:
            by[n].append(t)
    if by:
        longest = max(by)
        per_poll = longest * statistics.median(by[longest])
        print(
            f"queue: wait_turn median with 1-5 waiting {_by_len(by, 1, 5)}, 6-15 {_by_len(by, 6, 15)}, "
            f"16+ {_by_len(by, 16, 10**6)}; at the longest queue ({longest}) one poll of every waiter "
            f"costs {per_poll * 1e3:.0f} ms of ledger time (the hub polls each second)"
        )
    idle = sum(d.idle_fitting_gpu_min for d in queue)
    sliding = sum(d.idle_sliding_gpu_min for d in queue)
    print(
        f"queue: free GPU-minutes while a waiting request would fit on them: {idle:.0f} "
        f"({idle / (args.gpus * 9 * 60 * len(queue)):.1%} of 09:00-18:00); of these, {sliding:.0f} while "
        "the head's expected start was 'in 5 minutes' (a run past its user's usual length)"
    )
    starts, backfilled = sum(d.queued_starts for d in queue), sum(d.backfilled for d in queue)
    print(
        f"queue: {starts} starts after waiting in the queue, {backfilled} of them backfilled "
        "past an entry ahead"
    )
    errors = [j.started - j.expected for d in queue for j in d.jobs if j.started is not None and j.expected]
    if errors:
        late = sum(1 for e in errors if e > 30) / len(errors)
        print(
            "queue: expected start given on joining vs the actual start: median "
            f"{statistics.median(errors):+.0f} min, {_pct([abs(e) for e in errors], 0.9):.0f} min "
            "at the 90th percentile of |error|, "
            f"{late:.0%} started more than 30 min after the expected time"
        )
    for d in queue:
        if d.aged_behind:
            waited, minute, q, younger, ahead = d.aged_behind
            young = [p for p in ahead if _clock_minutes(p.created, minute) < args.max_age_hours * 60]
            examples = ", ".join(
                f"{p.user} ({_clock_minutes(p.created, minute):.0f} min, priority {p.factors.priority:.0f})"
                for p in young[:3]
            )
            print(
                f"queue: longest wait past the maximum age still behind younger entries: {q.user}'s "
                f"{q.gpu_count}-GPU request at {_hhmm(minute)} had waited "
                f"{waited.total_seconds() / 3600:.1f} h (fair-share factor {q.factors.fairshare:.2f}, "
                f"priority {q.factors.priority:.0f}) and stood behind {younger} entries that had waited "
                f"less than {args.max_age_hours:g} h, e.g. {examples}"
            )
    left = [(d, j) for d in queue for j in d.jobs if j.left]
    print(f"queue: entries the queue ended before they started: {len(left)}")
    for _d, j in left:
        print(f"  job {j.id} ({j.user}, {j.count} GPUs, asked at {_hhmm(j.submitted)}): {j.left}")
    blocked = [line for d in queue for line in d.head_blocked]
    if blocked:
        print(f"queue: PROBLEM: the head waited with enough GPUs free in {len(blocked)} step(s), e.g.")
        for line in blocked[:5]:
            print("  " + line)
    else:
        print("queue: the head of the queue never waited while enough GPUs were free")
    print("invariants held in both: no GPU held twice, nobody over the limit, the ledger matched the runs")


def limit_hours(run_minutes: int) -> float:
    """The time limit a user asks for a run of ``run_minutes`` (``--time-limits``): a quarter
    more than it takes, rounded up to the half hour, as people ask Slurm for ``--time``."""
    return math.ceil(run_minutes * 1.25 / 30) * 0.5


def expected_errors(days: list[Day]) -> tuple[list[int], int, int]:
    """Actual start minus the expected start given on joining, in minutes, of the started
    requests that had one; and how many were said as "cannot tell yet", of how many waited."""
    waited = [j for d in days for j in d.jobs if j.entry is not None]
    untold = sum(1 for j in waited if j.expected_sure == "default")
    errors = [
        j.started - j.expected
        for j in waited
        if j.started is not None and j.expected is not None and j.expected_sure != "default"
    ]
    return errors, untold, len(waited)


def expected_table(days: dict[str, list[Day]]) -> None:
    """The expected starts' error, today's guesses (queue) against time limits (limits)."""
    print(
        "| expected start vs actual | run-length guesses (no time limits) | with time limits "
        "| limits / guesses |"
    )
    print("|---|---|---|---|")
    (g, g_untold, g_n), (t, t_untold, t_n) = expected_errors(days["queue"]), expected_errors(days["limits"])

    def cell(errors, f):
        return f"{f(errors):.0f} min" if errors else "n/a"

    rows = [
        ("median error (actual - expected start)", lambda e: statistics.median(e)),
        ("median of |error|", lambda e: statistics.median(abs(x) for x in e)),
        ("90th percentile of |error|", lambda e: _pct([abs(x) for x in e], 0.9)),
    ]
    for name, f in rows:
        a, b = (f(g) if g else None), (f(t) if t else None)
        ratio = _ratio(b, a) if a and b is not None and "|" in name else "n/a"  # of sizes only
        print(f"| {name} | {cell(g, f)} | {cell(t, f)} | {ratio} |")
    late_g = sum(1 for e in g if e > 30) / len(g) if g else 0
    late_t = sum(1 for e in t if e > 30) / len(t) if t else 0
    print(f"| started over 30 min after the expected time | {late_g:.0%} | {late_t:.0%} | n/a |")
    print(f"| said 'cannot tell yet' (no history) | {g_untold} of {g_n} | {t_untold} of {t_n} | n/a |")
    print()


def _clock_minutes(created: datetime, minute: int) -> float:
    return minute - (created - DAY).total_seconds() / 60


def _by_len(by: dict[int, list[float]], lo: int, hi: int) -> str:
    got = [t for n, ts in by.items() if lo <= n <= hi for t in ts]
    return f"{statistics.median(got) * 1e3:.1f} ms" if got else "-"


def _hhmm(minute: int | None) -> str:
    return "-" if minute is None else f"{minute // 60:02d}:{minute % 60:02d}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=1, help="run this many days (seeds seed, seed+1, ...)")
    ap.add_argument("--users", type=int, default=30)
    ap.add_argument("--heavy", type=int, default=4, help="how many of the users are heavy")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--limit", type=int, default=4, help="each user's max_gpus")
    ap.add_argument("--hours", type=float, default=24.0, help="the simulated day, from midnight")
    ap.add_argument("--step", type=int, default=1, help="simulated minutes per step")
    ap.add_argument("--history-days", type=int, default=1, choices=(0, 1), help="replay yesterday first")
    defaults = Weights()
    ap.add_argument("--weight-fairshare", type=int, default=defaults.fairshare, help="c.GpuHub's trait")
    ap.add_argument("--weight-age", type=int, default=defaults.age, help="c.GpuHub's trait")
    ap.add_argument("--max-age-hours", type=float, default=defaults.max_age_hours, help="c.GpuHub's trait")
    ap.add_argument(
        "--reservations", type=int, default=1, help="c.GpuHub.queue_reservations (1: EASY backfill)"
    )
    ap.add_argument(
        "--borrow", type=int, default=0, help="also run the queue with borrowing: every user's allowance"
    )
    ap.add_argument(
        "--time-limits",
        action="store_true",
        help="also run the queue with every request asking a time limit (its run + 25%%, to the half hour)",
    )
    ap.add_argument("--grace-minutes", type=float, default=5.0, help="c.GpuHub.preempt_grace_seconds / 60")
    ap.add_argument(
        "--checkpoint-minutes", type=int, default=30, help="a run saves every so many minutes (0: never)"
    )
    ap.add_argument(
        "--no-autosave",
        dest="autosave",
        action="store_false",
        help="a preempted run does not save at the notice (keeps only its checkpoints)",
    )
    args = ap.parse_args()
    users = profiles(args.users, args.heavy)
    policies = ("queue", "retry", "borrow") if args.borrow else ("queue", "retry")
    if args.time_limits:
        policies += ("limits",)
    traces, days = [], {p: [] for p in policies}
    with tempfile.TemporaryDirectory() as d:
        for seed in range(args.seed, args.seed + args.seeds):
            jobs = trace(seed, users, args.limit)
            history = trace(seed + 10_000, users, args.limit) if args.history_days else []
            traces.append(jobs)
            for policy in policies:
                sim = Simulation(policy, seed, jobs, history, args, Path(d) / f"{policy}-{seed}.sqlite")
                try:
                    day = sim.run()
                except Failure as e:
                    print(f"FAILED (seed {seed}, {policy}): {e}", file=sys.stderr)
                    sys.exit(1)
                days[policy].append(day)
                print(f"seed {seed}, {policy}: simulated in {day.wall_s:.1f} s", file=sys.stderr)
    report(args, traces, days)


if __name__ == "__main__":
    main()
