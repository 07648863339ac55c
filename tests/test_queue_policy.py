"""Table tests of the queue's pure parts: fair-share priority (spawner/policy/fairshare.py), the
schedule with conservative backfill (spawner/policy/schedule.py), the wait line
(spawner/policy/waitline.py), and the queue's traits (GpuHub.shares, GpuHub.queue_weights)."""

import math
import time
from datetime import datetime, timedelta

import pytest

from spawner.policy import fairshare, values
from spawner.policy import waitline as queueview
from spawner.policy.fairshare import (
    Candidate,
    Factors,
    Shares,
    Weights,
    age_factor,
    decayed_usage,
    effective_share,
    factors,
    fairshare_factor,
    order,
)
from spawner.policy.placement import Gpu, Request
from spawner.policy.schedule import Expected, Held, Plan, Waiting, plan
from spawner.settings import GpuHub

T = datetime(2026, 11, 2, 9, 0)
LN2 = math.log(2)


def at(hours: float = 0.0, minutes: float = 0.0) -> datetime:
    return T + timedelta(hours=hours, minutes=minutes)


# fair share: shares ------------------------------------------------------------------

SHARES = Shares(default=2, groups={"staff": 4, "students": 1, "lab": 4}, users={"alice": 7, "zed": 1})


@pytest.mark.parametrize(
    "user, groups, share, source",
    [
        ("bob", [], 2, "default"),
        ("bob", ["unknown"], 2, "default"),
        ("bob", ["students"], 1, "group students"),  # a group's share wins even when smaller
        ("bob", ["students", "staff"], 4, "group staff"),  # the most generous group
        ("bob", ["staff", "lab"], 4, "group staff"),  # equal shares: the larger name, stably
        ("bob", ["lab", "staff"], 4, "group staff"),
        ("alice", ["students"], 7, "user alice"),  # the user's own wins over groups
        ("zed", ["staff"], 1, "user zed"),  # ... even when stricter
    ],
)
def test_effective_share(user, groups, share, source):
    assert effective_share(user, groups, SHARES) == (share, source)


@pytest.mark.parametrize(
    "value, bad",
    [(1, False), (12, False), (0, True), (-1, True), (True, True), (1.0, True), (2.5, True), ("2", True)],
)
def test_share_problem(value, bad):
    problem = fairshare.share_problem(value, "c.GpuHub.user_shares['x']")
    assert (problem is not None) == bad
    if bad:
        assert "c.GpuHub.user_shares['x']" in problem and repr(value) in problem


# fair share: decayed usage -------------------------------------------------------------

# With a half-life of h hours an hour of age a weighs 2 ** -(a / h); the usage of a GPU held
# from age a_hi to age a_lo is the integral of that: h / ln 2 * (2 ** -(a_lo/h) - 2 ** -(a_hi/h)).


@pytest.mark.parametrize(
    "intervals, half_life, expected",
    [
        ([(at(-2), at(-1), 1)], 1, (0.5 - 0.25) / LN2),
        ([(at(-1), None, 2)], 1, 2 * (1 - 0.5) / LN2),  # running: counts up to now
        ([(at(-1), at(+1), 1)], 1, (1 - 0.5) / LN2),  # an end after now counts up to now
        ([(at(-2), at(0), 1)], 2, 2 * (1 - 0.5) / LN2),  # a longer half-life
        ([(at(-2), at(-1), 1), (at(-1), None, 2)], 1, 0.25 / LN2 + 1 / LN2),  # intervals add
        ([(at(+1), None, 1)], 1, 0.0),  # starts in the future
        ([(at(-1), at(-2), 1)], 1, 0.0),  # ends before it starts
        ([(at(-1), at(0), 0)], 1, 0.0),  # no GPUs
        ([], 1, 0.0),
    ],
)
def test_decayed_usage_is_the_integral_of_the_decay(intervals, half_life, expected):
    assert decayed_usage(intervals, T, half_life) == pytest.approx(expected, rel=1e-9)


