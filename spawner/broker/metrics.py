"""Prometheus metrics at the service's ``/metrics``.

Gauges are read from the ledger at each scrape, so they are true whichever process
allocated (hub spawner, this service). Refusals and allocation latency are counted for the
requests this service handles; refusals of spawns are in JupyterHub's own
``jupyterhub_server_spawn_duration_seconds{status="failure", reason="gpuhub_<reason>"}``.

Borrowing: ``gpuhub_borrowed_gpus{purpose}`` (GPUs of live allocations beyond their users'
limits), ``gpuhub_borrowed_gpu_hours{user}`` and ``gpuhub_preempted_allocations{user}`` (since
the ledger began) are read from the ledger at each scrape; ``gpuhub_preemptions_total{purpose}``
counts the notices this service gave.

The queue: ``gpuhub_queue_length{purpose}`` is a gauge read from the ledger at each scrape
(``Ledger.queue()``), like the others. ``gpuhub_queue_wait_seconds{outcome}`` is a histogram
of how long entries waited, by how their wait ended: ``granted`` (they got their GPUs) or
``left`` (their waiter left, an admin cancelled them, they were given up on). Grants happen
in other processes than this one (the hub's spawner books a waiting spawn's GPUs; a burst's
waiter polls this service, but a server's does not), and metrics are per process, so the
histogram is not observed where waits end: it is built at scrape time from the ledger's
``queue_history(since)``, the entries that ended since the last scrape, each observed once
(an id seen is remembered for ``HISTORY_MARGIN`` past the scrape, so an entry whose end was
committed just after a scrape that its timestamp precedes is still counted, and never twice).
Like every histogram of this process, it starts empty when the service starts: entries that
ended before are not counted.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

from spawner.broker.utilization import epoch
from spawner.ledger import Ledger
from spawner.ledger.reclaims import totals
from spawner.policy.idle import STATES


class LedgerCollector:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def collect(self):
        counts, live = self.ledger.gpu_census()
        gpus = GaugeMetricFamily(
            "gpuhub_gpus", "GPUs in the inventory by node, model and state", labels=["node", "model", "state"]
        )
        for node, model in sorted({(node, model) for node, model, _ in counts}):
            for state in ("allocated", "sliced", "free", "absent"):
                gpus.add_metric([node, model, state], counts.get((node, model, state), 0))
        yield gpus
        room = self.ledger.slice_room_by_node()
        if room:
            slices = GaugeMetricFamily(
                "gpuhub_gpu_slices",
                "Slices of GPUs (c.GpuHub.gpu_slices) by node, model, size and state (held, free)",
                labels=["node", "model", "size", "state"],
            )
            for (node, model, size), (held_n, free_n) in sorted(room.items()):
                slices.add_metric([node, model, size, "held"], held_n)
                slices.add_metric([node, model, size, "free"], free_n)
            yield slices

        allocations = GaugeMetricFamily(
            "gpuhub_allocations", "Live allocations by purpose", labels=["purpose"]
        )
        held = GaugeMetricFamily(
            "gpuhub_allocated_gpus",
            "GPUs held by live allocations by purpose (a slice counts as its share of a GPU)",
            labels=["purpose"],
        )
        borrowed = GaugeMetricFamily(
            "gpuhub_borrowed_gpus",
            "GPUs of live allocations borrowed beyond their users' limits, by purpose",
            labels=["purpose"],
        )
        for purpose in PURPOSES:
            n, gpus, lent = live.get(purpose, (0, 0, 0))
            allocations.add_metric([purpose], n)
            held.add_metric([purpose], gpus)
            borrowed.add_metric([purpose], lent)
        yield allocations
        yield held
        yield borrowed

        borrowed_hours = GaugeMetricFamily(
            "gpuhub_borrowed_gpu_hours",
            "GPU-hours borrowed beyond the limit, per user, since the ledger began",
            labels=["user"],
        )
        preempted = GaugeMetricFamily(
            "gpuhub_preempted_allocations",
            "Borrowed allocations given notice to be taken back, per user, since the ledger began",
            labels=["user"],
        )
        for user, t in self.ledger.borrowing_totals(BEGINNING).items():
            borrowed_hours.add_metric([user], t["borrowed_gpu_hours"])
            preempted.add_metric([user], t["preemptions"])
        yield borrowed_hours
        yield preempted

        reclaimed = GaugeMetricFamily(
            "gpuhub_reclaimed_gpu_hours",
            "Idle GPU-hours ended by reclaims, per user, since the ledger began",
            labels=["user"],
        )
        for user, t in totals(self.ledger.reclaims()).items():
            reclaimed.add_metric([user], t["gpu_hours"])
        yield reclaimed

        length = GaugeMetricFamily(
            "gpuhub_queue_length", "Requests waiting in the queue for GPUs, by purpose", labels=["purpose"]
        )
        waiting = self.ledger.queue()
        for purpose in PURPOSES:
            length.add_metric([purpose], sum(1 for q in waiting if q.purpose == purpose))
        yield length


PURPOSES = ("server", "distributed")
OUTCOMES = ("granted", "left")
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200)
HISTORY_MARGIN = timedelta(minutes=2)
BEGINNING = datetime(1970, 1, 1)  # "since the ledger began"


class QueueWaitCollector:
    """``gpuhub_queue_wait_seconds``: the waits of entries that ended, read from the ledger's
    queue history at each scrape and observed once each (see the module's docstring)."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.lock = threading.Lock()
        self.started: datetime = ledger.clock()  # entries ended before this are not counted
        self.since: datetime = self.started
        self.seen: dict[int, datetime] = {}  # counted entries' ids -> when they ended
        self.counts = {o: [0] * (len(WAIT_BUCKETS) + 1) for o in OUTCOMES}  # the last: +Inf
        self.sums = dict.fromkeys(OUTCOMES, 0.0)

    def observe(self, outcome: str, seconds: float) -> None:
        for i, bound in enumerate(WAIT_BUCKETS):
            if seconds <= bound:
                self.counts[outcome][i] += 1
        self.counts[outcome][-1] += 1
        self.sums[outcome] += seconds

    def update(self) -> None:
        """Observe the entries that ended since the last scrape (and were not yet counted)."""
        with self.lock:
            now = self.ledger.clock()
            since = max(self.started, self.since - HISTORY_MARGIN)
            for q in self.ledger.queue_history(since):
                if q.id in self.seen or q.ended is None or q.ended < self.started:
                    continue
                self.seen[q.id] = q.ended
                outcome = "granted" if q.state == "granted" else "left"
                self.observe(outcome, max(0.0, (q.ended - q.created).total_seconds()))
            self.since = now
            forget = now - 2 * HISTORY_MARGIN
            self.seen = {i: t for i, t in self.seen.items() if t >= forget}

    def collect(self):
        self.update()
        family = HistogramMetricFamily(
            "gpuhub_queue_wait_seconds",
            "How long queue entries waited for GPUs, by how the wait ended (granted or left)",
            labels=["outcome"],
        )
        with self.lock:
            for outcome in OUTCOMES:
                bounds = [*(f"{b:g}" for b in WAIT_BUCKETS), "+Inf"]
                family.add_metric(
                    [outcome], list(zip(bounds, self.counts[outcome], strict=True)), self.sums[outcome]
                )
        yield family


class UtilizationCollector:
    """Per-GPU gauges from what servers and engines last reported (fresh readings only)."""

    def __init__(self, broker):
        self.broker = broker

    def collect(self):
        b = self.broker
        util = GaugeMetricFamily(
            "gpuhub_gpu_utilization_percent",
            "Latest reported utilization of each allocated GPU",
            labels=["node", "index", "model", "user"],
        )
        mem = GaugeMetricFamily(
            "gpuhub_gpu_memory_used_mib",
            "Latest reported memory in use on each allocated GPU, MiB",
            labels=["node", "index", "model", "user"],
        )
        live = b.ledger.active() if b.utilization.gpus else []  # no GPU reported: nothing to show
        held = sorted(((g, a) for a in live for g in a.gpus), key=lambda held: held[0])
        for gpu, holder in held:  # every held GPU with its holder, in (node, index) order
            since = epoch(holder.started or holder.created)
            r = b.utilization.latest(gpu.node, gpu.index, b.reclaim_rules.stale_after, since)
            if r is None:
                continue
            labels = [gpu.node, str(gpu.index), gpu.model, holder.user]
            util.add_metric(labels, r.utilization)
            mem.add_metric(labels, r.memory_used_mib)
        yield util
        yield mem
        idle = GaugeMetricFamily(
            "gpuhub_idle_allocations", "Live GPU allocations by idle state", labels=["state"]
        )
        states = [v.state for v in list(b.utilization.verdicts.values())]
        for state in STATES:
            idle.add_metric([state], states.count(state))
        yield idle


class Metrics:
    def __init__(self, ledger: Ledger):
        self.registry = CollectorRegistry()
        self.registry.register(LedgerCollector(ledger))
        self.registry.register(QueueWaitCollector(ledger))
        self.refusals = Counter(
            "gpuhub_refusals", "Burst requests refused, by reason", ["reason"], registry=self.registry
        )
        self.reclaims = Counter(
            "gpuhub_reclaims",
            "Allocations reclaimed for idleness by this service",
            ["purpose"],
            registry=self.registry,
        )
        self.preemptions = Counter(
            "gpuhub_preemptions",
            "Borrowed allocations given notice to be taken back, by this service",
            ["purpose"],
            registry=self.registry,
        )
        self.allocation_seconds = Histogram(
            "gpuhub_allocation_seconds",
            "Time to admit and record a burst allocation",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
