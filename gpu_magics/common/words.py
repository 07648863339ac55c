"""How gpuhub writes counts and times for people: one way everywhere (stdlib only).

Every page, cell, notice and CLI line reads through these, so a count is never "1 GPUs" or
"GPU(s)" and a time is always UTC in one format:

- ``count(n, "GPU")``: ``1 GPU``, ``2 GPUs``, ``0 GPUs`` (``plural`` for irregular nouns).
- ``stamp(when)``: a date and time, ``2026-12-03 07:36:41 UTC``.
- ``clock(when)``: a time of day in a sentence, ``07:36:41 UTC``.

``when`` is an aware or naive-UTC ``datetime`` or POSIX seconds; naive means UTC (the ledger
stores naive UTC).
"""

from __future__ import annotations

from datetime import UTC, datetime

STAMP = "%Y-%m-%d %H:%M:%S UTC"
CLOCK = "%H:%M:%S UTC"


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun, singular for exactly one: ``count(1, "GPU") == "1 GPU"``."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def _utc(when: datetime | float | int) -> datetime:
    if isinstance(when, datetime):
        return when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    return datetime.fromtimestamp(when, UTC)


def stamp(when: datetime | float | int) -> str:
    """``2026-12-03 07:36:41 UTC``: a moment, to the second, in UTC."""
    return _utc(when).strftime(STAMP)


def clock(when: datetime | float | int) -> str:
    """``07:36:41 UTC``: the time of day of a moment in UTC, for a sentence about today."""
    return _utc(when).strftime(CLOCK)


def duration(seconds: float) -> str:
    """A length to the minute, short for a line or a column: ``under a minute``, ``12 min``,
    ``2 h 5 min``."""
    minutes = max(0, round(seconds / 60))
    if minutes < 1:
        return "under a minute"
    if minutes < 60:
        return f"{minutes} min"
    hours, rest = divmod(minutes, 60)
    return f"{hours} h" if rest == 0 else f"{hours} h {rest} min"
