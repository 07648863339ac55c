"""Prometheus metrics at the service's ``/metrics``.

Gauges are read from the ledger at each scrape, so they are true whichever process
allocated (hub spawner, this service). Refusals and allocation latency are counted for the
requests this service handles; refusals of spawns are in JupyterHub's own
``jupyterhub_server_spawn_duration_seconds{status="failure", reason="gpuhub_<reason>"}``.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from ..ledger import Ledger


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


class Metrics:
    def __init__(self, ledger: Ledger):
        self.registry = CollectorRegistry()
        self.registry.register(LedgerCollector(ledger))
        self.refusals = Counter(
            "gpuhub_refusals", "Burst requests refused, by reason", ["reason"], registry=self.registry
        )
        self.allocation_seconds = Histogram(
            "gpuhub_allocation_seconds",
            "Time to admit and record a burst allocation",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
