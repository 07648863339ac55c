"""Borrowing idle GPUs beyond the limit, and taking them back: the decisions, as pure functions.

- A user at their limit may take up to their **borrowing allowance** more
  (``c.GpuHub.default_borrow``, ``group_borrow``, ``user_borrow``), but only GPUs that are free
  now and only while nobody waits in the queue: a borrowing request never waits.
- A limit of 0 means no GPUs at all, not even borrowed ones: an admin who sets 0 means none
  (:func:`usable_allowance`); the limit's refusal tells the user to ask for it to be raised.
- An allocation records how many of its GPUs were borrowed when it was admitted. Borrowed
  allocations are the only ones ever preempted.
- When a request waits that only borrowed GPUs could serve now, borrowed allocations are
  taken back, newest first, as few GPUs as will do; each owner gets a notice and
  ``c.GpuHub.preempt_grace_seconds`` before it ends.
- An allocation that started ahead of a reserved request in the queue (backfill) may be taken
  back the same way for that request, and only for it, until it has started or left.
- A notice stands only while the request it was given for still waits: once that request is
  served otherwise, cancelled or leaves, the notice is withdrawn and its owner told.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from gpu_magics.common import words
from spawner import policy
from spawner.policy.scoped import Scoped, resolve


@dataclass(frozen=True)
class BorrowRules(Scoped[int]):
    """The borrowing allowances: by default (0, no borrowing), per group and per user."""

    default: int = 0


def allowance_problem(value, where: str) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"{where} must be a whole number of GPUs, 0 or more (0: no borrowing); got {value!r}"
    return None


def effective_borrow(user: str, groups: Iterable[str], rules: BorrowRules) -> tuple[int, str]:
    """A user's borrowing allowance and where it comes from: their own, else their groups'
    largest, else the default (:func:`spawner.policy.scoped.resolve`)."""
    return resolve(user, groups, rules)


def usable_allowance(max_gpus: int | None, allowance: int) -> int:
    """The allowance a user with limit ``max_gpus`` may borrow with: none when unlimited
    (nothing is beyond the limit) or when the limit is 0 (0 means no GPUs, not even borrowed)."""
    return 0 if not max_gpus else allowance


@dataclass(frozen=True)
class Split:
    """How a request of ``count`` GPUs stands against the limit: how many are borrowed."""

    count: int
    borrowed: int  # GPUs of this request beyond the limit (0: all within it)


def split(count: int, held: int, held_borrowed: int, max_gpus: int | None, allowance: int) -> Split | None:
    """The request's borrowed part, or None when it is beyond even the allowance.

    ``held`` counts every GPU the user holds, ``held_borrowed`` those of them borrowed. With a
    limit of 0 nothing is lent (:func:`usable_allowance`): nothing of it is borrowed, and the
    limit's own check refuses it."""
    if not max_gpus:
        return Split(count, 0)
    over = max(0, held + count - max_gpus)  # beyond the limit once this is granted
    borrowed = max(0, over - held_borrowed)  # of which this request adds
    if held_borrowed + borrowed > allowance:
        return None
    return Split(count, borrowed)


@dataclass(frozen=True)
class Borrowed:
    """A live allocation holding borrowed GPUs (a candidate for preemption)."""

    id: int
    created: datetime
    gpus: tuple[policy.Gpu, ...]


def victims(
    request: policy.Request,
    free: Sequence[policy.Gpu],
    inventory: Sequence[policy.Gpu],
    borrowed: Sequence[Borrowed],
) -> list[int] | None:
    """The borrowed allocations to take back so that ``request`` can be placed: newest
    borrowing first, then as few GPUs as will do. None when even all of them would not let
    it be placed (preempting then would help nobody); [] when it fits as it is."""
    if policy.place(request, free, inventory) is not None:
        return []
    newest_first = sorted(borrowed, key=lambda b: (b.created, b.id), reverse=True)
    chosen: list[Borrowed] = []
    pool = list(free)
    for b in newest_first:
        chosen.append(b)
        pool.extend(b.gpus)
        if policy.place(request, pool, inventory) is not None:
            break
    else:
        return None
    # then drop any chosen one the request can do without: the oldest first, biggest first
    for b in sorted(chosen, key=lambda b: (-len(b.gpus), b.created, b.id)):
        rest = [c for c in chosen if c is not b]
        gpus = list(free) + [g for c in rest for g in c.gpus]
        if policy.place(request, gpus, inventory) is not None:
            chosen = rest
    return sorted(c.id for c in chosen)


def withdrawal(entry_state: str | None) -> str | None:
    """Why a notice given for the queue entry now in ``entry_state`` is withdrawn (None: it
    stands, the entry still waits). ``None`` state: the entry is gone. Nothing names the
    other user, nor what ended their wait beyond what the owner of the GPUs needs to know."""
    if entry_state == "waiting":
        return None
    if entry_state == "granted":
        return "withdrawn: the request it was for was served by other GPUs"
    return "withdrawn: the request it was for no longer waits (it left the queue)"


def notice_reason(borrowed: int, gpus: int, backfill: bool, wanted: int, since: datetime) -> str:
    """The reason an owner is given with a notice (no name: users need not know who else
    waits; admins see ``for_user``). ``backfill``: the allocation started ahead of the request."""
    waiter = f"{words.count(wanted, 'GPU')}, waiting since {since:%H:%M} UTC"
    if backfill:
        return (
            f"preempted: {words.count(gpus, 'GPU')} that started ahead of a waiting request (backfill) "
            f"taken back at its turn ({waiter})"
        )
    return (
        f"preempted: {borrowed} borrowed {'GPU' if borrowed == 1 else 'GPUs'} taken back for another "
        f"user's request within its limit ({waiter})"
    )


def backfill_ids(text: str | None) -> frozenset[int]:
    """The queue entries an allocation started ahead of (``allocations.backfill_for``)."""
    return frozenset(int(x) for x in (text or "").split(",") if x.strip().isdigit())


def backfill_text(ids) -> str | None:
    return ",".join(str(i) for i in sorted(set(ids))) or None