def test_decayed_usage_halves_per_half_life_and_is_gpu_hours_without_decay():
    hour_now = decayed_usage([(at(-1), at(0), 1)], T, 24)
    hour_a_day_ago = decayed_usage([(at(-25), at(-24), 1)], T, 24)
    assert hour_a_day_ago == pytest.approx(hour_now / 2, rel=1e-9)
    assert decayed_usage([(at(-49), at(-48), 1)], T, 24) == pytest.approx(hour_now / 4, rel=1e-9)
    # a half-life far longer than the interval: plain GPU-hours (3 h x 2 GPUs)
    assert decayed_usage([(at(-3), at(0), 2)], T, 1e7) == pytest.approx(6.0, rel=1e-6)
    # the closed form against a midpoint sum, for an interval that straddles "now"
    steps = 10_000
    riemann = sum(2 ** -((5 - (i + 0.5) * 5 / steps) / 3) * 5 / steps for i in range(steps))
    assert decayed_usage([(at(-5), at(+2), 1)], T, 3) == pytest.approx(riemann, rel=1e-6)


# fair share: the factors -----------------------------------------------------------------


@pytest.mark.parametrize(
    "usage, share, total_usage, total_shares, expected",
    [
        (0.0, 1, 0.0, 2, 1.0),  # nobody used anything
        (0.0, 1, 10.0, 2, 1.0),  # this user used nothing
        (5.0, 1, 10.0, 2, 0.5),  # exactly their share (half the use, half the shares)
        (10.0, 1, 10.0, 2, 0.25),  # twice their share
        (10.0, 1, 10.0, 1, 0.5),  # all the use, all the shares
        (2.0, 1, 10.0, 10, 0.25),  # 20 % of the use with 10 % of the shares: 2 ** -2
        (10.0, 0, 10.0, 2, 0.0),  # no share at all
        (10.0, 1, 10.0, 0, 0.0),
    ],
)
def test_fairshare_factor(usage, share, total_usage, total_shares, expected):
    assert fairshare_factor(usage, share, total_usage, total_shares) == pytest.approx(expected)
    assert 0.0 <= fairshare_factor(usage, share, total_usage, total_shares) <= 1.0


def test_fairshare_factor_falls_towards_zero_but_stays_positive_for_the_heaviest():
    f = fairshare_factor(1000.0, 1, 1000.0, 50)
    assert 0.0 < f < 1e-10


@pytest.mark.parametrize(
    "waited_seconds, max_age_hours, expected",
    [
        (0, 2.0, 0.0),
        (3600, 2.0, 0.5),
        (7200, 2.0, 1.0),
        (10 * 7200, 2.0, 1.0),  # saturates
        (-60, 2.0, 0.0),  # a clock step back never gives a negative age
        (60, 0.0, 1.0),  # no maximum age: everyone is "old"
    ],
)
def test_age_factor(waited_seconds, max_age_hours, expected):
    assert age_factor(waited_seconds, max_age_hours) == pytest.approx(expected)


def c(id, user, created_min_ago, front_min_ago=None):
    front = None if front_min_ago is None else at(minutes=-front_min_ago)
    return Candidate(id, user, at(minutes=-created_min_ago), front)


DEFAULT_WEIGHTS = Weights(max_age_hours=2.0)


def ranked(waiting, usage, share=None, weights=DEFAULT_WEIGHTS):
    found = factors(waiting, usage, share or {}, T, weights)
    return [x.id for x in order(waiting, found)], found


def test_factors_values():
    waiting = [c(1, "heavy", 60), c(2, "light", 0)]
    found = factors(waiting, {"heavy": 10.0}, {}, T, Weights(max_age_hours=2.0))
    # total use 10 (all heavy's), shares 1 + 1: heavy used 100 % with 50 % of shares: 2 ** -2
    assert found[1] == Factors(fairshare=0.25, age=0.5, priority=250 + 500, share=1, usage=10.0)
    assert found[2] == Factors(fairshare=1.0, age=0.0, priority=1000, share=1, usage=0.0)
    # a share of 3 for heavy: 100 % of use with 75 % of the shares
    found = factors(waiting, {"heavy": 10.0}, {"heavy": 3}, T, Weights(max_age_hours=2.0))
    assert found[1].fairshare == pytest.approx(2 ** (-1 / 0.75)) and found[1].share == 3
    # someone with usage who does not wait still counts in the totals
    found = factors([c(2, "light", 0)], {"light": 5.0, "other": 5.0}, {}, T, Weights(max_age_hours=2.0))
    assert found[2].fairshare == pytest.approx(0.5)


