"""How long a server or a burst may run: the admin's maxima and a request's own ask (pure).

- :class:`TimeRules`: ``c.GpuHub.default_max_hours``, ``group_max_hours``, ``user_max_hours``
  (hours, or None: no limit). A user's own entry wins; among their groups the most generous
  (None, no limit, beats any number).
- :func:`hours_problem`: why a configured maximum is refused (None if it is taken).
- :func:`parse_asked_hours`: a request's own ask (the spawn form, the burst's JSON, the magic).
- :func:`session_seconds`: the length granted: the ask, which may be less than the maximum and
  never more (refused at once: it can never fit), else the maximum.
When it runs out: ``AllocationInfo.time_ends`` (firm: the allocation ends then).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from gpu_magics.common import words
from spawner.policy import values
from spawner.policy.limits import Refusal
from spawner.policy.scoped import Scoped, resolve

MIN_HOURS = 1 / 60  # a minute: shorter is a mistake, not a session
MAX_HOURS = 24 * 366.0  # a year
RANGE = f"from 1/60 (a minute) to {values.fmt(MAX_HOURS)} (a year)"


@dataclass(frozen=True)
class TimeRules(Scoped[float | None]):
    """The longest session, in hours, by default, per group and per user (None: no limit)."""

    default: float | None = None


def hours_problem(value: Any, where: str) -> str | None:
    """Why a configured maximum ``value`` is refused, naming the setting ``where``; None if taken."""
    if value is None:
        return None
    what = f"{where} must be a number of hours {RANGE} (for example 8), or None for no limit"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{what}; got {values.show(value)}."
    if not math.isfinite(value) or not MIN_HOURS <= value <= MAX_HOURS:
        return f"{what}; got {values.show(value)}."
    return None


def read_hours(value: Any, where: str) -> float | None:
    """A configured maximum as a float (None: no limit), or ``ValueError`` naming ``where``."""
    why = hours_problem(value, where)
    if why:
        raise ValueError(why)
    return None if value is None else float(value)


def most_generous(found: Sequence[tuple[str, float | None]]) -> tuple[float | None, Sequence[str]]:
    """Among a user's groups: no limit beats any; else the longest (ties: the name sorting last)."""
    unlimited = [name for name, v in found if v is None]
    if unlimited:
        return None, (unlimited[-1],)
    name, value = max(found, key=lambda nv: (nv[1], nv[0]))
    return value, (name,)


def max_hours(user: str, groups: Iterable[str], rules: TimeRules) -> tuple[float | None, str]:
    """The user's longest session in hours (None: no limit) and where that comes from."""
    return resolve(user, groups, rules, combine=most_generous)


def hours_text(hours: float) -> str:
    """``8 h``, ``1 h 30 min``, ``2 min``: a length as the pages and the refusals say it."""
    return values.minutes_in_words(hours * 3600)


def parse_asked_hours(raw: Any, field: str = "hours", *, text: bool = True) -> float | None:
    """A request's own length in hours: absent (None: the user's maximum) or a number from a
    minute to a year; ``text``: a form's string is read too. Raises ``values.BadValue``."""
    if raw is None or (text and isinstance(raw, str) and not raw.strip()):
        return None
    try:
        return values.parse_hours(raw, field, lo=MIN_HOURS, hi=MAX_HOURS, text=text)
    except values.BadValue:
        raise values.BadValue(
            field, f"{field} must be a number of hours {RANGE}; got {values.show(raw)}."
        ) from None


def session_seconds(asked_hours: float | None, maximum: float | None, source: str) -> float | None:
    """The seconds a request may run (None: no limit). An ask beyond the maximum can never be
    granted, so it is refused at once, with the maximum and where it comes from."""
    if asked_hours is not None and maximum is not None and asked_hours > maximum + 1e-9:
        raise Refusal(
            f"A session of {hours_text(asked_hours)} is longer than the {hours_text(maximum)} a "
            f"session may run for you ({source}); ask for {hours_text(maximum)} or less.",
            reason="over_time_limit",
            fits=None,
        )
    hours = asked_hours if asked_hours is not None else maximum
    return None if hours is None else hours * 3600.0


def time_up_text(seconds: float, ends: datetime) -> str:
    """Why an allocation ended at its time limit: ``its time limit (8 h) ran out at 21:40:00 UTC``."""
    return f"its time limit ({hours_text(seconds / 3600)}) ran out at {words.clock(ends)}"


def ends_at(started: datetime | None, created: datetime, seconds: float | None) -> datetime | None:
    """When a time limit of ``seconds`` runs out: counted from the start (a server's, a Slurm
    job's), or from the creation until then (None: no limit)."""
    return None if seconds is None else (started or created) + timedelta(seconds=seconds)


def is_up(started: datetime | None, created: datetime, seconds: float | None, now: datetime) -> bool:
    """Whether a time limit of ``seconds`` ran out by ``now`` (``ends_at``)."""
    ends = ends_at(started, created, seconds)
    return ends is not None and ends <= now


MAX_WARNING_MINUTES = 7 * 24 * 60.0


def read_warnings(raw: Any, where: str) -> tuple[float, ...]:
    """The warning times in minutes before an end, latest first, once each; ``ValueError``
    naming ``where`` for anything but numbers from 0.1 to a week."""
    if not isinstance(raw, list | tuple):
        raise ValueError(f"{where} must be a list of minutes, e.g. [30, 5]; got {values.show(raw)}.")
    out = set()
    for m in raw:
        if isinstance(m, bool) or not isinstance(m, int | float) or not math.isfinite(m):
            ok = False
        else:
            ok = 0.1 <= m <= MAX_WARNING_MINUTES
        if not ok:
            raise ValueError(
                f"{where} must hold numbers of minutes from 0.1 to {values.fmt(MAX_WARNING_MINUTES)} "
                f"(a week), e.g. [30, 5]; got {values.show(m)}."
            )
        out.add(float(m))
    return tuple(sorted(out, reverse=True))
