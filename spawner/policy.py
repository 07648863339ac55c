"""Allocation policy: every decision the GPU ledger makes, as pure functions.

Nothing here touches a database, a clock or a process. The ledger gathers the facts
(what exists, what is free, what a user holds and has used) into frozen dataclasses,
asks these functions, and records the answer.

Contract:

- ``effective_limit(user, groups, rules)``: a user's own rule wins over their groups',
  their groups' over the default. Among several groups the most generous value of each
  field wins (``None`` means unlimited, which is the most generous of all).
- ``check_request(...)``: whether a request fits; raises :class:`Refusal` whose message
  says what the user holds, their limit and what would fit.
- ``place(...)``: which GPUs to take. Deterministic. Pack onto as few nodes as possible:
  a request that fits on one node goes to the node with the fewest free GPUs that still
  fits it (best fit, keeping big holes for big requests); a multi-node request takes the
  fullest nodes (whole free nodes first among equals), then the best-fitting node for the
  remainder.
- ``gpu_hours_used(...)``: GPU-hours inside a rolling window.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from itertools import chain

from spawner.values import parse_count, parse_hours, parse_number, show

DEFAULT_WINDOW_HOURS = 168.0

MAX_COUNT = 4096  # GPUs or nodes one request may ask for: more than any one gpuhub holds

# what a limit may say, wherever it comes from (traits, CLI, API, a ledger row): generous
# ranges (a limit far above the cluster is how admins write "practically unlimited"), bounded
# where arithmetic or JSON would break (a window beyond what a timedelta holds, inf, NaN)
MAX_LIMIT_GPUS = 1_000_000
MAX_GPU_HOURS = 1e12
MIN_WINDOW_HOURS = 0.01
MAX_WINDOW_HOURS = 100 * 8766.0  # 100 years


@dataclass(frozen=True, order=True)
class Gpu:
    """One GPU as the inventory knows it."""

    node: str
    index: int
    model: str = "GPU"
    memory_mib: int | None = field(default=None, compare=False)
    uuid: str | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        return f"{self.node}:{self.index}"


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
class LimitRules:
    default: Limit = Limit(max_gpus=1)
    groups: Mapping[str, Limit] = field(default_factory=dict)
    users: Mapping[str, Limit] = field(default_factory=dict)


@dataclass(frozen=True)
class EffectiveLimit:
    limit: Limit
    source: str  # "user alice", "group students", "default"


def _most_generous(values: Iterable[float | None]) -> float | None:
    values = list(values)
    if any(v is None for v in values):
        return None
    return max(values)  # type: ignore[type-var]


def effective_limit(user: str, groups: Iterable[str], rules: LimitRules) -> EffectiveLimit:
    if user in rules.users:
        return EffectiveLimit(rules.users[user], f"user {user}")
    matched = sorted(g for g in set(groups) if g in rules.groups)
    if not matched:
        return EffectiveLimit(rules.default, "default")
    limits = [rules.groups[g] for g in matched]
    max_gpus = _most_generous(lim.max_gpus for lim in limits)
    hours = _most_generous(lim.gpu_hours for lim in limits)
    # the window travels with the quota it belongs to
    window = next(
        (lim.window_hours for lim in limits if hours is not None and lim.gpu_hours == hours),
        DEFAULT_WINDOW_HOURS,
    )
    merged = Limit(max_gpus=None if max_gpus is None else int(max_gpus), gpu_hours=hours, window_hours=window)
    if len(matched) == 1:
        return EffectiveLimit(merged, f"group {matched[0]}")
    return EffectiveLimit(merged, "groups " + ", ".join(matched))


class Refusal(Exception):
    """A request the policy refuses. ``message`` is for the user; ``reason`` is a short label."""

    status_codes = {
        "bad_request": 400,
        "unknown_model": 400,
        "too_large": 400,
        "over_limit": 403,
        "quota_exhausted": 403,
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
class Request:
    user: str
    count: int
    model: str | None = None
    max_nodes: int | None = 1  # None: as many as needed
    gpus_per_node: int | None = None


@dataclass(frozen=True)
class Holdings:
    """What a user has now: GPUs held and GPU-hours used in their limit's window."""

    held: int = 0
    gpu_hours: float = 0.0


def _plural(n: int, word: str = "GPU") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _describe_limit(eff: EffectiveLimit) -> str:
    if eff.limit.max_gpus is None:
        return f"no limit ({eff.source})"
    return f"a limit of {eff.limit.max_gpus} ({eff.source})"


