"""EASY against conservative backfill (spawner.queueplan.plan's ``reservations``): the head's
expected start is never delayed either way; only conservative backfill protects the second."""

from datetime import datetime, timedelta

import pytest

from spawner.policy import Gpu, Request
from spawner.queueplan import Expected, Held, Waiting, plan

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