@pytest.mark.parametrize(
    "waiting, usage, share, expected",
    [
        # a heavy recent user sorts behind a light one, though they asked first
        ([c(1, "heavy", 30), c(2, "light", 1)], {"heavy": 10.0, "light": 1.0}, {}, [2, 1]),
        # ... unless their share makes up for it (share 10 vs 1: 10/11 of the shares)
        ([c(1, "heavy", 30), c(2, "light", 1)], {"heavy": 10.0, "light": 1.0}, {"heavy": 10}, [1, 2]),
        # no starvation: once its age factor is full (weight_age >= weight_fairshare, as by
        # default; a max age of 2 h here), an old waiter outranks a newcomer who used nothing
        ([c(1, "heavy", 120), c(2, "light", 0)], {"heavy": 10.0}, {}, [1, 2]),
        ([c(1, "heavy", 600), c(2, "light", 0)], {"heavy": 1e6}, {f"u{i}": 1 for i in range(40)}, [1, 2]),
        # ... but not before (30 min: age 0.25, fair share 0.25: 500 < 1000)
        ([c(1, "heavy", 30), c(2, "light", 0)], {"heavy": 10.0}, {}, [2, 1]),
        # equal priority: whoever asked first, then the lower id
        ([c(3, "a", 10), c(1, "b", 10), c(2, "c", 10)], {}, {}, [1, 2, 3]),
        # an admin's front beats any priority; the latest move goes first
        (
            [c(1, "light", 100), c(2, "heavy", 1, front_min_ago=5), c(3, "heavy", 1, front_min_ago=2)],
            {"heavy": 100.0},
            {},
            [3, 2, 1],
        ),
    ],
)
def test_order(waiting, usage, share, expected):
    assert ranked(waiting, usage, share)[0] == expected


def test_with_the_default_weights_a_waiter_of_the_max_age_outranks_any_newcomer():
    old = Weights().max_age_hours * 60
    waiting = [c(1, "heavy", old), c(2, "light", 0)]
    heaviest = {"heavy": 1e6} | {f"u{i}": 0.0 for i in range(40)}
    assert ranked(waiting, heaviest, weights=Weights())[0] == [1, 2]
    assert ranked([c(1, "heavy", old / 2), c(2, "light", 0)], heaviest, weights=Weights())[0] == [2, 1]


def test_ties_go_to_whoever_asked_first():
    # no age weight: equal fair share means equal priority, and created decides
    waiting = [c(1, "a", 1), c(2, "b", 5), c(3, "c", 5)]
    ids, found = ranked(waiting, {}, weights=Weights(age=0))
    assert {f.priority for f in found.values()} == {1000.0}
    assert ids == [2, 3, 1]


def test_front_is_reported_in_the_factors():
    _ids, found = ranked([c(1, "a", 1, front_min_ago=0), c(2, "b", 1)], {})
    assert found[1].front and not found[2].front


# the schedule ------------------------------------------------------------------------

N1 = [Gpu("n1", i, "A100") for i in range(4)]
TWO_NODES = [Gpu("n1", i, "A100") for i in range(2)] + [Gpu("n2", i, "V100") for i in range(2)]


def g(*idx, node="n1", model="A100"):
    return tuple(Gpu(node, i, model) for i in idx)


def held(*idx, ends_h=None, sure="guess", node="n1", model="A100"):
    return Held(g(*idx, node=node, model=model), None if ends_h is None else at(ends_h), sure)


def w(id, count, run=2.0, model=None, max_nodes=1, per_node=None, on_nodes=None):
    return Waiting(id, Request(f"u{id}", count, model, max_nodes, per_node), run, on_nodes)


def test_the_head_starts_when_its_gpus_are_free():
    p = plan([w(1, 2)], N1, [held(0, ends_h=1)], T)
    assert p.grants == {1: g(1, 2)} and p.expected[1] == Expected(T, "now") and not p.backfilled
    # not free enough: it waits for the holding's end
    p = plan([w(1, 4)], N1, [held(0, ends_h=1)], T)
    assert p.grants == {} and p.expected[1] == Expected(at(1), "guess")


