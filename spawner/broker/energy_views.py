"""What the API, the CSV and the pages show of energy (pure): the facility's numbers, each
user's figures over a period, and per bucket of the usage chart. Energy is kept per UTC day
(``energy_use``): a bucket holds the days whose start, or the period's start, falls in it."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import date, datetime, time
from typing import Any

from spawner.policy.energy import Costing, Energy, figures

SOURCE = (
    "gpuhub's own readings of each GPU (the broker's sampler, or gpuhub sampler on the nodes), "
    "which users cannot write; NVML's energy counter where the GPU has one, else its power"
)


def costing_json(c: Costing) -> dict[str, Any]:
    return {
        "pue": c.pue,
        "price_per_kwh": c.price_per_kwh if c.currency else None,
        "currency": c.currency or None,
        "carbon_g_per_kwh": c.carbon_g_per_kwh,
        "source": SOURCE,
    }


def total(energies: Mapping[Any, Energy]) -> Energy:
    out = Energy()
    for e in energies.values():
        out = out.plus(e)
    return out


def bucket_of(day: date, since: datetime, starts: list[datetime]) -> int | None:
    """The index of the bucket that holds ``day`` (its midnight, or ``since`` if later)."""
    t = max(datetime.combine(day, time()), since)
    found = None
    for i, start in enumerate(starts):
        if start <= t:
            found = i
        else:
            break
    return found


def series(
    days: Mapping[str, Mapping[date, Energy]], since: datetime, starts: list[datetime]
) -> dict[str, dict[str, list[float]]]:
    """Per user, kWh at the GPUs and its idle part per bucket of ``starts``."""
    out = {}
    for user, per_day in sorted(days.items()):
        kwh = [0.0] * len(starts)
        idle = [0.0] * len(starts)
        for day, e in per_day.items():
            i = bucket_of(day, since, starts)
            if i is not None:
                kwh[i] += e.gpu_kwh
                idle[i] += e.idle_kwh
        out[user] = {"gpu_kwh": [round(v, 6) for v in kwh], "idle_kwh": [round(v, 6) for v in idle]}
    return out


def usage_energy_json(
    costing: Costing,
    totals: Mapping[str, Energy],
    days: Mapping[str, Mapping[date, Energy]],
    since: datetime,
    starts: list[datetime],
    groups: Mapping[str, list[str]] | None = None,
) -> dict[str, Any]:
    """``GET usage``'s ``energy``: the facility's numbers, per user and in all, per bucket, and
    (for admins) per group: a user in two groups counts in both."""
    out = {
        "costing": costing_json(costing),
        "total": {u: figures(e, costing) for u, e in sorted(totals.items())},
        "all": figures(total(totals), costing),
        "series": series(days, since, starts),
    }
    if groups is not None:
        per_group: dict[str, Energy] = {}
        for user, e in totals.items():
            for g in groups.get(user, []):
                per_group[g] = per_group.get(g, Energy()).plus(e)
        out["groups"] = {g: figures(e, costing) for g, e in sorted(per_group.items())}
    return out


def csv_columns(usage: dict[str, Any], user: str, i: int) -> list[str]:
    """The energy columns of one CSV row (bucket ``i`` of ``user``): kWh at the GPUs, idle
    kWh, kWh at the meter, cost."""
    energy = usage.get("energy")
    if energy is None:
        return []
    s = energy["series"].get(user)
    kwh = s["gpu_kwh"][i] if s else 0.0
    idle = s["idle_kwh"][i] if s else 0.0
    c = energy["costing"]
    meter = kwh * c["pue"]
    cost = f"{meter * c['price_per_kwh']:.4f}" if c["currency"] else ""
    return [f"{kwh:.6f}", f"{idle:.6f}", f"{meter:.6f}", cost, c["currency"] or ""]


CSV_HEADER = ["gpu_kwh", "idle_kwh", "meter_kwh", "cost", "currency"]
