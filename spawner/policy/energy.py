"""Energy per allocation, from gpuhub's own readings of each GPU (pure).

Between two readings of one GPU (an *interval*) the energy is, in order of trust:

1. the difference of NVML's total-energy counter (millijoules since the driver loaded; Volta
   and later), when both readings have it and it did not go back (a driver reload or a
   reboot resets it) nor jump beyond what the GPU can draw in that time;
2. otherwise the power readings at both ends, integrated (the trapezoid rule);
3. otherwise unknown, as is every interval longer than ``max_gap`` (a sampler that stopped,
   a broker that restarted): unknown time is counted as such, never as zero energy.

An interval counts as *idle* when the GPU's utilization was under the idle threshold at both
its ends (the readings idle reclaim judges by).

An interval's energy goes to the allocations that held the GPU during it, in proportion to the
time each held it (a start or an end inside the interval splits it), and to the UTC day it
fell on (an interval across midnight is split too). A GPU held by nobody gives energy to
nobody.

Costs (``figures``): kWh at the GPU; kWh at the meter, times the facility's power usage
effectiveness (PUE: what cooling and power delivery add); money, the meter's kWh times a price;
CO2e, the meter's kWh times the grid's carbon intensity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime

JOULES_PER_KWH = 3.6e6
DAY = 86400.0


@dataclass(frozen=True)
class Point:
    """One reading of one GPU."""

    t: float  # epoch seconds
    power_watts: float | None
    energy_mj: int | None
    idle: bool


@dataclass(frozen=True)
class Interval:
    t0: float
    t1: float
    joules: float | None  # None: unknown
    idle: bool
    how: str  # "counter", "power", or "unknown"

    @property
    def seconds(self) -> float:
        return self.t1 - self.t0


def interval(prev: Point, cur: Point, max_gap: float, max_watts: float) -> Interval:
    """The energy a GPU used between two of its readings."""
    dt = cur.t - prev.t
    idle = prev.idle and cur.idle
    if dt <= 0:
        return Interval(cur.t, cur.t, 0.0, idle, "counter")
    if dt > max_gap:
        return Interval(prev.t, cur.t, None, idle, "unknown")
    if prev.energy_mj is not None and cur.energy_mj is not None:
        joules = (cur.energy_mj - prev.energy_mj) / 1000.0
        if 0 <= joules <= max_watts * dt:
            return Interval(prev.t, cur.t, joules, idle, "counter")
        # the counter went back (reset) or jumped: the power readings, if any, tell instead
    if prev.power_watts is not None and cur.power_watts is not None:
        return Interval(prev.t, cur.t, (prev.power_watts + cur.power_watts) / 2 * dt, idle, "power")
    return Interval(prev.t, cur.t, None, idle, "unknown")


@dataclass(frozen=True)
class Span:
    """An allocation's hold on one GPU: from ``start`` to ``end`` (None: still held)."""

    allocation_id: int
    start: float
    end: float | None = None
    share: float = 1.0  # its part of the GPU (a slice's fraction; 1: the whole GPU)


@dataclass(frozen=True)
class Share:
    """What one allocation used of one GPU on one UTC day (added up over intervals)."""

    allocation_id: int
    day: date
    joules: float = 0.0
    idle_joules: float = 0.0
    measured_seconds: float = 0.0  # GPU-seconds whose energy is known
    unknown_seconds: float = 0.0  # GPU-seconds held whose energy is not known
    idle_seconds: float = 0.0  # of the measured GPU-seconds, those idle

    def plus(self, other: Share) -> Share:
        return Share(
            self.allocation_id,
            self.day,
            self.joules + other.joules,
            self.idle_joules + other.idle_joules,
            self.measured_seconds + other.measured_seconds,
            self.unknown_seconds + other.unknown_seconds,
            self.idle_seconds + other.idle_seconds,
        )


def _days(t0: float, t1: float) -> Iterable[tuple[date, float, float]]:
    """``(day, start, end)`` pieces of ``[t0, t1)`` cut at UTC midnights."""
    t = t0
    while t < t1:
        midnight = (math.floor(t / DAY) + 1) * DAY
        end = min(t1, midnight)
        yield datetime.fromtimestamp(t, UTC).date(), t, end
        t = end


def attribute(iv: Interval, spans: Sequence[Span]) -> list[Share]:
    """``iv``'s energy shared among the allocations of ``spans`` by the time each held the GPU
    in it (and its ``share`` of the GPU), cut at UTC midnights."""
    out: dict[tuple[int, date], Share] = {}
    if iv.seconds <= 0:
        return []
    watts = None if iv.joules is None else iv.joules / iv.seconds
    for span in spans:
        lo = max(iv.t0, span.start)
        hi = min(iv.t1, span.end if span.end is not None else iv.t1)
        for day, a, b in _days(lo, hi):
            seconds = (b - a) * span.share
            if watts is None:
                part = Share(span.allocation_id, day, unknown_seconds=seconds)
            else:
                joules = watts * seconds
                idle = iv.idle
                part = Share(
                    span.allocation_id,
                    day,
                    joules,
                    joules if idle else 0.0,
                    seconds,
                    0.0,
                    seconds if idle else 0.0,
                )
            key = (span.allocation_id, day)
            out[key] = out[key].plus(part) if key in out else part
    return list(out.values())