@pytest.mark.parametrize(
    "head, small_run, backfills, small_expected",
    [
        # the head (3 GPUs) waits for n1:0-2 until 11:00; n1:3 is one it never needs
        (3, 3.0, True, T),
        # the head needs all 4 from 11:00: a small job that would run past 11:00 on n1:3
        # would delay it, so it waits for the head to finish (11:00 + 2 h)
        (4, 3.0, False, at(4)),
        # ... but one done by 10:00 does not delay it, and starts now
        (4, 1.0, True, T),
    ],
)
def test_backfill_never_delays_the_head(head, small_run, backfills, small_expected):
    holdings = [held(0, 1, ends_h=2), held(2, ends_h=1)]
    alone = plan([w(1, head)], N1, holdings, T)
    p = plan([w(1, head), w(2, 1, run=small_run)], N1, holdings, T)
    assert p.expected[1] == alone.expected[1] == Expected(at(2), "guess")  # never delayed
    assert (2 in p.grants) == backfills and (2 in p.backfilled) == backfills
    assert p.expected[2].at == small_expected
    if backfills:
        assert p.grants[2] == g(3)


def test_expected_start_is_the_earliest_end_that_frees_enough():
    holdings = [held(0, ends_h=3), held(1, ends_h=1), held(2, ends_h=2), held(3, ends_h=5)]
    p = plan([w(1, 1), w(2, 2), w(3, 3)], N1, holdings, T)
    # 1 GPU: at 10:00 (n1:1). 2 more: n1:1 is taken by the first until 12:00, so n1:2 at
    # 11:00 and n1:0 at 12:00; 3 after those are reserved: when the first two end
    assert p.expected[1].at == at(1)
    assert p.expected[2].at == at(3)
    assert p.expected[3].at == at(5)
    assert p.grants == {}


@pytest.mark.parametrize(
    "sures, expected",
    [
        (("firm", "firm"), "firm"),  # waits only for firm ends
        (("firm", "guess"), "guess"),  # as sure as the least sure end it waits for
        (("guess", "guess"), "guess"),
    ],
)
def test_sureness(sures, expected):
    holdings = [held(0, 1, ends_h=1, sure=sures[0]), held(2, 3, ends_h=2, sure=sures[1])]
    p = plan([w(1, 4)], N1, holdings, T)
    assert p.expected[1] == Expected(at(2), expected)
    # an end it does not wait for does not make it less sure
    p = plan([w(1, 2)], N1, [held(0, 1, ends_h=1, sure="firm"), held(2, 3, ends_h=2, sure="guess")], T)
    assert p.expected[1] == Expected(at(1), "firm")


def test_a_start_behind_a_reservation_is_a_guess():
    """Those ahead are expected to run their run length, a guess: a start that waits for
    their end is a guess, even when they start now or after a firm end."""
    p = plan([w(1, 4), w(2, 1)], N1, [], T)
    assert p.expected[1] == Expected(T, "now") and p.expected[2] == Expected(at(2), "guess")
    p = plan([w(1, 4), w(2, 1)], N1, [held(0, ends_h=1, sure="firm")], T)
    assert p.expected[1] == Expected(at(1), "firm") and p.expected[2] == Expected(at(3), "guess")


def test_a_holding_with_no_end_gives_no_estimate():
    p = plan([w(1, 4)], N1, [held(0)], T)
    assert p.expected[1] == Expected(None, "unknown") and p.grants == {}
    line = queueview.wait_line(1, 1, 4, p.expected[1].at, p.expected[1].sure, T)
    assert "no expected start yet" in line
    # one that needs only the other GPUs still starts
    p = plan([w(1, 3)], N1, [held(0)], T)
    assert p.grants == {1: g(1, 2, 3)}


def test_a_holding_past_its_expected_end_is_still_held():
    """An overdue holding (a lease not yet released) ends "any moment", but its GPUs are
    not given to anyone while it holds them."""
    p = plan([w(1, 4)], N1, [held(0, ends_h=-1)], T)
    assert p.grants == {}
    assert p.expected[1].at is not None and T < p.expected[1].at <= at(minutes=1)
    p = plan([w(1, 1)], g(0), [held(0, ends_h=0)], T)
    assert p.grants == {}


