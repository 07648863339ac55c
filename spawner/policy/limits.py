"""Limits: what a user may hold, and whether a request fits (pure).

Nothing here touches a database, a clock or a process. The ledger gathers the facts
(what exists, what is free, what a user holds and has used) into frozen dataclasses,
asks these functions, and records the answer.

Contract:

- ``effective_limit(user, groups, rules)``: found as every scoped setting is
  (:func:`spawner.policy.scoped.resolve`: the user's own rule, else their groups', else the
  default); among several groups the most generous value of each field wins (``None`` means
  unlimited, which is the most generous of all).
- ``check_request(...)``: whether a request fits; raises :class:`Refusal` whose message
  says what the user holds, their limit and what would fit.
- ``gpu_hours_used(...)``: GPU-hours inside a rolling window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from gpu_magics.common import words
from spawner.policy.placement import Gpu, Request, largest_placeable, models_in
from spawner.policy.scoped import Scoped, resolve
from spawner.policy.values import parse_count, parse_hours, parse_number, show

DEFAULT_WINDOW_HOURS = 168.0

MAX_COUNT = 4096  # GPUs or nodes one request may ask for: more than any one gpuhub holds

# what a limit may say, wherever it comes from (traits, CLI, API, a ledger row): generous
# ranges (a limit far above the cluster is how admins write "practically unlimited"), bounded
# where arithmetic or JSON would break (a window beyond what a timedelta holds, inf, NaN)
MAX_LIMIT_GPUS = 1_000_000
MAX_GPU_HOURS = 1e12
MIN_WINDOW_HOURS = 0.01
MAX_WINDOW_HOURS = 100 * 8766.0  # 100 years


@dataclass(frozen=True)
class Limit:
    """How much one user may hold. ``None`` means unlimited."""

    max_gpus: int | None = None
    gpu_hours: float | None = None
    window_hours: float = DEFAULT_WINDOW_HOURS


def parse_limit_field(name: str, raw, *, text: bool, field: str | None = None):
    """One field of a new limit (``max_gpus``, ``gpu_hours``, ``window_hours``) read with its
    range, the same for the CLI, the broker's API and the traits; raises ``values.BadValue``
    naming ``field`` (default: ``name``)."""
    label = field or name
    if name == "max_gpus":
        return parse_count(raw, label, lo=0, hi=MAX_LIMIT_GPUS, text=text)
    if name == "gpu_hours":
        return parse_number(raw, label, lo=0, hi=MAX_GPU_HOURS, unit="GPU-hours", text=text)
    if name == "window_hours":
        return parse_hours(raw, label, lo=MIN_WINDOW_HOURS, hi=MAX_WINDOW_HOURS, text=text)
    raise ValueError(f"a limit has no field {name!r}")


def limit_problem(limit: Limit) -> str | None:
    """What makes ``limit`` unusable (``None`` when it is fine): each field's allowed range.

    The ledger refuses to store such a limit, and ignores (with a warning) one already
    stored by an older version or a direct write, rather than fail every request it meets.
    New input is held to the tighter ranges of its parser (``MAX_LIMIT_GPUS`` GPUs).
    """
    m, h, w = limit.max_gpus, limit.gpu_hours, limit.window_hours
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
        return f"max GPUs must be a whole number of 0 or more (or unlimited); got {show(m)}"
    if h is not None and (
        isinstance(h, bool) or not isinstance(h, int | float) or not 0 <= h <= MAX_GPU_HOURS
    ):
        return f"GPU-hours must be a number from 0 to {MAX_GPU_HOURS:g} (or unlimited); got {show(h)}"
    if isinstance(w, bool) or not isinstance(w, int | float) or not MIN_WINDOW_HOURS <= w <= MAX_WINDOW_HOURS:
        return (
            f"the GPU-hours window must be from {MIN_WINDOW_HOURS:g} to {MAX_WINDOW_HOURS:g} hours; "
            f"got {show(w)}"
        )
    return None


@dataclass(frozen=True)
class LimitRules(Scoped[Limit]):
    """The limits: by default (1 GPU), per group and per user."""

    default: Limit = Limit(max_gpus=1)


@dataclass(frozen=True)
class EffectiveLimit:
    limit: Limit
    source: str  # "user alice", "group students", "groups staff, students", "default"


def _most_generous(values: Iterable[float | None]) -> float | None:
    values = list(values)
    if any(v is None for v in values):
        return None
    return max(values)  # type: ignore[type-var]


def most_generous(found: Sequence[tuple[str, Limit]]) -> tuple[Limit, Sequence[str]]:
    """Several groups' limits as one: the most generous value of each field, from every group.
    The window travels with the GPU-hours quota it belongs to (of equal quotas, the window of
    the group whose name sorts first, as it always was)."""
    limits = [lim for _, lim in found]
    max_gpus = _most_generous(lim.max_gpus for lim in limits)
    hours = _most_generous(lim.gpu_hours for lim in limits)
    window = next(
        (lim.window_hours for lim in limits if hours is not None and lim.gpu_hours == hours),
        DEFAULT_WINDOW_HOURS,
    )
    merged = Limit(max_gpus=None if max_gpus is None else int(max_gpus), gpu_hours=hours, window_hours=window)
    return merged, [name for name, _ in found]


def effective_limit(user: str, groups: Iterable[str], rules: LimitRules) -> EffectiveLimit:
    """A user's limit and where it comes from."""
    return EffectiveLimit(*resolve(user, groups, rules, combine=most_generous))


