"""How a wait in the queue reads to the person waiting (pure): the one line the spawn page's
progress, the notebook's magics and the Slurm spawner all show."""

from __future__ import annotations

from datetime import UTC, datetime

from spawner.policy.values import minutes_in_words

SURE_WORDS = {
    "now": "GPUs are free for it now",
    "firm": "when a notice or an idle reclaim is due",
    "limit": "when a time limit ends",
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


def utc_clock(at: datetime) -> str:
    """``HH:MM UTC`` of a naive-UTC ``at``: gpuhub writes every time in UTC, whatever this
    machine's zone (a reader's browser may be anywhere)."""
    return at.replace(tzinfo=UTC).strftime("%H:%M UTC")


def wait_line(
    position: int | None,
    waiting: int,
    gpus: int | str,
    expected: datetime | None,
    sure: str,
    now: datetime,
) -> str:
    """E.g. ``2nd of 4 waiting for 2 GPUs, expected start about 14:20 (in 12 min; a guess
    from recent run lengths)``; without a ``position`` (one the caller cannot count) just
    ``waiting for 2 GPUs, ...``. Times are naive UTC, and shown in UTC."""
    head = f"waiting for {gpus if isinstance(gpus, str) else _plural(gpus)}"
    if position is not None:
        head = f"{ordinal(position)} of {waiting} {head}"
    if expected is None:
        if sure == "slice":  # gpus: "1/4 GPU"
            return f"{head}; it starts when a slice frees up (no start time is estimated for slices yet)"
        if sure == "slurm":
            return f"{head}; no estimate from Slurm yet (its backfill pass gives one shortly)"
        return f"{head}; no expected start yet (nothing now running has an end in sight)"
    if sure == "default":  # only the default run length to go by: no hours invented
        return f"{head}; cannot tell yet when it starts (no run here has ended yet to go by)"
    left = (expected - now).total_seconds()
    why = f"{SURE_WORDS.get(sure, sure)}, not a promise"
    if left <= 60:
        return f"{head}, expected start within a minute ({why})"
    return f"{head}, expected start about {utc_clock(expected)} (in {minutes_in_words(left)}; {why})"


QUEUE_PROGRESS = (10, 50)  # the spawn page's bar while waiting: from last in the queue to first


def queue_progress(position: int, waiting: int) -> int:
    """The spawn page's bar (percent) at ``position`` of ``waiting``: it grows as the place
    nears the first, and stands at the top of the queue's part of the bar when first."""
    lo, hi = QUEUE_PROGRESS
    if position <= 0 or waiting <= 0:
        return lo
    position = min(position, waiting)
    return lo + round((hi - lo) * (waiting - position + 1) / waiting)


def queue_heading(position: int, waiting: int) -> str:
    """The spawn page's heading while a start waits, e.g. ``Waiting for GPUs: 2nd of 3 in
    the queue``."""
    if position <= 0 or waiting <= 0:
        return "Waiting for GPUs in the queue"
    return f"Waiting for GPUs: {ordinal(position)} of {waiting} in the queue"


def left_message(gpus: int | str, reason: str | None) -> str:
    """What a start says when its request left the queue without its GPUs: the reason, and,
    unless the reason already says what to do, that a new start waits anew."""
    reason = reason or "it left the queue"
    advice = "" if "start again" in reason else " Start the server again to wait anew."
    amount = gpus if isinstance(gpus, str) else _plural(gpus)
    return f"Your request for {amount} no longer waits: {reason}.{advice}"