@pytest.mark.parametrize(
    "on_nodes, grant, expected_at",
    [
        (None, g(0, node="n1"), T),  # anywhere: the free A100
        (frozenset({"n1"}), g(0, node="n1"), T),
        (frozenset({"n2"}), None, at(1)),  # only n2: waits for n2's holding though n1 is free
        (frozenset({"n3"}), None, None),  # a node that is not there: never
    ],
)
def test_on_nodes_is_respected(on_nodes, grant, expected_at):
    holdings = [held(1, ends_h=3), held(0, 1, ends_h=1, node="n2", model="V100")]
    p = plan([w(1, 1, on_nodes=on_nodes)], TWO_NODES, holdings, T)
    assert p.grants.get(1) == grant
    assert p.expected[1].at == expected_at


@pytest.mark.parametrize(
    "count, max_nodes, per_node, grant",
    [
        (4, None, None, TWO_NODES),  # across both nodes
        (4, 2, 2, TWO_NODES),  # 2 per node on 2 nodes
        (4, 1, None, None),  # one node has 2: never
        (3, None, 2, None),  # 3 is not a multiple of 2 per node
        (2, 1, None, g(0, 1)),  # fits on one node (the first of equals)
    ],
)
def test_multi_node_requests(count, max_nodes, per_node, grant):
    p = plan([w(1, count, max_nodes=max_nodes, per_node=per_node)], TWO_NODES, [], T)
    assert p.grants.get(1) == (None if grant is None else tuple(grant))
    if grant is None:
        assert p.expected[1] == Expected(None, "unknown")


def test_a_multi_node_head_reserves_on_every_node():
    holdings = [held(0, ends_h=1), held(0, ends_h=2, node="n2", model="V100")]
    p = plan([w(1, 4, max_nodes=None), w(2, 1, run=3.0)], TWO_NODES, holdings, T)
    assert p.expected[1].at == at(2)
    assert 2 not in p.grants  # a free GPU on either node is needed by the head at 11:00


def test_an_unplaceable_entry_does_not_block_those_behind_it():
    p = plan([w(1, 8), w(2, 1)], N1, [], T)
    assert p.expected[1] == Expected(None, "unknown")
    assert p.grants == {2: g(0)} and p.backfilled == {2}


def test_position_counts_those_still_waiting():
    p = Plan(grants={2: g(0)})
    assert p.position([1, 2, 3, 4], 1) == (1, 3)
    assert p.position([1, 2, 3, 4], 3) == (2, 3)
    assert p.position([1, 2, 3, 4], 4) == (3, 3)
    assert p.position([1, 2, 3, 4], 2) == (0, 3)  # starts now: no longer waits
    assert p.position([1, 2, 3, 4], 9) == (0, 3)


# the wait line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, word",
    [
        (1, "1st"),
        (2, "2nd"),
        (3, "3rd"),
        (4, "4th"),
        (10, "10th"),
        (11, "11th"),
        (12, "12th"),
        (13, "13th"),
        (20, "20th"),
        (21, "21st"),
        (22, "22nd"),
        (23, "23rd"),
        (101, "101st"),
        (111, "111th"),
        (112, "112th"),
        (1000, "1000th"),
    ],
)
def test_ordinal(n, word):
    assert queueview.ordinal(n) == word


