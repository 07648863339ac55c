"""Idle GPU reclaim: when an allocation's GPUs count as idle, and what happens then.

Pure functions over what the broker has heard (no I/O, the clock passed in):

- An allocation is **busy** while any of its GPUs is at or above the utilization threshold,
  or its owner's code is active (a kernel of its server busy or recently used; for a burst,
  a cell on its engines). Its idle time runs from the latest of: its start, the start of the
  current unbroken run of reports, its last busy GPU sample, its last activity.
- It is **unknown** (never reclaimed) when its GPUs have not reported for ``stale_after``
  seconds: a GPU whose use cannot be seen is not taken.
- After ``warn_after`` idle seconds the owner is **warned**; after ``reclaim_after`` idle
  seconds, and at least ``reclaim_after - warn_after`` seconds after the warning, it is
  **reclaimed** (a server only when ``servers == "stop"``). Any use clears the warning.
- Exempt users and groups, allocations without GPUs, and a disabled policy are never
  warned or reclaimed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

STATES = ("off", "exempt", "unknown", "active", "warned", "reclaim")


@dataclass(frozen=True)
class IdleRules:
    enabled: bool = True
    threshold: float = 5.0  # percent utilization below which a GPU counts as idle
    warn_after: float = 900.0  # seconds
    reclaim_after: float = 3600.0  # seconds
    stale_after: float = 180.0  # seconds without a report: unknown
    servers: str = "stop"  # "stop": reclaim servers too; "warn": only warn their owners
    exempt_users: frozenset[str] = field(default_factory=frozenset)
    exempt_groups: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if not 0 <= self.threshold <= 100:
            raise ValueError(f"the utilization threshold is a percentage, 0 to 100; got {self.threshold}")
        if not 0 < self.warn_after < self.reclaim_after:
            raise ValueError(
                f"warn_after ({self.warn_after:g} s) must be more than 0 and less than "
                f"reclaim_after ({self.reclaim_after:g} s), so the owner is warned first"
            )
        if self.stale_after <= 0:
            raise ValueError(f"stale_after must be more than 0 seconds; got {self.stale_after:g}")
        if self.servers not in ("stop", "warn"):
            raise ValueError(f"servers is 'stop' or 'warn'; got {self.servers!r}")

    @property
    def notice(self) -> float:
        """The least time between a warning and the reclaim."""
        return self.reclaim_after - self.warn_after


@dataclass(frozen=True)
class Watch:
    """What the broker heard about one live allocation. Times in seconds (one clock)."""

    allocation_id: int
    user: str
    purpose: str  # "server" or "distributed"
    gpus: int
    started: float
    reporting_since: float | None = None
    last_report: float | None = None
    last_busy: float | None = None  # last sample with a GPU at or above the threshold
    last_active: float | None = None  # last kernel or pool activity
    warned_at: float | None = None


@dataclass(frozen=True)
class Verdict:
    state: str  # one of STATES
    idle_seconds: float = 0.0
    reclaim_at: float | None = None  # when it will be reclaimed if it stays idle
    reason: str = ""
    since: float | None = None  # when this spell of idleness began (the clock's seconds)


def is_exempt(rules: IdleRules, user: str, groups: Iterable[str]) -> bool:
    return user in rules.exempt_users or bool(rules.exempt_groups.intersection(groups))


def idle_since(w: Watch) -> float:
    return max(t for t in (w.started, w.reporting_since, w.last_busy, w.last_active) if t is not None)


def duration(seconds: float) -> str:
    """``45 s``, ``12 min``, ``2.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe_idle(rules: IdleRules, gpus: int, seconds: float) -> str:
    return (
        f"its {gpus} GPU{'s' if gpus != 1 else ''} stayed below {rules.threshold:g}% utilization "
        f"with no kernel activity for {duration(seconds)}"
    )


def judge(w: Watch, rules: IdleRules, groups: Iterable[str], now: float) -> Verdict:
    """What to do about one allocation now."""
    if not rules.enabled or w.gpus <= 0:
        return Verdict("off")
    if is_exempt(rules, w.user, groups):
        return Verdict("exempt")
    if w.last_report is None or now - w.last_report > rules.stale_after:
        return Verdict("unknown")
    since = idle_since(w)
    idle = max(0.0, now - since)
    warned = w.warned_at is not None and w.warned_at >= since
    reclaim_at = since + rules.reclaim_after
    if warned:
        reclaim_at = max(reclaim_at, w.warned_at + rules.notice)
    never = w.purpose == "server" and rules.servers == "warn"
    reason = describe_idle(rules, w.gpus, idle)
    if idle < rules.warn_after:
        return Verdict("active", idle, None if never else reclaim_at, since=since)
    if warned and now >= reclaim_at and not never:
        return Verdict("reclaim", idle, reclaim_at, reason, since)
    if not warned:
        reclaim_at = max(reclaim_at, now + rules.notice)
    return Verdict("warned", idle, None if never else reclaim_at, reason, since)


def after_samples(w: Watch, busy_gpu: bool, now: float, stale_after: float) -> Watch:
    """The watch after its GPUs reported at ``now`` (``busy_gpu``: one was at or above the
    threshold). A gap longer than ``stale_after`` starts a new run of reports: what happened
    in the gap is unknown, so it is not counted as idle."""
    fresh = w.last_report is None or now - w.last_report > stale_after
    return replace(
        w,
        reporting_since=now if fresh else w.reporting_since,
        last_report=now,
        last_busy=now if busy_gpu else w.last_busy,
    )


def after_activity(w: Watch, active_for: float, now: float) -> Watch:
    """The watch after its owner's code reported being last active ``active_for`` seconds
    ago (0: busy now)."""
    seen = now - max(0.0, active_for)
    return replace(w, last_active=seen if w.last_active is None else max(w.last_active, seen))


def gpu_hours(gpus: int, seconds: float) -> float:
    return gpus * max(0.0, seconds) / 3600