def merge(shares: Iterable[Share]) -> list[Share]:
    """Shares of the same allocation and day added up."""
    out: dict[tuple[int, date], Share] = {}
    for s in shares:
        key = (s.allocation_id, s.day)
        out[key] = out[key].plus(s) if key in out else s
    return list(out.values())


# -- what it costs -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Costing:
    """The facility's numbers (``c.GpuHub.pue``, ``energy_price``, ``energy_currency``,
    ``carbon_intensity``)."""

    pue: float = 1.0
    price_per_kwh: float = 0.0
    currency: str = ""
    carbon_g_per_kwh: float | None = None


@dataclass(frozen=True)
class Energy:
    """Energy of some allocations, added up."""

    joules: float = 0.0
    idle_joules: float = 0.0
    measured_seconds: float = 0.0
    unknown_seconds: float = 0.0
    idle_seconds: float = 0.0

    def plus(self, other: Energy) -> Energy:
        return Energy(
            self.joules + other.joules,
            self.idle_joules + other.idle_joules,
            self.measured_seconds + other.measured_seconds,
            self.unknown_seconds + other.unknown_seconds,
            self.idle_seconds + other.idle_seconds,
        )

    @property
    def idle_watts(self) -> float | None:
        """The mean draw of one GPU while idle (None: never measured idle)."""
        return self.idle_joules / self.idle_seconds if self.idle_seconds > 0 else None

    @property
    def gpu_kwh(self) -> float:
        return self.joules / JOULES_PER_KWH

    @property
    def idle_kwh(self) -> float:
        return self.idle_joules / JOULES_PER_KWH


def reclaim_saving(
    idle_watts: float | None,
    gpus: int,
    idle_seconds: float,
    reclaimed: float,
    time_limit_end: float | None,
    now: float,
) -> float | None:
    """An estimate of the energy an idle reclaim saved, in joules (None: no idle draw was
    measured): the reclaimed GPUs' measured idle draw for as long as the session would have
    run on, to its time limit's end where it had one, else as long again as it had already been
    idle (nobody knows when its holder would have stopped it), never past ``now``."""
    if idle_watts is None:
        return None
    until = time_limit_end if time_limit_end is not None else reclaimed + idle_seconds
    return idle_watts * gpus * max(0.0, min(until, now) - reclaimed)


def meter_kwh(e: Energy, costing: Costing) -> float:
    return e.gpu_kwh * costing.pue


def cost(e: Energy, costing: Costing) -> float:
    return meter_kwh(e, costing) * costing.price_per_kwh


def figures(e: Energy, costing: Costing) -> dict:
    """What the API, the CSV and the pages show of ``e`` (rounded for reading)."""
    meter = meter_kwh(e, costing)
    carbon = costing.carbon_g_per_kwh
    known = e.measured_seconds + e.unknown_seconds
    return {
        "gpu_kwh": round(e.gpu_kwh, 6),
        "idle_kwh": round(e.idle_kwh, 6),
        "idle_share": round(e.idle_joules / e.joules, 4) if e.joules > 0 else None,
        "meter_kwh": round(meter, 6),
        "cost": round(meter * costing.price_per_kwh, 4) if costing.currency else None,
        "currency": costing.currency or None,
        "co2e_kg": round(meter * carbon / 1000.0, 6) if carbon is not None else None,
        "measured_gpu_hours": round(e.measured_seconds / 3600.0, 4),
        "unknown_gpu_hours": round(e.unknown_seconds / 3600.0, 4),
        "unknown_share": round(e.unknown_seconds / known, 4) if known > 0 else None,
    }


def describe(e: Energy, costing: Costing) -> str:
    """One line for a person: ``1.234 kWh at the GPUs (1.48 kWh at the meter, 0.30 EUR); 12 %
    idle``, and how much time is unknown."""
    f = figures(e, costing)
    text = f"{f['gpu_kwh']:.3f} kWh at the GPUs"
    extra = []
    if costing.pue != 1.0:
        extra.append(f"{f['meter_kwh']:.3f} kWh at the meter")
    if f["cost"] is not None:
        extra.append(f"{f['cost']:.2f} {costing.currency}")
    if f["co2e_kg"] is not None:
        extra.append(f"{f['co2e_kg']:.3f} kg CO2e")
    if extra:
        text += f" ({', '.join(extra)})"
    if f["idle_share"] is not None:
        text += f"; {f['idle_share'] * 100:.0f} % of it idle"
    if e.unknown_seconds > 0:
        text += f"; {e.unknown_seconds / 3600.0:.2f} GPU-hours not measured"
    return text