def remaining(eff: EffectiveLimit, holdings: Holdings) -> int | None:
    """How many more GPUs the limit allows; ``None`` when unlimited."""
    if eff.limit.gpu_hours is not None and holdings.gpu_hours >= eff.limit.gpu_hours:
        return 0
    if eff.limit.max_gpus is None:
        return None
    return max(0, eff.limit.max_gpus - holdings.held)


def largest_placeable(free: Sequence[Gpu], model: str | None, max_nodes: int | None) -> int:
    """The largest count ``place`` could satisfy right now."""
    if isinstance(free, KEPT):
        return free.remembered(("largest", model, max_nodes), lambda: _largest(free, model, max_nodes))
    return _largest(free, model, max_nodes)


def _largest(free: Sequence[Gpu], model: str | None, max_nodes: int | None) -> int:
    per_node = sorted((len(v) for v in _by_node(free, model).values()), reverse=True)
    return sum(per_node if max_nodes is None else per_node[:max_nodes])


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
    models = _models(inventory)
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
    room = remaining(eff, holdings)
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
            f"{_describe_limit(eff)}: at most {fits} more would fit now.",
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
            f"{_describe_limit(eff)}. Ask for {fits} or fewer, or try again later.",
            reason="no_capacity",
            fits=fits,
        )


class GpuSet(tuple):
    """GPUs already in order (node, index), that group themselves by node once: the
    inventory a process keeps in memory (``Ledger``), so that an admission on a cluster of
    thousands of GPUs does not sort and group them all again. Read its groups, never change them."""

    @classmethod
    def ordered(cls, gpus: Iterable[Gpu]) -> GpuSet:
        """``gpus``, known to be in order already (e.g. a part of a ``GpuSet``)."""
        return cls(gpus)

    def remembered(self, key, compute):
        """``compute()``, once per ``key`` for this set (it never changes)."""
        memo = self.__dict__.setdefault("memo", {})
        if key not in memo:
            memo[key] = compute()
        return memo[key]

    def by_node(self, model: str | None) -> dict[str, list[Gpu]]:
        groups = self.__dict__.setdefault("groups", {})
        if model not in groups:
            out: dict[str, list[Gpu]] = {}
            for g in self:
                if model is None or g.model == model:
                    out.setdefault(g.node, []).append(g)
            groups[model] = out
        return groups[model]


class GroupedGpus(Sequence):
    """GPUs kept as their groups by node (nodes in order, each node's in order), read as a
    sequence without making one: an admission reads the free GPUs by node, their count and
    their fit index, and making the tuple of thousands for every decision cost more than the
    rest of the placement. Like a ``GpuSet``: read its groups, never change them."""

    def __init__(self, groups: dict[str, list[Gpu]], fit: tuple[GpuSet, FitIndex] | None = None):
        self.__dict__["groups"] = {None: groups}
        if fit is not None:
            self.fit = fit

    def __len__(self) -> int:
        return self.remembered("len", lambda: sum(map(len, self.by_node(None).values())))

    def __iter__(self):
        return chain.from_iterable(self.by_node(None).values())

    def __getitem__(self, i):
        return self.remembered("tuple", lambda: tuple(self))[i]

    def __eq__(self, other):
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"GroupedGpus({list(self)!r})"

    remembered = GpuSet.remembered
    by_node = GpuSet.by_node


KEPT = (GpuSet, GroupedGpus)  # sets that keep their groups and remembered answers


# the nodes with free GPUs by (how many are free, whether that is fewer than all of the
# node's), each list in name order: the one-node best fit without a pass over every node
FitIndex = dict[tuple[int, bool], list[str]]


def make_fit_index(groups: Mapping[str, list[Gpu]], totals: Mapping[str, list[Gpu]]) -> FitIndex:
    """The :data:`FitIndex` of the free GPUs ``groups`` (by node, nodes in name order) on a
    cluster whose GPUs by node are ``totals``."""
    index: FitIndex = {}
    for node, gs in groups.items():
        index.setdefault((len(gs), len(gs) != len(totals.get(node, ()))), []).append(node)
    return index


def refit(index: FitIndex, moved: Mapping[str, tuple[int, int, int]]) -> FitIndex:
    """``index`` after the nodes of ``moved`` went from ``before`` to ``after`` free GPUs of
    ``total`` (``node: (before, after, total)``); ``index`` itself is left as it was."""
    out = dict(index)
    for node, (before, after, total) in moved.items():
        if before == after:
            continue
        if before:
            key = (before, before != total)
            left = [n for n in out[key] if n != node]
            if left:
                out[key] = left
            else:
                del out[key]
        if after:
            key = (after, after != total)
            nodes = list(out.get(key, ()))
            insort(nodes, node)
            out[key] = nodes
    return out


