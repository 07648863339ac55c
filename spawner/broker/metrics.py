"""Prometheus metrics at the service's ``/metrics``.

Gauges are read from the ledger at each scrape, so they are true whichever process
allocated (hub spawner, this service). Refusals and allocation latency are counted for the
requests this service handles; refusals of spawns are in JupyterHub's own
``jupyterhub_server_spawn_duration_seconds{status="failure", reason="gpuhub_<reason>"}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from ..idle import STATES
from ..ledger import Ledger
from ..reclaims import totals
from .utilization import epoch


class LedgerCollector:
    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def collect(self):
        table = self.ledger.gpu_table()
        gpus = GaugeMetricFamily(
            "gpuhub_gpus", "GPUs in the inventory by node, model and state", labels=["node", "model", "state"]
        )
        counts: dict[tuple[str, str, str], int] = {}
        for st in table:
            state = "absent" if not st.present else ("allocated" if st.holder else "free")
            key = (st.gpu.node, st.gpu.model, state)
            counts[key] = counts.get(key, 0) + 1
        for node, model in sorted({(st.gpu.node, st.gpu.model) for st in table}):
            for state in ("allocated", "free", "absent"):
                gpus.add_metric([node, model, state], counts.get((node, model, state), 0))
        yield gpus

        allocations = GaugeMetricFamily(
            "gpuhub_allocations", "Live allocations by purpose", labels=["purpose"]
        )
        held = GaugeMetricFamily(
            "gpuhub_allocated_gpus", "GPUs held by live allocations by purpose", labels=["purpose"]
        )
        live = self.ledger.active()
        for purpose in ("server", "distributed"):
            mine = [a for a in live if a.purpose == purpose]
            allocations.add_metric([purpose], len(mine))
            held.add_metric([purpose], sum(len(a.gpus) for a in mine))
        yield allocations
        yield held

        reclaimed = GaugeMetricFamily(
            "gpuhub_reclaimed_gpu_hours",
            "Idle GPU-hours ended by reclaims, per user, since the ledger began",
            labels=["user"],
        )
        for user, t in totals(self.ledger.reclaims()).items():
            reclaimed.add_metric([user], t["gpu_hours"])
        yield reclaimed


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
        for st in b.ledger.gpu_table():
            if st.holder is None:
                continue
            since = epoch(st.holder.started or st.holder.created)
            r = b.utilization.latest(st.gpu.node, st.gpu.index, b.reclaim_rules.stale_after, since)
            if r is None:
                continue
            labels = [st.gpu.node, str(st.gpu.index), st.gpu.model, st.holder.user]
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
        self.refusals = Counter(
            "gpuhub_refusals", "Burst requests refused, by reason", ["reason"], registry=self.registry
        )
        self.reclaims = Counter(
            "gpuhub_reclaims",
            "Allocations reclaimed for idleness by this service",
            ["purpose"],
            registry=self.registry,
        )
        self.allocation_seconds = Histogram(
            "gpuhub_allocation_seconds",
            "Time to admit and record a burst allocation",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
