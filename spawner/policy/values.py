"""One parser per kind of value a person or program gives gpuhub: pure functions.

Every input path (the broker's JSON bodies and query strings, the spawn form and the REST
spawn's ``user_options``, the ``gpuhub`` CLI, the magics' arguments, the limits traits)
reads its values through these, so a value is taken or refused the same way everywhere:

- ``parse_count``: a whole number of things (GPUs, nodes, workers) in a range.
- ``parse_number`` (``parse_seconds``, ``parse_hours``): a finite number in a range.
- ``parse_timestamp``: a date, a date and time (any UTC offset) or a span back from now
  (``7d``, ``12h``), as naive UTC, between ``EARLIEST`` and ``LATEST``.
- ``parse_name``: a user or group name as an admin types it.
- ``parse_label``: a short free name (a GPU model, a partition).

And the other way, for people to read: ``show`` (any value, cut short), ``fmt`` (a number),
``minutes_in_words`` (a wait: ``12 min``) and ``period_in_words`` (a notice: ``5 seconds``).

Each raises :class:`BadValue` (a ``ValueError``) whose message names the field and says what
it takes. Nothing else escapes: not ``OverflowError`` (``1e400``, ``10**400``, a date past
year 9999), not a float that is not finite (``inf``, ``nan``), not a digit outside ASCII
(``²``, ``٣`` or a full-width digit, which Python's ``int`` and ``str.isdigit`` accept). Text is read only
where ``text=True``: JSON numbers must be numbers.
"""

from __future__ import annotations

import math
import re
import unicodedata
from datetime import UTC, datetime, timedelta
from typing import Any

from gpu_magics.common import words

EARLIEST = datetime(1970, 1, 1)
LATEST = datetime(3000, 1, 1)

_INT_TEXT = re.compile(r"[+-]?[0-9]{1,12}")
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]{1,15}(?:\.[0-9]{0,15})?|\.[0-9]{1,15})(?:[eE][+-]?[0-9]{1,3})?")
_SPAN_TEXT = re.compile(r"([0-9]{1,7}(?:\.[0-9]{1,6})?)([dh])")
_NAME_FORBIDDEN = set(",=/\\:;\"'`$*?!|&<>()[]{}#%")


class BadValue(ValueError):
    """A value that is refused; ``str(e)`` names the field and what it takes."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def show(value: Any, width: int = 40) -> str:
    """A value as a message can quote it: short, and never too large to print."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        digits = len(str(abs(value))) if abs(value) < 10**60 else None
        if digits is None:
            return "a number of more than 60 digits"
        return str(value)
    if isinstance(value, float):
        return repr(value) if not math.isfinite(value) else f"{value:.6g}"
    if isinstance(value, str):
        text = value if len(value) <= width else value[:width] + "..."
        return repr(text)
    if value is None:
        return "nothing"
    return f"a {type(value).__name__}"


def fmt(x: float) -> str:
    """A range bound for a message: ``4096``, ``0.01``, ``1e+09``."""
    return f"{x:g}"


def minutes_in_words(seconds: float) -> str:
    """A wait to the minute, short for a line or a column: ``under a minute``, ``12 min``,
    ``2 h 5 min`` (``gpu_magics.common.words.duration``)."""
    return words.duration(seconds)


def period_in_words(seconds: float) -> str:
    """A period in one unit, spelled out for a sentence: ``5 seconds``, ``1 minute``,
    ``2.5 hours``."""

    def unit(n: float, name: str) -> str:
        shown = f"{n:.1f}".rstrip("0").rstrip(".")
        return f"{shown} {name}{'' if shown == '1' else 's'}"

    if seconds < 120:
        return unit(seconds, "second")
    if seconds < 2 * 3600:
        return unit(seconds / 60, "minute")
    return unit(seconds / 3600, "hour")


def parse_count(raw: Any, field: str, *, lo: int = 0, hi: int, text: bool = True) -> int:
    """A whole number from ``lo`` to ``hi``: an ``int`` (not ``bool``), a float that is whole,
    or (with ``text``) ASCII digits with an optional sign."""
    what = f"{field} must be a whole number from {lo} to {hi}"
    if isinstance(raw, bool) or raw is None:
        raise BadValue(field, f"{what}; got {show(raw)}.")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, float) and math.isfinite(raw) and raw.is_integer():
        value = int(raw)
    elif text and isinstance(raw, str) and _INT_TEXT.fullmatch(raw.strip()):
        value = int(raw.strip())
    else:
        raise BadValue(field, f"{what}; got {show(raw)}.")
    if not lo <= value <= hi:
        raise BadValue(field, f"{what}; got {show(value)}.")
    return value


