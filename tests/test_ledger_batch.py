"""Writes of one process's threads that wait for the writer's turn together are made in one
transaction (spawner/ledger/combine.py), and every caller gets what it would have got alone.

The real concurrency test is tests/test_stress.py (threads sharing a ledger beside other
processes, with the invariant and grant-order checkers); here a turn is made to hold known
writes, on SQLite and on PostgreSQL, and compared with the same writes made one by one."""

import threading
from datetime import datetime, timedelta

import pytest
from sqlalchemy import select

from spawner.ledger import Ledger, combine
from spawner.ledger.models import LedgerLock
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu

RULES = LimitRules(default=Limit(max_gpus=4))
INVENTORY = [Gpu(f"n{n}", i, "A100") for n in range(2) for i in range(4)]
# in this order: u3's 5 can never fit (refused, in the middle of the turn); u1 and u2 take 7
# of the 8 GPUs, so u4's 2 waits; u5's 1 fits beside u4's wait (the queue's plan backfills it)
ASKS = [("u1", 3), ("u3", 5), ("u2", 4), ("u4", 2), ("u5", 1)]


@pytest.mark.parametrize(
    "info, start, after, waiting_after",
    [
        # a write that ended the leases due at the start: the next one skips that read
        ({"waiting": False}, {"waiting": False}, {"leases_due": False, "waiting": False}, False),
        # a flag the write did not consume stays as the lock row said
        (
            {"leases_due": True, "waiting": True},
            {"waiting": True},
            {"leases_due": True, "waiting": True},
            True,
        ),
        # the write read the queue (consumed the flag): the start's answer again
        ({"leases_due": False}, {"waiting": True}, {"leases_due": False, "waiting": True}, True),
        # the write queued a request: from now on someone waits
        ({"queued": True}, {"waiting": False}, {"leases_due": False, "waiting": True}, True),
        (
            {"queued": True, "waiting": False},
            {"waiting": False},
            {"leases_due": False, "waiting": True},
            True,
        ),
    ],
)
def test_the_flags_a_combined_turns_next_write_starts_with(info, start, after, waiting_after):
    combine.carry_flags(info, start)
    assert info == after
    assert start["waiting"] is waiting_after


def outcome(call):
    """What one ask answered: the refusal's reason, the GPUs granted, or the place queued."""
    try:
        got = call()
    except Refusal as e:
        return ("refused", e.reason, str(e))
    if got.allocation is not None:
        return ("granted", got.allocation.user, got.allocation.gpus)
    return ("queued", got.entry.user, got.entry.position, got.entry.waiting)


def opened(url):
    at = [datetime(2026, 12, 1, 9, 0)]

    def clock():  # every call a second later: both ledgers see the same moments
        at[0] += timedelta(seconds=1)
        return at[0]

    ledger = Ledger(url, config_rules=RULES, clock=clock)
    ledger.sync_inventory(INVENTORY)
    return ledger


def generation(ledger):
    with ledger._read() as s:
        return s.scalar(select(LedgerLock.generation))


def test_writes_waiting_together_commit_together_and_each_gets_its_own_answer(db_url, tmp_path):
    alone = opened(f"sqlite:///{tmp_path}/alone.sqlite")
    expected = [outcome(lambda u=u, n=n: alone.request(u, [], n)) for u, n in ASKS]
    alone.close()
    assert [o[0] for o in expected] == ["granted", "refused", "granted", "queued", "granted"]

    ledger = opened(db_url)
    before = generation(ledger)
    answers: dict[int, tuple] = {}
    threads = []
    with ledger._leader:  # the writer's turn is taken: every ask waits for the next
        for k, (user, n) in enumerate(ASKS):
            t = threading.Thread(
                target=lambda k=k, u=user, n=n: answers.__setitem__(
                    k, outcome(lambda: ledger.request(u, [], n))
                )
            )
            t.start()
            threads.append(t)
            while len(ledger._waiting_writes) < k + 1:  # in this order
                threading.Event().wait(0.001)
    for t in threads:
        t.join()
    assert [answers[k] for k in range(len(ASKS))] == expected
    # one turn, rolled back at the refusal: the write before it made again, the refusal alone
    # (nothing written), the three after it in one transaction
    assert generation(ledger) == before + 2
    assert ledger.write_counts == {"combined": 3, "made again": 4}
    held = [g for a in ledger.active() for g in a.gpus]
    assert len(held) == len(set(held)) == 8
    ledger.close()


def test_a_write_that_fails_in_a_combined_turn_rolls_back_only_itself(db_url):
    ledger = opened(db_url)
    a = ledger.allocate("u1", [], 2)

    def broken(s):
        ledger._release_in(s, a.id, "half done")  # writes, then fails
        raise RuntimeError("lost")

    first = combine._Write(lambda s: ledger._release_in(s, 10**6, "no such allocation"))
    failing = combine._Write(broken)
    last = combine._Write(lambda s: ledger._release_in(s, a.id, "released"))
    with ledger._leader:
        ledger._make([first, failing, last])
    assert first.done and first.value is False and first.error is None
    assert failing.done and isinstance(failing.error, RuntimeError)
    assert last.done and last.value is True and last.error is None
    info = ledger.get(a.id)
    assert info.state == "released" and info.end_reason == "released"  # not "half done"
    ledger.close()


def test_a_leader_that_stops_before_making_its_turn_leaves_no_caller_waiting(tmp_path):
    ledger = opened(f"sqlite:///{tmp_path}/stop.sqlite")
    ledger._make = lambda batch: (_ for _ in ()).throw(KeyError("the leader stopped"))
    errors: dict[int, BaseException] = {}

    def ask(k):
        try:
            ledger.request(f"u{k}", [], 1)
        except BaseException as e:
            errors[k] = e

    threads = []
    with ledger._leader:
        for k in range(2):
            threads.append(threading.Thread(target=ask, args=(k,)))
            threads[-1].start()
            while len(ledger._waiting_writes) < k + 1:
                threading.Event().wait(0.001)
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    # the leader raises its own error; the other caller is told its write was never made
    assert sorted(type(e).__name__ for e in errors.values()) == ["KeyError", "RuntimeError"]
    assert "interrupted before it was made" in str(
        next(e for e in errors.values() if isinstance(e, RuntimeError))
    )
    del ledger._make
    assert ledger.request("u9", [], 1).allocation is not None  # the next write is made as ever
    ledger.close()