class Refusal(Exception):
    """A request the policy refuses. ``message`` is for the user; ``reason`` is a short label."""

    status_codes = {
        "bad_request": 400,
        "unknown_model": 400,
        "too_large": 400,
        "over_limit": 403,
        "over_time_limit": 403,  # longer than the user's longest session (c.GpuHub.*_max_hours)
        "extension_refused": 403,  # more time than the policy grants now (policy.extensions)
        "quota_exhausted": 403,
        "energy_budget_spent": 403,
        "no_capacity": 409,
        "no_borrowing": 409,  # beyond the limit while someone waits: only idle GPUs are lent
        "not_found": 404,
    }

    def __init__(self, message: str, *, reason: str, fits: int | None = None):
        super().__init__(message)
        self.message = message
        self.reason = reason
        self.fits = fits

    @property
    def status_code(self) -> int:
        return self.status_codes.get(self.reason, 400)


@dataclass(frozen=True)
class Holdings:
    """What a user has now: GPUs held and GPU-hours used in their limit's window."""

    held: int = 0
    gpu_hours: float = 0.0


def _plural(n: int, word: str = "GPU") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def describe_limit(eff: EffectiveLimit) -> str:
    if eff.limit.max_gpus is None:
        return f"no limit ({eff.source})"
    return f"a limit of {eff.limit.max_gpus} ({eff.source})"


def zero_limit_message(n: int, eff: EffectiveLimit) -> str:
    """A limit of 0: no GPUs here at all, not even idle ones lent beyond a limit."""
    return (
        f"You asked for {words.count(n, 'GPU')}, but your limit is 0 GPUs ({eff.source}): no GPUs at all, "
        "not even idle ones lent beyond a limit. Ask an admin of this hub to raise your limit."
    )


def over_limit_advice(room: int) -> str:
    """What the limit still lets a user hold, and what to do (only the limit's fact: what is
    free now is another, which the form says and the queue waits for)."""
    if room <= 0:
        return "your limit lets you hold no more. Stop something you hold first, or ask an admin to raise it."
    return f"your limit lets you hold {words.count(room, 'more GPU')}. Ask for {room} or fewer."