def parse_number(raw: Any, field: str, *, lo: float, hi: float, unit: str = "", text: bool = True) -> float:
    """A finite number from ``lo`` to ``hi`` (``-0`` is 0): an ``int`` or ``float`` (not
    ``bool``), or (with ``text``) a decimal number in ASCII, e.g. ``2``, ``0.5``, ``1e3``."""
    units = f" {unit}" if unit else ""
    what = f"{field} must be a number from {fmt(lo)} to {fmt(hi)}{units}"
    if isinstance(raw, bool) or raw is None:
        raise BadValue(field, f"{what}; got {show(raw)}.")
    if isinstance(raw, int):
        if not lo <= raw <= hi:  # compared as int: no float conversion to overflow
            raise BadValue(field, f"{what}; got {show(raw)}.")
        return float(raw) + 0.0
    if isinstance(raw, float):
        value = raw
    elif text and isinstance(raw, str) and _NUMBER_TEXT.fullmatch(raw.strip()):
        value = float(raw.strip())  # at most 1e999 digits of exponent: inf, refused below
    else:
        raise BadValue(field, f"{what}; got {show(raw)}.")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise BadValue(field, f"{what}; got {show(value)}.")
    return value + 0.0  # -0.0 + 0.0 == 0.0


def parse_seconds(raw: Any, field: str, *, lo: float, hi: float, text: bool = True) -> float:
    return parse_number(raw, field, lo=lo, hi=hi, unit="seconds", text=text)


def parse_hours(raw: Any, field: str, *, lo: float, hi: float, text: bool = True) -> float:
    return parse_number(raw, field, lo=lo, hi=hi, unit="hours", text=text)


def parse_timestamp(
    raw: Any, field: str, now: datetime, *, earliest: datetime = EARLIEST, latest: datetime = LATEST
) -> datetime:
    """``2026-11-01``, ``2026-11-01T12:00``, ``2026-11-01T12:00+01:00`` (or ``Z``), or a span
    back from ``now``: ``7d``, ``12h``. Naive UTC, as the ledger keeps times."""
    what = (
        f"{field} must be a date (2026-11-01), a date and time (2026-11-01T12:00, with an "
        f"optional UTC offset) or a span back from now (7d, 12h), from {earliest:%Y-%m-%d} "
        f"to {latest:%Y-%m-%d}"
    )
    if not isinstance(raw, str) or not raw.strip() or not raw.isascii():
        raise BadValue(field, f"{what}; got {show(raw)}.")
    stripped = raw.strip()
    try:
        span = _SPAN_TEXT.fullmatch(stripped)
        if span:
            n = float(span.group(1))
            when = now - (timedelta(days=n) if span.group(2) == "d" else timedelta(hours=n))
        else:
            when = datetime.fromisoformat(stripped.replace("Z", "+00:00").replace("z", "+00:00"))
            if when.tzinfo is not None:  # naive UTC; the offset may cross year 1 or 9999
                when = when.astimezone(UTC).replace(tzinfo=None)
    except (ValueError, OverflowError):
        raise BadValue(field, f"{what}; got {show(raw)}.") from None
    if not earliest <= when <= latest:
        raise BadValue(field, f"{what}; got {show(raw)}.")
    return when


def parse_name(raw: Any, field: str, *, max_length: int = 255, spaces: bool = False) -> str:
    """A user or group name: 1 to ``max_length`` printable characters, none of ``,=/\\:;``
    and no quote or shell character (names end up in lists, URLs and ``sacctmgr``
    arguments). ``spaces``: inner spaces allowed (directory group names such as "ml team")."""
    what = (
        f"{field} must be a user or group name: 1 to {max_length} letters, digits or "
        "characters such as . _ - @ +" + (", no space at either end" if spaces else ", without spaces")
    )
    if not isinstance(raw, str) or not 1 <= len(raw) <= max_length or (spaces and raw != raw.strip()):
        raise BadValue(field, f"{what}; got {show(raw)}.")
    for ch in raw:
        if spaces and ch == " ":
            continue
        if ch in _NAME_FORBIDDEN or ch.isspace() or unicodedata.category(ch)[0] in "CZ":
            raise BadValue(field, f"{what}; got {show(raw)}, which has {ch!r}.")
    return raw


def parse_label(raw: Any, field: str, *, max_length: int = 255) -> str:
    """A short free name (a GPU model, a partition): printable, at most ``max_length``."""
    what = f"{field} must be a name of at most {max_length} printable characters"
    if not isinstance(raw, str) or len(raw) > max_length:
        raise BadValue(field, f"{what}; got {show(raw)}.")
    if any(unicodedata.category(ch)[0] == "C" for ch in raw):
        raise BadValue(field, f"{what}; got {show(raw)}, which has a control character.")
    return raw


def argparse_type(parser, field: str, **bounds):
    """An ``argparse`` ``type=`` for a parser above: ``type=argparse_type(parse_count,
    "--gpus", lo=1, hi=4096)``. A refusal becomes argparse's one-line error,
    ``argument --gpus: must be a whole number from 1 to 4096; got 0.``"""
    import argparse

    def convert(text: str):
        try:
            return parser(text, field, **bounds)
        except BadValue as e:
            raise argparse.ArgumentTypeError(e.message.removeprefix(f"{field} ")) from None

    convert.__name__ = parser.__name__.removeprefix("parse_")
    return convert
