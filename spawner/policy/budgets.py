"""Energy budgets: how much energy, or money, a user may use in a window, like a GPU-hours
budget (pure).

A budget is ``{"kwh": 50}`` (kWh at the meter: the GPUs' energy times ``c.GpuHub.pue``) or
``{"cost": 20}`` (money in ``c.GpuHub.energy_currency``: the meter's kWh times
``c.GpuHub.energy_price``), with an optional ``"window_hours"`` (default 168: a week), set by
default, per group and per user (``c.GpuHub.default_energy_budget``, ``group_energy_budgets``,
``user_energy_budgets``). ``None``: no budget. A user in several groups gets the most generous
(no budget beats any; money is compared as the kWh it buys). Once the window holds as much as
the budget, a start or a burst that asks for GPUs is refused with the reason; a server without
GPUs still starts. Energy is kept per UTC day, so the window counts whole days: its first day
from midnight.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spawner.policy.energy import Costing, Energy, meter_kwh
from spawner.policy.limits import DEFAULT_WINDOW_HOURS, MAX_WINDOW_HOURS, MIN_WINDOW_HOURS
from spawner.policy.scoped import Scoped, resolve

UNITS = ("kwh", "cost")
KEYS = frozenset((*UNITS, "window_hours"))
MAX_BUDGET = 1e12


@dataclass(frozen=True)
class EnergyBudget:
    amount: float
    unit: str  # "kwh" (at the meter) or "cost" (in the currency)
    window_hours: float = DEFAULT_WINDOW_HOURS

    def as_kwh(self, costing: Costing) -> float:
        """What the budget allows in kWh at the meter."""
        if self.unit == "kwh":
            return self.amount
        return self.amount / costing.price_per_kwh if costing.price_per_kwh > 0 else math.inf


@dataclass(frozen=True)
class BudgetRules(Scoped[EnergyBudget | None]):
    default: EnergyBudget | None = None


def _number(raw: Any, what: str, lo: float, hi: float) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not lo <= raw <= hi:
        raise ValueError(f"{what} must be a number from {lo:g} to {hi:g}; got {raw!r}")
    return float(raw)


def parse_budget(raw: Any, where: str, costing: Costing) -> EnergyBudget | None:
    """A budget from config, or ``ValueError`` naming ``where``: one unit (kwh or cost), a money
    budget only where a currency and a price are set."""
    if raw is None or (isinstance(raw, Mapping) and not raw):  # None or {}: no budget
        return None
    example = 'e.g. {"kwh": 50, "window_hours": 168} or {"cost": 20}'
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: an energy budget is a dict or None, {example}; got {raw!r}")
    unknown = set(raw) - KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(map(str, unknown))}; a budget is in kwh (at the meter) or "
            f"cost ({costing.currency or 'c.GpuHub.energy_currency'}), {example}"
        )
    units = [u for u in UNITS if u in raw]
    if len(units) != 1:
        raise ValueError(f"{where}: give one of kwh or cost, {example}")
    unit = units[0]
    if unit == "cost" and not (costing.currency and costing.price_per_kwh > 0):
        raise ValueError(
            f"{where}: a money budget needs c.GpuHub.energy_currency and a c.GpuHub.energy_price "
            "above 0; or give the budget in kwh"
        )
    amount = _number(raw[unit], f"{where}['{unit}']", 0, MAX_BUDGET)
    raw_window = raw.get("window_hours", DEFAULT_WINDOW_HOURS)
    window = _number(raw_window, f"{where}['window_hours']", MIN_WINDOW_HOURS, MAX_WINDOW_HOURS)
    return EnergyBudget(amount, unit, window)


def most_generous(costing: Costing):
    """Several groups' budgets as one: none beats any; else the one that allows the most kWh."""

    def combine(found: Sequence[tuple[str, EnergyBudget | None]]):
        if any(b is None for _, b in found):
            return None, [name for name, b in found if b is None][:1]
        name, budget = max(found, key=lambda nb: (nb[1].as_kwh(costing), nb[0]))
        return budget, [name]

    return combine


def effective_budget(
    user: str, groups: Iterable[str], rules: BudgetRules, costing: Costing
) -> tuple[EnergyBudget | None, str]:
    return resolve(user, groups, rules, combine=most_generous(costing))


def used(budget: EnergyBudget, energy: Energy, costing: Costing) -> float:
    """What ``energy`` takes of the budget, in its unit."""
    kwh = meter_kwh(energy, costing)
    return kwh if budget.unit == "kwh" else kwh * costing.price_per_kwh


def describe(budget: EnergyBudget, costing: Costing) -> str:
    amount = f"{budget.amount:g} kWh" if budget.unit == "kwh" else f"{budget.amount:g} {costing.currency}"
    return f"{amount} of energy over {budget.window_hours:g} hours"


def spent_message(budget: EnergyBudget, source: str, energy: Energy, costing: Costing) -> str | None:
    """Why a request for GPUs is refused (None: the budget is not spent)."""
    spent = used(budget, energy, costing)
    if spent < budget.amount:
        return None
    shown = f"{spent:.3f} kWh at the meter" if budget.unit == "kwh" else f"{spent:.2f} {costing.currency}"
    return (
        f"You have used {shown} of your energy budget, {describe(budget, costing)} ({source}). "
        "Start a server without GPUs (0), or wait until older use leaves the window (whole UTC days), "
        "or ask an admin to raise the budget."
    )