def remaining(eff: EffectiveLimit, holdings: Holdings) -> int | None:
    """How many more GPUs the limit allows; ``None`` when unlimited. Where slices are held
    (``spawner.policy.slices``) what is held and what is left may be a ``Fraction``."""
    if eff.limit.gpu_hours is not None and holdings.gpu_hours >= eff.limit.gpu_hours:
        return 0
    if eff.limit.max_gpus is None:
        return None
    return max(0, eff.limit.max_gpus - holdings.held)


def check_request(
    request: Request,
    eff: EffectiveLimit,
    holdings: Holdings,
    inventory: Sequence[Gpu],
    free: Sequence[Gpu],
) -> None:
    """Raise :class:`Refusal` unless ``request`` may be placed now.

    Checks in the order a user can act on: a malformed count, a model that does not
    exist, more than the machine could ever give, the GPU-hours quota, the concurrent
    limit, then what is free right now.
    """
    n = request.count
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise Refusal(
            f"The GPU count must be a whole number of 0 or more; got {n!r}.",
            reason="bad_request",
        )
    models = models_in(inventory)
    if request.model is not None and request.model not in models:
        have = ", ".join(models) if models else "none"
        raise Refusal(
            f"There is no GPU model {request.model!r} here. Models here: {have}. "
            "Ask for one of those, or leave the model empty for any.",
            reason="unknown_model",
        )
    most = largest_placeable(inventory, request.model, request.max_nodes)
    if n > most:
        where = "one server" if request.max_nodes == 1 else "this cluster"
        raise Refusal(
            f"You asked for {_plural(n)}, but {where} has at most {most}"
            f"{' of model ' + request.model if request.model else ''}. "
            f"Ask for {most} or fewer.",
            reason="too_large",
            fits=most,
        )
    if n == 0:
        return
    if eff.limit.max_gpus == 0:  # none at all, not even borrowed (borrowing.usable_allowance)
        raise Refusal(zero_limit_message(n, eff), reason="over_limit", fits=0)
    room = remaining(eff, holdings)
    if room is not None:  # whole GPUs: the part of one that slices held leave is no room for one
        room = int(room)
    free_now = largest_placeable(free, request.model, request.max_nodes)
    fits = free_now if room is None else min(room, free_now)
    lim = eff.limit
    if lim.gpu_hours is not None and holdings.gpu_hours >= lim.gpu_hours:
        raise Refusal(
            f"You have used {holdings.gpu_hours:.1f} of your {lim.gpu_hours:g} GPU-hours "
            f"over the last {lim.window_hours:g} hours ({eff.source}). "
            "Start a server without GPUs (0), or wait until older usage leaves the window.",
            reason="quota_exhausted",
            fits=0,
        )
    if room is not None and n > room:
        raise Refusal(
            f"You asked for {_plural(n)}, but you hold {holdings.held} of "
            f"{describe_limit(eff)}: {over_limit_advice(room)}",
            reason="over_limit",
            fits=fits,
        )
    if n > free_now:
        busy = len(inventory) - len(free)
        raise Refusal(
            f"You asked for {_plural(n)}, but only {free_now} "
            f"{'is' if free_now == 1 else 'are'} free"
            f"{' on one server' if request.max_nodes == 1 else ''} now "
            f"({busy} of {len(inventory)} in use). You hold {holdings.held} of "
            f"{describe_limit(eff)}. Ask for {fits} or fewer, or try again later.",
            reason="no_capacity",
            fits=fits,
        )


def gpu_hours_used(
    intervals: Iterable[tuple[datetime, datetime | None, int]],
    now: datetime,
    window_hours: float,
) -> float:
    """GPU-hours of ``(start, end or None while running, gpus)`` inside the last window."""
    window_start = now - timedelta(hours=window_hours)
    total = 0.0
    for start, end, gpus in intervals:
        lo = max(start, window_start)
        hi = min(end or now, now)
        if hi > lo:
            total += gpus * (hi - lo).total_seconds() / 3600.0
    return total
