"""What every ``gpuhub`` command shares: :class:`UsageError` (one line on stderr, exit 2),
the tables and JSON it prints, and the one check of a name it is given."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

from spawner.policy import values


class UsageError(Exception):
    pass


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_json(value, out) -> int:
    print(json.dumps(value, indent=2), file=out)
    return 0


def iso(when: datetime | None) -> str | None:
    return None if when is None else when.strftime("%Y-%m-%dT%H:%M:%SZ")


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def parse_name(text: str, field: str, *, spaces: bool = False) -> str:
    try:
        return values.parse_name(text, field, spaces=spaces)
    except values.BadValue as e:
        raise UsageError(str(e)) from None
