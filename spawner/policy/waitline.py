"""How a wait in the queue reads to the person waiting (pure): the one line the spawn page's
progress, the notebook's magics and the Slurm spawner all show."""

from __future__ import annotations

from datetime import UTC, datetime

from spawner.policy.values import minutes_in_words

SURE_WORDS = {
    "now": "GPUs are free for it now",
    "firm": "when a lease or an idle reclaim ends",
    "likely": "from idle reclaims and leases",
    "guess": "a guess from recent run lengths",
    "slurm": "Slurm's estimate",
    "unknown": "no estimate yet",
}


def ordinal(n: int) -> str:
    if 10 <= n % 100 <= 20:
        suffix = "th"
    else:
        suffix = {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _plural(n: int, word: str = "GPU") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def local_clock(at: datetime) -> str:
    """``HH:MM ZONE`` in this machine's time zone of a naive-UTC ``at`` (the zone named: the
    reader's browser may be elsewhere)."""
    return at.replace(tzinfo=UTC).astimezone().strftime("%H:%M %Z").strip()


def wait_line(
    position: int | None,
    waiting: int,
    gpus: int,
    expected: datetime | None,
    sure: str,
    now: datetime,
) -> str:
    """E.g. ``2nd of 4 waiting for 2 GPUs, expected start about 14:20 (in 12 min; a guess
    from recent run lengths)``; without a ``position`` (one the caller cannot count) just
    ``waiting for 2 GPUs, ...``. Times are naive UTC; shown in local time."""
    head = f"waiting for {_plural(gpus)}"
    if position is not None:
        head = f"{ordinal(position)} of {waiting} {head}"
    if expected is None:
        if sure == "slurm":
            return f"{head}; no estimate from Slurm yet (its backfill pass gives one shortly)"
        return f"{head}; no expected start yet (nothing now running has an end in sight)"
    left = (expected - now).total_seconds()
    when = f"about {local_clock(expected)}" if left > 60 else "any moment"
    words = minutes_in_words(left)
    return f"{head}, expected start {when} (in {words}; {SURE_WORDS.get(sure, sure)}, not a promise)"
