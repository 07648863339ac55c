"""EASY against conservative backfill (spawner.policy.schedule.plan's ``reservations``): the head's
expected start is never delayed either way; only conservative backfill protects the second."""

from datetime import datetime, timedelta

import pytest

from spawner.policy.placement import Gpu, Request
from spawner.policy.schedule import (
    Expected,
    Held,
    Run,
    Waiting,
    counts,
    plan,
    typical_run_hours,
)

T = datetime(2026, 12, 1, 9, 0)
N1 = [Gpu("n1", i, "A100") for i in range(4)]


def at(hours: float) -> datetime:
    return T + timedelta(hours=hours)


def w(id, count, run):
    return Waiting(id, Request(f"u{id}", count), run)


# GPU 0 frees at +1 h, GPUs 1 and 2 at +3 h; GPU 3 is free now.
HELD = [Held((N1[0],), at(1)), Held((N1[1], N1[2]), at(3))]
# the head needs 4 (at +3 h); the second 2 for 2 h (GPUs 0 and 3 from +1 h, under
# conservative backfill); the third 1 GPU for 4 h: only GPU 3 is free now
QUEUE = [w(1, 4, 1.0), w(2, 2, 2.0), w(3, 1, 4.0)]


@pytest.mark.parametrize(
    "reservations, third_starts, second_expected",
    [
        (1, False, at(1)),  # EASY: GPU 3 is the head's at +3 h: the 4-hour request cannot take it
        (100, False, at(1)),
    ],
)
def test_a_long_request_never_backfills_onto_the_heads_gpus(reservations, third_starts, second_expected):
    p = plan(QUEUE, N1, HELD, T, reservations)
    assert p.expected[1] == Expected(at(3), "guess")
    assert (3 in p.grants) is third_starts
    assert p.expected[2].at == second_expected


SHORT = [w(1, 4, 1.0), w(2, 2, 2.0), w(3, 1, 2.5)]  # the third now runs 2.5 h: done before +3 h


@pytest.mark.parametrize(
    "reservations, third_starts",
    [
        (1, True),  # EASY: it delays the second (which wanted GPU 3 from +1 h), not the head
        (2, False),  # the second is protected too
        (100, False),  # conservative
    ],
)
def test_easy_backfill_may_delay_the_second_never_the_head(reservations, third_starts):
    p = plan(SHORT, N1, HELD, T, reservations)
    assert (3 in p.grants) is third_starts
    assert p.expected[1] == Expected(at(3), "guess")  # the head's start is the same either way
    if third_starts:
        assert p.grants[3] == (N1[3],) and 3 in p.backfilled


def test_the_heads_gpus_are_never_granted_whatever_the_reservations():
    for reservations in (1, 2, 100):
        p = plan([w(1, 4, 1.0), w(2, 1, 5.0)], N1, HELD, T, reservations)
        assert p.grants == {} and p.expected[1] == Expected(at(3), "guess")


# a grant ahead of a reservation names it: there are no time limits yet, so such a grant may be
# taken back for that reservation at its turn (spawner/ledger/borrowing.py)


@pytest.mark.parametrize(
    "queue, reservations, granted, ahead_of",
    [
        (SHORT, 1, {3}, {3: (1,)}),  # EASY: the third goes ahead of the head only
        (SHORT, 2, set(), {}),  # the second protected too: nothing backfills
        ([w(1, 4, 1.0), w(2, 1, 2.5)], 1, {2}, {2: (1,)}),
        ([w(1, 4, 1.0), w(2, 1, 2.5)], 100, {2}, {2: (1,)}),
        # nothing waits ahead that cannot start: no grant is ahead of anyone
        ([w(1, 1, 1.0), w(2, 1, 1.0)], 1, {1}, {}),
        # the first starts now on the free GPU, ahead of nobody; the others wait
        ([w(1, 1, 5.0), w(2, 4, 1.0), w(3, 1, 0.5)], 1, {1}, {}),
        # an entry that can never be placed holds no reservation: nobody is ahead of it
        ([w(1, 8, 1.0), w(2, 1, 9.0)], 1, {2}, {}),
    ],
)
def test_a_grant_ahead_of_a_reservation_names_it(queue, reservations, granted, ahead_of):
    p = plan(queue, N1, HELD, T, reservations)
    assert set(p.grants) == granted
    assert p.ahead_of == ahead_of
    assert set(p.ahead_of) <= p.backfilled


def test_a_grant_ahead_of_two_reservations_names_both():
    # GPUs 0 (+1 h) and 1-2 (+3 h) held, 3 free: the head needs 4 (+3 h), the second 2 (+1 h,
    # on GPUs 0 and 3 until +2 h); a 30-minute job on GPU 3 delays neither
    p = plan([w(1, 4, 1.0), w(2, 2, 1.0), w(3, 1, 0.5)], N1, HELD, T, 2)
    assert p.grants == {3: (N1[3],)} and p.ahead_of == {3: (1, 2)}


# what a user's typical run length is made of


def run(minutes, by_gpuhub=False, started=True):
    return Run(T if started else None, T + timedelta(minutes=minutes), by_gpuhub)


@pytest.mark.parametrize(
    "r, least, counted",
    [
        (run(10), 300, True),
        (run(5), 300, True),  # exactly the least
        (run(4.9), 300, False),  # taken and given back at once
        (run(0), 300, False),
        (run(0), 0, True),  # the least set to 0: every run counts
        (run(60, by_gpuhub=True), 300, False),  # an idle reclaim or a preemption ended it
        (run(60, started=False), 300, False),  # never started (a server that never came up)
    ],
)
def test_which_runs_count(r, least, counted):
    assert counts(r, least) is counted


@pytest.mark.parametrize(
    "runs, want",
    [
        ([], None),
        ([run(0)] * 20, None),  # 20 instant cycles: nothing known, the default applies
        ([run(0)] * 20 + [run(30)], 0.5),  # only the real run counts
        ([run(10), run(20), run(30)], 20 / 60),
        ([run(60, by_gpuhub=True)] * 5 + [run(120)], 2.0),
        ([run(10)] * 20 + [run(600)] * 5, 10 / 60),  # the newest 20 that count
        ([run(1)] * 30 + [run(600)] * 5, 10.0),  # ... skipping those that do not
    ],
)
def test_typical_run_hours(runs, want):
    got = typical_run_hours(runs, 300, keep=20)
    assert got == (None if want is None else pytest.approx(want))
