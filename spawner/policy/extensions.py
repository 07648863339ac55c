"""Extending a running session's time limit (pure).

A user asks for more time on an allocation that has a time limit ("Extend by 2 h" on My GPUs,
``%gpus --extend 2h``, ``POST allocations/{id}/extend``). It is granted when:

- the allocation is live and has a time limit (nothing to extend otherwise);
- the extensions of that allocation, this one included, stay within the user's
  ``c.GpuHub.extension_max_hours`` (0, the default: no extensions; None: no cap);
- nobody waiting in the queue would start later than their expected start because of it,
  unless ``c.GpuHub.extension_delays_waiters`` allows that.

An admin of the hub may extend any allocation (their own explicit act), past both rules; it
is recorded as theirs. Every extension is one ledger row: who asked, when, how much.

- :func:`parse_duration`: ``2h``, ``90min``, ``1.5`` (hours) from a magic's line.
- :func:`extension_refusal`: why an extension is refused, or None.
- :func:`delayed`: the waiters an extension would make start later.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpu_magics.common import words
from spawner.policy import values
from spawner.policy.limits import Refusal
from spawner.policy.timelimits import MAX_HOURS, MIN_HOURS, RANGE, hours_text

_DURATION = re.compile(r"\s*([0-9]{1,6}(?:\.[0-9]{1,6})?)\s*(h|hours?|m|min|minutes?)?\s*", re.IGNORECASE)
SLACK = timedelta(seconds=1)  # an expected start later by less is not a delay (rounding)


@dataclass(frozen=True)
class ExtendSettings:
    """``c.GpuHub.extension_max_hours`` (hours an allocation may be extended by in all; 0:
    never; None: no cap) and ``c.GpuHub.extension_delays_waiters``."""

    max_hours: float | None = 0.0
    delays_waiters: bool = False


def read_max_hours(value: Any, where: str) -> float | None:
    """``extension_max_hours`` checked: 0 (no extensions), up to a year, or None (no cap)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        ok = False
    else:
        ok = value == 0 or MIN_HOURS <= value <= MAX_HOURS
    if not ok:
        raise ValueError(
            f"{where} must be 0 (no extensions), a number of hours {RANGE}, or None for no cap; "
            f"got {values.show(value)}."
        )
    return float(value)


def parse_duration(raw: str, field: str = "--extend") -> float:
    """Hours from ``2h``, ``2 hours``, ``90min``, ``30m`` or a bare number of hours (``1.5``);
    ``values.BadValue`` naming ``field`` for anything else or outside a minute to a year."""
    m = _DURATION.fullmatch(raw or "")
    bad = values.BadValue(
        field, f"{field} takes a length such as 2h, 90min or 1.5 (hours), {RANGE}; got {values.show(raw)}."
    )
    if not m:
        raise bad
    number, unit = float(m.group(1)), (m.group(2) or "h").lower()
    hours = number / 60 if unit.startswith("m") else number
    if not MIN_HOURS - 1e-12 <= hours <= MAX_HOURS:
        raise bad
    return hours


def delayed(before: Mapping[int, datetime | None], after: Mapping[int, datetime | None]) -> list[int]:
    """The waiting entries whose expected start the extension makes later (or unknown): their
    ids, in order. ``before``/``after``: each waiter's expected start without and with it."""
    out = []
    for entry, was in before.items():
        now = after.get(entry)
        if was is None:
            continue  # no expected start to keep
        if now is None or now - was > SLACK:
            out.append(entry)
    return sorted(out)


def extension_refusal(
    asked_hours: float,
    extended_seconds: float,
    max_hours: float | None,
    source: str,
    delayed_waiters: int,
    delays_allowed: bool,
) -> Refusal | None:
    """Why an extension of ``asked_hours`` is refused (None: granted), given what the
    allocation was extended by before (``extended_seconds``), the cap (``max_hours``, from
    ``source``) and how many waiters it would delay."""
    if max_hours is not None:
        left = max(0.0, max_hours * 3600 - extended_seconds)
        if max_hours == 0:
            return Refusal(
                "Sessions here cannot be extended (c.GpuHub.extension_max_hours is 0); "
                "save your work before the end, or ask an admin of this hub to extend it.",
                reason="extension_refused",
            )
        if asked_hours * 3600 > left + 1e-6:
            had = (
                f", and it was extended by {hours_text(extended_seconds / 3600)} already"
                if extended_seconds
                else ""
            )
            can = (
                f"ask for {hours_text(left / 3600)} or less"
                if left >= 60
                else "it cannot be extended further"
            )
            return Refusal(
                f"An extension of {hours_text(asked_hours)} is more than a session may be extended by "
                f"for you: {hours_text(max_hours)} in all ({source}){had}; {can}.",
                reason="extension_refused",
            )
    if delayed_waiters and not delays_allowed:
        who = words.count(delayed_waiters, "request") + (" waits" if delayed_waiters == 1 else " wait")
        return Refusal(
            f"Not extended: {who} for these GPUs and would start later than expected. "
            "Save your work before the end; the GPUs go to the queue then.",
            reason="extension_refused",
        )
    return None
