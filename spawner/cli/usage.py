"""``gpuhub usage``: GPU-hours per user over a period (``--since``, ``--until``, ``--user``)."""

from __future__ import annotations

from datetime import datetime

from gpu_magics.common import words
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import UsageError, format_table, iso, parse_name, print_json
from spawner.cli.parsers import command
from spawner.policy import values


def register(sub) -> None:
    usage = command(sub, "usage", run, json_output=True, help="GPU-hours per user")
    usage.add_argument("--since", default="30d", help="start: a date or a span such as 7d (default 30d)")
    usage.add_argument("--until", help="end (default: now)")
    usage.add_argument("--user")


def parse_when(text: str, now: datetime, field: str = "the date") -> datetime:
    """``2026-11-01``, ``2026-11-01T12:00`` or a span back from now: ``7d``, ``12h``."""
    try:
        return values.parse_timestamp(text, field, now)
    except values.BadValue as e:
        raise UsageError(str(e)) from None


def run(args, out) -> int:
    ledger = open_ledger(load_settings(args))
    from spawner.ledger import utcnow

    now = utcnow()
    since = parse_when(args.since, now, "--since")
    until = parse_when(args.until, now, "--until") if args.until else now
    if until <= since:
        raise UsageError("--until must be after --since")
    user = parse_name(args.user, "--user") if args.user is not None else None
    hours = ledger.usage(since, until, user=user)
    if args.json:
        per_user = {u: round(h, 4) for u, h in sorted(hours.items())}
        return print_json({"since": iso(since), "until": iso(until), "gpu_hours": per_user}, out)
    rows = [(u, f"{h:.2f}") for u, h in sorted(hours.items())]
    print(f"GPU-hours from {words.stamp(since)} to {words.stamp(until)}", file=out)
    print(format_table(("USER", "GPU-HOURS"), rows), file=out)
    return 0
