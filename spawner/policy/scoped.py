"""A setting given by default, per group and per user: the one rule type of limits, fair-share
weights and borrowing allowances, and the one way a user's value is found (pure).

- :class:`Scoped` holds ``default``, ``groups`` and ``users``; ``LimitRules``, ``Shares`` and
  ``BorrowRules`` are its kinds, each with its own default.
- :func:`resolve`: a user's own entry wins over their groups', their groups' over the default.
  The user's groups that have an entry are taken once each, in name order, and ``combine``
  makes one value of them; the default combination, :func:`largest`, takes the largest value,
  and among equal values the group whose name sorts last. Limits combine field by field
  instead (``spawner.policy.limits.most_generous``).
- :meth:`Scoped.read`: the traits' three shapes (``default_X``, ``group_X``, ``user_X``) read
  into one, each value refused with the setting named (``c.GpuHub.group_shares['staff']``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

T = TypeVar("T")

# the matched groups' (name, value) pairs, in name order -> one value and the groups it names
Combine = Callable[[Sequence[tuple[str, Any]]], tuple[Any, Sequence[str]]]


@dataclass(frozen=True)
class Scoped(Generic[T]):
    """A value by default, per group and per user."""

    default: T
    groups: Mapping[str, T] = field(default_factory=dict)
    users: Mapping[str, T] = field(default_factory=dict)

    @classmethod
    def read(
        cls,
        default: Any,
        groups: Mapping[Any, Any],
        users: Mapping[Any, Any],
        *,
        names: tuple[str, str, str],
        value: Callable[[Any, str], T],
    ) -> Self:
        """The rules of three settings (``names``: the default's, the groups' and the users'
        settings as an admin writes them). ``value(raw, where)`` reads one value or raises
        ``ValueError`` naming ``where``; the first bad value is refused, the default first."""
        default_name, groups_name, users_name = names
        return cls(
            default=value(default, default_name),
            groups={str(k): value(v, f"{groups_name}[{k!r}]") for k, v in groups.items()},
            users={str(k): value(v, f"{users_name}[{k!r}]") for k, v in users.items()},
        )


def checked(problem: Callable[[Any, str], str | None]) -> Callable[[Any, str], Any]:
    """A reader for :meth:`Scoped.read` that takes a value as it is unless ``problem(value,
    where)`` says why not (then ``ValueError`` with that message)."""

    def value(raw: Any, where: str) -> Any:
        why = problem(raw, where)
        if why:
            raise ValueError(why)
        return raw

    return value


def largest(found: Sequence[tuple[str, Any]]) -> tuple[Any, Sequence[str]]:
    """The largest value; among equal ones the group whose name sorts last."""
    name, value = max(found, key=lambda nv: (nv[1], nv[0]))
    return value, (name,)


def resolve(
    user: str, groups: Iterable[str], rules: Scoped[T], *, combine: Combine = largest
) -> tuple[T, str]:
    """A user's value and where it comes from: ``"user alice"``, ``"group staff"``,
    ``"groups lab, staff"`` (every group ``combine`` drew on) or ``"default"``."""
    if user in rules.users:
        return rules.users[user], f"user {user}"
    found = [(g, rules.groups[g]) for g in sorted(set(groups)) if g in rules.groups]
    if not found:
        return rules.default, "default"
    value, names = combine(found)
    if len(names) == 1:
        return value, f"group {names[0]}"
    return value, "groups " + ", ".join(names)
