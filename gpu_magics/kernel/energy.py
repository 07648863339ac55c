"""Energy in words, from the broker's figures (``GET me``: each allocation's ``energy``, the
``EnergyFigures`` of spawner/broker/openapi.yaml): pure, for ``%gpus`` and JupyterLab's panel.

The words are those of ``spawner.policy.energy.describe`` (and of the broker's pages):
``2.000 kWh at the GPUs (3.000 kWh at the meter, 0.60 EUR, 1.050 kg CO2e); 25 % of it idle;
0.50 GPU-hours not measured``. The meter's kWh is said only where the facility's PUE is not 1,
the cost only with a currency, CO2e only with a carbon intensity.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

NOT_MEASURED = "not measured yet"


def energy_text(f: Mapping[str, Any] | None, pue: float | None = None) -> str:
    """One allocation's (or a sum's) figures in one line; ``pue``: the facility's (``GET me``'s
    ``energy.pue``), else the meter's kWh is said where it differs from the GPUs'."""
    if not f:
        return NOT_MEASURED
    text = f"{f['gpu_kwh']:.3f} kWh at the GPUs"
    extra = []
    meter = f.get("meter_kwh")
    if meter is not None and (pue != 1.0 if pue is not None else meter != f["gpu_kwh"]):
        extra.append(f"{meter:.3f} kWh at the meter")
    if f.get("cost") is not None:
        extra.append(f"{f['cost']:.2f} {f.get('currency') or ''}".rstrip())
    if f.get("co2e_kg") is not None:
        extra.append(f"{f['co2e_kg']:.3f} kg CO2e")
    if extra:
        text += f" ({', '.join(extra)})"
    if f.get("idle_share") is not None:
        text += f"; {f['idle_share'] * 100:.0f} % of it idle"
    if (f.get("unknown_gpu_hours") or 0) > 0:
        text += f"; {f['unknown_gpu_hours']:.2f} GPU-hours not measured"
    return text


def _sum(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def add_up(figures: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Several allocations' figures added up (None: none of them measured yet)."""
    found = [f for f in figures if f]
    if not found:
        return None
    gpu = sum(f["gpu_kwh"] for f in found)
    idle = sum(f["idle_kwh"] for f in found)
    measured = sum(f.get("measured_gpu_hours") or 0 for f in found)
    unknown = sum(f.get("unknown_gpu_hours") or 0 for f in found)
    return {
        "gpu_kwh": gpu,
        "idle_kwh": idle,
        "idle_share": idle / gpu if gpu > 0 else None,
        "meter_kwh": sum(f["meter_kwh"] for f in found),
        "cost": _sum([f.get("cost") for f in found]),
        "currency": next((f["currency"] for f in found if f.get("currency")), None),
        "co2e_kg": _sum([f.get("co2e_kg") for f in found]),
        "measured_gpu_hours": measured,
        "unknown_gpu_hours": unknown,
        "unknown_share": unknown / (measured + unknown) if measured + unknown > 0 else None,
    }


def session_allocations(
    me: Mapping[str, Any], server_name: str, allocation_ids: Iterable[int] = ()
) -> list[Mapping[str, Any]]:
    """This session's allocations in ``GET me``: the server's and its kernels' bursts (those
    whose ``server_name`` is this server's, as JupyterLab's panel counts them), and any of
    ``allocation_ids`` (the server's own id, the pool's bursts)."""
    ids = set(allocation_ids)
    return [
        a
        for a in me.get("allocations", ())
        if a.get("id") in ids or (a.get("server_name") or "") == server_name
    ]


def session_line(me: Mapping[str, Any], server_name: str, allocation_ids: Iterable[int] = ()) -> str:
    """``%gpus``'s line: ``This session so far: 1.234 kWh at the GPUs (0.31 EUR); ...``: the
    broker's ``session`` (every allocation of this server since it started, ended bursts too)
    where it answered one, else what this server holds now (and says so)."""
    pue = (me.get("energy") or {}).get("pue")
    session = me.get("session")
    if session is not None:
        f = session.get("energy")
        measured = f and (f.get("measured_gpu_hours") or f.get("unknown_gpu_hours"))
        return f"This session so far: {energy_text(f if measured else None, pue)}"
    total = add_up(a.get("energy") for a in session_allocations(me, server_name, allocation_ids))
    return f"This session so far (what it holds now): {energy_text(total, pue)}"


def server_started(ppid: int | None = None) -> str | None:
    """When this kernel's server (its parent process) started, as the broker reads a time
    (None: unknown)."""
    try:
        import psutil

        t = psutil.Process(os.getppid() if ppid is None else ppid).create_time()
    except Exception:
        return None
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
