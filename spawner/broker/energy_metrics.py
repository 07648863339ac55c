"""Energy at the service's ``/metrics`` (read at each scrape, without a ledger query for the
counters: the broker's meter keeps them, from the ledger's totals at its start):

- ``gpuhub_gpu_power_watts{node,index,model,user}``: each GPU's last power reading by gpuhub's
  own sampler (fresh ones only; ``user``: who held it at that reading, empty for nobody);
- ``gpuhub_energy_joules_total{user,purpose,idle}``: energy at the GPUs per user and purpose,
  the part while idle (``idle="true"``) apart from the rest; multiply by ``c.GpuHub.pue`` for
  the meter;
- ``gpuhub_energy_unknown_gpu_seconds_total{user,purpose}``: GPU-seconds held whose energy is
  not known (no readings, a gap);
- ``gpuhub_refused_readings_total{field}``: impossible readings left out of reports.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class EnergyCollector:
    def __init__(self, broker):
        self.broker = broker

    def collect(self):
        b = self.broker
        power = GaugeMetricFamily(
            "gpuhub_gpu_power_watts",
            "Last power reading of each GPU by gpuhub's own sampler, watts",
            labels=["node", "index", "model", "user"],
        )
        meter, stale = b.energy, b.reclaim_rules.stale_after
        now = meter.clock()
        for key in sorted(meter.power):  # from memory: the sampler's last readings, no query
            watts = meter.watts(key, stale, now)
            if watts is not None:
                model = meter.models.get(key, "")
                power.add_metric([key[0], str(key[1]), model, meter.holder_user(key)], watts)
        yield power
        joules = CounterMetricFamily(
            "gpuhub_energy_joules",
            "Energy at the GPUs per user and purpose, idle apart (times c.GpuHub.pue: at the meter)",
            labels=["user", "purpose", "idle"],
        )
        unknown = CounterMetricFamily(
            "gpuhub_energy_unknown_gpu_seconds",
            "GPU-seconds held whose energy is not known",
            labels=["user", "purpose"],
        )
        for (user, purpose), e in sorted(b.energy.totals.items()):
            joules.add_metric([user, purpose, "true"], e.idle_joules)
            joules.add_metric([user, purpose, "false"], e.joules - e.idle_joules)
            unknown.add_metric([user, purpose], e.unknown_seconds)
        yield joules
        yield unknown
        refused = CounterMetricFamily(
            "gpuhub_refused_readings", "Impossible readings left out of reports", labels=["field"]
        )
        for field in ("power_watts", "energy_mj"):
            refused.add_metric([field], b.refused_readings.get(field, 0))
        yield refused