def best_node(index: FitIndex, n: int) -> str | None:
    """The node the one-node best fit gives ``n`` GPUs on: the fewest free that hold ``n``,
    a whole node before a part of one, then by name (None: no node holds ``n``)."""
    keys = [key for key in index if key[0] >= n]
    return index[min(keys)][0] if keys else None


def _models(inventory: Sequence[Gpu]) -> list[str]:
    if isinstance(inventory, GpuSet):
        return inventory.remembered("models", lambda: sorted({g.model for g in inventory}))
    return sorted({g.model for g in inventory})


def _by_node(gpus: Iterable[Gpu], model: str | None) -> dict[str, list[Gpu]]:
    """The GPUs (of ``model``) per node, nodes and GPUs in order (read only: a ``GpuSet``
    hands out the groups it keeps)."""
    if isinstance(gpus, KEPT):
        return gpus.by_node(model)
    out: dict[str, list[Gpu]] = {}
    for g in sorted(gpus):
        if model is None or g.model == model:
            out.setdefault(g.node, []).append(g)
    return out


def place(request: Request, free: Sequence[Gpu], inventory: Sequence[Gpu]) -> tuple[Gpu, ...] | None:
    """The GPUs to give ``request``, or ``None`` when they cannot be placed now."""
    if free is inventory and isinstance(free, GpuSet):  # "could it ever fit": asked at every admission
        shape = ("place", request.count, request.model, request.max_nodes, request.gpus_per_node)
        return free.remembered(shape, lambda: _place(request, free, inventory))
    return _place(request, free, inventory)


def _place(request: Request, free: Sequence[Gpu], inventory: Sequence[Gpu]) -> tuple[Gpu, ...] | None:
    n = request.count
    if n == 0:
        return ()
    free_by = _by_node(free, request.model)
    total_by = _by_node(inventory, request.model)

    def whole(node: str) -> bool:
        return len(free_by[node]) == len(total_by.get(node, ()))

    if request.gpus_per_node:
        per = request.gpus_per_node
        if n % per:
            return None
        want = n // per
        fitting = sorted(
            (node for node, gs in free_by.items() if len(gs) >= per),
            key=lambda node: (len(free_by[node]), not whole(node), node),
        )
        if len(fitting) < want or (request.max_nodes and want > request.max_nodes):
            return None
        return tuple(g for node in sorted(fitting[:want]) for g in free_by[node][:per])

    fit = getattr(free, "fit", None) if request.model is None else None
    if fit is not None and fit[0] is inventory and (request.max_nodes is None or request.max_nodes >= 1):
        node = best_node(fit[1], n)  # kept from write to write by the ledger (freeset.py)
        if node is not None:
            return tuple(free_by[node][:n])
    elif request.max_nodes is None or request.max_nodes >= 1:
        # one node holds it: the best-fitting such node, as below with k = 1, without sorting
        # every node (thousands on a large cluster)
        # min of (free, not whole, name) in one pass over the nodes (they come in name order)
        fewest, first, first_whole = None, None, None
        for node, gs in free_by.items():
            k = len(gs)
            if k < n or (fewest is not None and k > fewest):
                continue
            is_whole = k == len(total_by.get(node, ()))
            if fewest is None or k < fewest:
                fewest, first, first_whole = k, node, node if is_whole else None
            elif first_whole is None and is_whole:
                first_whole = node
        if first is not None:
            return tuple(free_by[first_whole or first][:n])
    # as few nodes as possible: the smallest k whose k fullest nodes hold n
    order = sorted(free_by, key=lambda node: (-len(free_by[node]), not whole(node), node))
    k, total = 0, 0
    while total < n and k < len(order):
        total += len(free_by[order[k]])
        k += 1
    if total < n or (request.max_nodes is not None and k > request.max_nodes):
        return None
    # the k-1 fullest whole, then the best-fitting node for the remainder (keeps big holes)
    chosen = [g for node in order[: k - 1] for g in free_by[node]]
    rest = n - len(chosen)
    candidates = [node for node in order[k - 1 :] if len(free_by[node]) >= rest]
    best = min(candidates, key=lambda node: (len(free_by[node]), not whole(node), node))
    chosen.extend(free_by[best][:rest])
    return tuple(sorted(chosen))


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
