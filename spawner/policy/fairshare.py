"""Who goes first when every GPU is taken: fair-share priority, as pure functions.

The model is Slurm's ``priority/multifactor`` with its classic fair-share formula, so that
the local queue and a Slurm cluster order users the same way:

- **usage** is a user's GPU-hours with each past hour weighted down by half every
  ``fairshare_half_life_hours`` (Slurm's ``PriorityDecayHalfLife``);
- **shares** are what an admin gives a user or group (``c.GpuHub.*_shares``; Slurm's
  association ``Fairshare``);
- the **fair-share factor** is ``2 ** -(U / S)``, U the user's part of all recent usage and
  S their part of all shares: 1.0 for someone who used nothing, 0.5 for someone who used
  exactly their share, towards 0 for the heaviest;
- the **age factor** grows from 0 to 1 over ``priority_max_age_hours`` of waiting;
- priority = ``weight_fairshare * F + weight_age * A``. With ``weight_age >= weight_fairshare``
  (the default) a request that has waited the maximum age outranks any newcomer, so
  nobody starves; ties go to whoever asked first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from spawner.policy.scoped import Scoped, resolve


@dataclass(frozen=True)
class Shares(Scoped[int]):
    """The fair-share weights: by default (1), per group and per user."""

    default: int = 1


def share_problem(value, where: str) -> str | None:
    """Why ``value`` is not a share (a whole number of 1 or more), naming the setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return (
            f"{where} must be a whole number of 1 or more (a user's weight in the fair share); got {value!r}"
        )
    return None


def effective_share(user: str, groups: Iterable[str], shares: Shares) -> tuple[int, str]:
    """A user's share and where it comes from: their own, else their groups' largest, else
    the default (:func:`spawner.policy.scoped.resolve`)."""
    return resolve(user, groups, shares)


def decayed_usage(
    intervals: Iterable[tuple[datetime, datetime | None, int]], now: datetime, half_life_hours: float
) -> float:
    """GPU-hours of ``(start, end or None while running, gpus)``, each hour weighted by
    ``2 ** -(its age / half_life)``: the integral of that weight over each interval."""
    import math

    k = math.log(2) / half_life_hours
    total = 0.0
    for start, end, gpus in intervals:
        hi = min(end or now, now)
        if hi <= start or gpus <= 0:
            continue
        a_lo = (now - hi).total_seconds() / 3600.0  # age of the interval's newer end
        a_hi = (now - start).total_seconds() / 3600.0
        total += gpus * (math.exp(-k * a_lo) - math.exp(-k * a_hi)) / k
    return total


def fairshare_factor(usage: float, share: float, total_usage: float, total_shares: float) -> float:
    """Slurm's classic ``2 ** -(U/S)``; 1.0 when nobody (or this user) used anything."""
    if usage <= 0 or total_usage <= 0:
        return 1.0
    if share <= 0 or total_shares <= 0:
        return 0.0
    return 2.0 ** (-(usage / total_usage) / (share / total_shares))


def age_factor(waited_seconds: float, max_age_hours: float) -> float:
    if max_age_hours <= 0:
        return 1.0
    return max(0.0, min(1.0, waited_seconds / (max_age_hours * 3600.0)))


@dataclass(frozen=True)
class Weights:
    fairshare: int = 1000
    age: int = 1000
    max_age_hours: float = 24.0
    half_life_hours: float = 168.0


@dataclass(frozen=True)
class Factors:
    """Why an entry stands where it does (shown to admins)."""

    fairshare: float
    age: float
    priority: float
    share: int
    usage: float  # decayed GPU-hours
    front: bool = False


@dataclass(frozen=True)
class Candidate:
    """A waiting request as the ordering sees it."""

    id: int
    user: str
    created: datetime
    front: datetime | None = None  # an admin moved it to the front at this time


def factors(
    waiting: Iterable[Candidate],
    usage: Mapping[str, float],
    share: Mapping[str, int],
    now: datetime,
    weights: Weights,
) -> dict[int, Factors]:
    """Each waiting entry's factors. ``usage`` and ``share`` cover every user who counts
    (the waiting and everyone with recent usage); a user missing from ``share`` has 1."""
    users = set(usage) | set(share)
    waiting = list(waiting)
    users |= {c.user for c in waiting}
    total_usage = sum(max(0.0, usage.get(u, 0.0)) for u in users)
    total_shares = sum(share.get(u, 1) for u in users)
    out = {}
    for c in waiting:
        f = fairshare_factor(usage.get(c.user, 0.0), share.get(c.user, 1), total_usage, total_shares)
        a = age_factor((now - c.created).total_seconds(), weights.max_age_hours)
        out[c.id] = Factors(
            fairshare=f,
            age=a,
            priority=weights.fairshare * f + weights.age * a,
            share=share.get(c.user, 1),
            usage=usage.get(c.user, 0.0),
            front=c.front is not None,
        )
    return out


def order(waiting: Iterable[Candidate], found: Mapping[int, Factors]) -> list[Candidate]:
    """The queue's order: entries an admin moved to the front (latest move first), then by
    priority, then whoever asked first."""

    def key(c: Candidate):
        if c.front is not None:
            return (0, -c.front.timestamp(), 0.0, c.created, c.id)
        return (1, 0.0, -found[c.id].priority, c.created, c.id)

    return sorted(waiting, key=key)