@pytest.fixture
def utc_tz(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize(
    "position, waiting, gpus, expected, sure, line",
    [
        (
            2,
            4,
            2,
            at(minutes=12),
            "guess",
            "2nd of 4 waiting for 2 GPUs, expected start about 09:12 UTC "
            "(in 12 min; a guess from recent run lengths, not a promise)",
        ),
        (
            1,
            1,
            1,
            at(hours=2, minutes=30),
            "firm",
            "1st of 1 waiting for 1 GPU, expected start about 11:30 UTC "
            "(in 2 h 30 min; when a notice or an idle reclaim is due, not a promise)",
        ),
        (
            3,
            3,
            1,
            at(hours=3),
            "guess",
            "3rd of 3 waiting for 1 GPU, expected start about 12:00 UTC "
            "(in 3 h; a guess from recent run lengths, not a promise)",
        ),
        (
            1,
            2,
            4,
            at(minutes=0.5),
            "now",
            "1st of 2 waiting for 4 GPUs, expected start within a minute "
            "(GPUs are free for it now, not a promise)",
        ),
        (
            1,
            2,
            4,
            at(minutes=-3),  # an estimate already past reads as within a minute, never negative
            "guess",
            "1st of 2 waiting for 4 GPUs, expected start within a minute "
            "(a guess from recent run lengths, not a promise)",
        ),
        (
            11,
            12,
            3,
            None,
            "unknown",
            "11th of 12 waiting for 3 GPUs; no expected start yet (nothing now running has an end in sight)",
        ),
    ],
)
def test_wait_line(utc_tz, position, waiting, gpus, expected, sure, line):
    assert queueview.wait_line(position, waiting, gpus, expected, sure, T) == line


def test_wait_line_shows_utc_whatever_the_machines_zone(monkeypatch):
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        line = queueview.wait_line(1, 1, 1, at(hours=1), "guess", T)  # 10:00 UTC in November
        assert "about 10:00 UTC " in line and queueview.utc_clock(at(hours=1)) == "10:00 UTC"
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize(
    "seconds, words",
    [
        (0, "under a minute"),
        (29, "under a minute"),
        (31, "1 min"),
        (600, "10 min"),
        (3540, "59 min"),
        (3600, "1 h"),
        (5400, "1 h 30 min"),
        (36000, "10 h"),
    ],
)
def test_in_words(seconds, words):
    assert values.minutes_in_words(seconds) == words


# the traits --------------------------------------------------------------------------


def test_good_shares_and_weights_pass():
    hub = GpuHub(default_share=2, group_shares={"staff": 4}, user_shares={"alice": 1})
    assert hub.shares() == Shares(default=2, groups={"staff": 4}, users={"alice": 1})
    hub = GpuHub(priority_weight_age=0, priority_max_age_hours=4, fairshare_half_life_hours=72)
    assert hub.queue_weights() == Weights(fairshare=1000, age=0, max_age_hours=4, half_life_hours=72)
    settings = GpuHub(queue_keepalive_seconds=60, queue_max_wait_hours=4).queue_settings()
    assert (settings.keepalive_seconds, settings.max_wait_hours) == (60, 4)


@pytest.mark.parametrize(
    "traits, named",
    [
        ({"default_share": 0}, "c.GpuHub.default_share"),
        ({"default_share": -3}, "c.GpuHub.default_share"),
        ({"default_share": True}, "c.GpuHub.default_share"),
        ({"group_shares": {"staff": 0}}, "c.GpuHub.group_shares['staff']"),
        ({"group_shares": {"staff": 1.5}}, "c.GpuHub.group_shares['staff']"),
        ({"group_shares": {"staff": 2.0}}, "c.GpuHub.group_shares['staff']"),
        ({"group_shares": {"staff": False}}, "c.GpuHub.group_shares['staff']"),
        ({"user_shares": {"alice": -1}}, "c.GpuHub.user_shares['alice']"),
        ({"user_shares": {"alice": "2"}}, "c.GpuHub.user_shares['alice']"),
    ],
)
def test_bad_shares_are_refused_with_the_trait_named(traits, named):
    hub = GpuHub(**traits)
    with pytest.raises(ValueError) as err:
        hub.shares()
    assert named in str(err.value)
    with pytest.raises(ValueError):
        hub.queue_settings()  # what open_ledger uses: the hub does not start on it


@pytest.mark.parametrize(
    "trait, value",
    [
        ("priority_weight_fairshare", -1),
        ("priority_weight_age", -5),
        ("fairshare_half_life_hours", 0.0),
        ("fairshare_half_life_hours", -1.0),
        ("fairshare_half_life_hours", float("nan")),
        ("fairshare_half_life_hours", float("inf")),
        ("priority_max_age_hours", float("nan")),
        ("priority_max_age_hours", 0.0),
        ("queue_max_wait_hours", float("inf")),
        ("queue_max_wait_hours", float("nan")),
        ("queue_keepalive_seconds", 0.0),
        ("queue_keepalive_seconds", float("-inf")),
        ("queue_default_run_hours", float("nan")),
        ("queue_poll_seconds", -1.0),
    ],
)
def test_bad_weights_and_hours_are_refused_with_the_trait_named(trait, value):
    hub = GpuHub(**{trait: value})
    with pytest.raises(ValueError) as err:
        hub.queue_weights()
    assert f"c.GpuHub.{trait}" in str(err.value)
    with pytest.raises(ValueError):
        hub.queue_settings()
