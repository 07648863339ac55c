"""Table tests of the one rule type for settings given by default, per group and per user
(spawner/policy/scoped.py), and of its reading from the traits (spawner/settings.py)."""

import pytest

from spawner.policy.borrowing import BorrowRules
from spawner.policy.fairshare import Shares
from spawner.policy.limits import Limit, LimitRules, most_generous
from spawner.policy.scoped import Scoped, checked, largest, resolve
from spawner.settings import GpuHub

RULES = Scoped(
    default=1, groups={"staff": 4, "lab": 4, "students": 2, "none": 0}, users={"alice": 7, "zed": 0}
)


@pytest.mark.parametrize(
    "user, groups, want",
    [
        ("bob", [], (1, "default")),
        ("bob", ["unknown"], (1, "default")),  # a group without an entry does not count
        ("bob", ["students"], (2, "group students")),
        ("bob", ["none"], (0, "group none")),  # a group's entry wins over the default, even 0
        ("bob", ["students", "staff"], (4, "group staff")),  # the largest
        ("bob", ["staff", "lab"], (4, "group staff")),  # equal: the name that sorts last
        ("bob", ["lab", "staff"], (4, "group staff")),  # ... whatever the order given
        ("bob", ["staff", "staff"], (4, "group staff")),  # a group given twice counts once
        ("bob", iter(["students"]), (2, "group students")),  # any iterable
        ("alice", ["staff"], (7, "user alice")),  # the user's own wins over groups
        ("zed", ["staff"], (0, "user zed")),  # ... even when stricter
        ("staff", [], (1, "default")),  # a user named like a group is no member of it
    ],
)
def test_resolve(user, groups, want):
    assert resolve(user, groups, RULES) == want


def every(found):
    return sum(v for _, v in found), [n for n, _ in found]


@pytest.mark.parametrize(
    "groups, want",
    [
        (["students"], (2, "group students")),
        (["staff", "students"], (6, "groups staff, students")),  # every group drawn on, by name
        (["students", "lab", "staff"], (10, "groups lab, staff, students")),
    ],
)
def test_resolve_with_another_combination(groups, want):
    assert resolve("bob", groups, RULES, combine=every) == want


@pytest.mark.parametrize(
    "found, want",
    [
        ([("a", 1)], (1, ("a",))),
        ([("a", 1), ("b", 3)], (3, ("b",))),
        ([("a", 3), ("b", 3)], (3, ("b",))),
        ([("a", 3), ("b", 1)], (3, ("a",))),
    ],
)
def test_largest(found, want):
    assert largest(found) == want


@pytest.mark.parametrize(
    "found, want",
    [
        ([("a", Limit(2))], Limit(2)),
        ([("a", Limit(2)), ("b", Limit(None))], Limit(None)),
        ([("a", Limit(2, 10, 24)), ("b", Limit(1, 20, 48))], Limit(2, 20, 48)),  # field by field
        ([("a", Limit(2, None)), ("b", Limit(1, 20, 48))], Limit(2, None)),  # unlimited hours
        ([("a", Limit(1, 20, 24)), ("b", Limit(1, 20, 48))], Limit(1, 20, 24)),  # tie: first name
    ],
)
def test_most_generous(found, want):
    assert most_generous(found) == (want, [n for n, _ in found])


def test_kinds_have_their_defaults():
    assert LimitRules().default == Limit(max_gpus=1)
    assert Shares().default == 1
    assert BorrowRules().default == 0
    assert isinstance(Shares(), Scoped) and Shares() != BorrowRules(default=1)


def test_read_names_each_value_and_keys_as_text():
    def positive(v, where):
        return None if v > 0 else f"{where} must be positive"

    read = Shares.read(3, {1: 2}, {"alice": 4}, names=("d", "g", "u"), value=checked(positive))
    assert read == Shares(default=3, groups={"1": 2}, users={"alice": 4})
    for args, where in [
        ((0, {"x": 0}, {}), "d"),  # the default first
        ((1, {"x": 0}, {"y": 0}), "g['x']"),
        ((1, {}, {"y": 0}), "u['y']"),
    ]:
        with pytest.raises(ValueError, match=rf"^{where.replace('[', '.').replace(']', '.')} must"):
            Shares.read(*args, names=("d", "g", "u"), value=checked(positive))


@pytest.mark.parametrize(
    "config, read, where",
    [
        ({"group_limits": {"x": -1}}, GpuHub.limit_rules, "c.GpuHub.group_limits['x']"),
        ({"user_shares": {"x": 0}}, GpuHub.shares, "c.GpuHub.user_shares['x']"),
        ({"default_borrow": -1}, GpuHub.borrow_settings, "c.GpuHub.default_borrow"),
        ({"group_borrow": {"x": 1.5}}, GpuHub.borrow_settings, "c.GpuHub.group_borrow['x']"),
    ],
)
def test_traits_are_read_the_one_way(config, read, where):
    with pytest.raises(ValueError) as e:
        read(GpuHub(**config))
    assert str(e.value).startswith(where)


def test_traits_read_into_their_kinds():
    hub = GpuHub(
        default_limit=2,
        group_limits={"staff": None},
        user_borrow={"alice": 3},
        group_shares={"staff": 4},
    )
    assert hub.limit_rules() == LimitRules(default=Limit(2), groups={"staff": Limit(None)})
    assert hub.borrow_settings().rules == BorrowRules(users={"alice": 3})
    assert hub.shares() == Shares(groups={"staff": 4})
