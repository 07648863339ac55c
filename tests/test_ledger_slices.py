"""Slices of GPUs in the ledger (issue 34), on a real SQLite file and a real PostgreSQL
database: four users share one GPU in quarters, a fifth waits in the queue and starts when one
stops, a whole-GPU request waits while any slice is held (and a slice while the GPU is held
whole), a slice counts as its share against limits and in GPU-hours, another process's kept
free GPUs learn of slices, and the database refuses a second holder of one slice."""

import json
from datetime import datetime, timedelta
from fractions import Fraction

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.exc import IntegrityError

from spawner.ledger import BorrowSettings, Ledger, QueueSettings
from spawner.policy.borrowing import BorrowRules
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu
from spawner.policy.slices import check_gpu_slices

from .ledgertools import Clock

INV = [Gpu("n1", 0, "A100", 40960), Gpu("n1", 1, "T4", 16384)]
OFFERS = check_gpu_slices({"A100": 4}, INV)
START = datetime(2026, 12, 7, 9, 0)
QUARTER = dict(model="A100", slice_parts=4)


@pytest.fixture
def clock():
    return Clock(START)


@pytest.fixture
def open_ledger(db_url, clock):
    opened = []

    def make(rules=None):
        led = Ledger(
            db_url,
            config_rules=rules or LimitRules(default=Limit(max_gpus=1)),
            clock=clock,
            queue=QueueSettings(keepalive_seconds=3600),
            slice_offers=OFFERS,
        )
        led.sync_inventory(INV)
        opened.append(led)
        return led

    yield make
    for led in opened:
        led.close()


@pytest.fixture
def led(open_ledger):
    return open_ledger()


def held_rows(url):
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text("SELECT allocation_id, gpu_id, part, parts FROM allocation_gpus WHERE held ORDER BY part")
        ).all()
    engine.dispose()
    return rows


def test_four_users_share_a_gpu_in_quarters_a_fifth_waits_and_starts_when_one_stops(led, db_url):
    got = [led.allocate(f"s{i}", ["students"], 1, **QUARTER) for i in range(4)]
    assert [a.gpus[0].label for a in got] == ["n1:0s1", "n1:0s2", "n1:0s3", "n1:0s4"]
    assert {(a.gpus[0].parts, a.gpus[0].memory_mib, a.units) for a in got} == {(4, 10240, Fraction(1, 4))}
    assert [(r.part, r.parts) for r in held_rows(db_url)] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    fifth = led.request("s4", ["students"], 1, **QUARTER)
    assert fifth.allocation is None and (fifth.entry.position, fifth.entry.waiting) == (1, 1)
    # it expects the first quarter held to end (nobody here has a finished run: the default)
    default_end = START + timedelta(hours=QueueSettings().default_run_hours)
    assert (fifth.entry.expected, fifth.entry.sure) == (default_end, "default")
    # the other model's GPU is whole and free: it was never split
    assert [g.label for g in led.allocate("t", [], 1).gpus] == ["n1:1"]
    assert led.wait_turn(fifth.entry.id).allocation is None  # nothing ended yet
    led.release(got[1].id)
    turn = led.wait_turn(fifth.entry.id)
    assert turn.allocation is not None and turn.allocation.gpus[0].label == "n1:0s2"  # the part given back
    assert turn.allocation.slice_parts == 4 and turn.entry.state == "granted"


def test_a_whole_gpu_waits_while_any_slice_is_held_drains_it_and_a_slice_waits_while_it_is_held_whole(led):
    one = led.allocate("s0", [], 1, **QUARTER)
    whole = led.request("w", [], 1, model="A100")
    assert whole.allocation is None and whole.entry.position == 1
    with pytest.raises(Refusal) as e:  # not waiting: refused, never placed on the split GPU
        led.allocate("w2", [], 1, model="A100")
    assert e.value.reason == "no_capacity"
    # the split GPU is reserved for the whole request that waits: a new slice does not refill
    # it (the GPU drains), even with three of its quarters free
    later = led.request("s1", [], 1, **QUARTER)
    assert later.allocation is None and (later.entry.position, later.entry.waiting) == (2, 2)
    assert led.wait_turn(later.entry.id).allocation is None
    led.release(one.id)
    granted = led.wait_turn(whole.entry.id).allocation
    assert granted is not None and [g.label for g in granted.gpus] == ["n1:0"] and granted.slice_parts is None
    assert led.wait_turn(later.entry.id).allocation is None  # held whole now: no slice of it
    led.release(granted.id)
    assert led.wait_turn(later.entry.id).allocation.gpus[0].label == "n1:0s1"


def test_a_slice_counts_as_its_share_against_the_limit_and_in_gpu_hours(led, clock):
    held = [led.allocate("ann", [], 1, server_name=f"s{i}", **QUARTER) for i in range(3)]
    with pytest.raises(Refusal) as e:  # 3/4 held of a limit of 1: a whole GPU passes it
        led.allocate("ann", [], 1, model="T4")
    assert e.value.reason == "over_limit" and "3/4" in e.value.message
    fourth = led.allocate("ann", [], 1, server_name="s3", **QUARTER)
    with pytest.raises(Refusal) as e:  # the fifth quarter would be 5/4
        led.request("ann", [], 1, server_name="s4", **QUARTER)
    assert e.value.reason == "over_limit" and "you hold 1 GPU" in e.value.message
    assert led.allowance("ann", []).held == 1
    clock.advance(hours=2)
    for a in [*held, fourth]:
        led.release(a.id)
    assert led.usage(START, START + timedelta(hours=3))["ann"] == pytest.approx(4 * 0.25 * 2)


def test_what_is_not_offered_is_refused_with_what_is(open_ledger):
    led = open_ledger(LimitRules(default=Limit(max_gpus=0)))
    cases = [
        (dict(model="T4", slice_parts=4), "bad_request", "slices offered: A100 (1/4 GPU)"),
        (dict(model="A100", slice_parts=2), "bad_request", "A100 GPUs are not split in 2 here"),
        (dict(model="A100", slice_parts=4, on_nodes=["n9"]), "too_large", "No A100 GPU is on this server"),
        (QUARTER, "over_limit", "your limit is 0 GPUs"),
    ]
    for kw, reason, why in cases:
        with pytest.raises(Refusal) as e:
            led.request("zed", [], 1, **kw)
        assert (e.value.reason, why in e.value.message) == (reason, True), e.value.message
    with pytest.raises(Refusal) as e:
        led.request("zed", [], 2, **QUARTER)
    assert "one slice (1/4 GPU); got 2" in e.value.message


def test_another_process_kept_free_gpus_learn_of_slices(open_ledger):
    a, b = open_ledger(), open_ledger()
    b.allocate("x", [], 1, model="T4")  # b keeps its free GPUs from here on
    a.allocate("s", [], 1, **QUARTER)  # a splits the A100: b learns it from the moves
    with pytest.raises(Refusal) as e:
        b.allocate("y", [], 1, model="A100")
    assert e.value.reason == "no_capacity"
    assert b.allocate("z", [], 1, **QUARTER).gpus[0].label == "n1:0s2"


def test_the_database_refuses_a_second_holder_of_one_slice(led, db_url):
    a = led.allocate("s0", [], 1, **QUARTER)
    b = led.allocate("s1", [], 1, **QUARTER)
    engine = create_engine(db_url)
    gpu_id = held_rows(db_url)[0].gpu_id
    with pytest.raises(IntegrityError), engine.begin() as conn:  # b's row made part 1 as well
        conn.execute(text("UPDATE allocation_gpus SET part = 1 WHERE allocation_id = :b"), {"b": b.id})
    with pytest.raises(IntegrityError), engine.begin() as conn:  # a whole hold beside it is one row more
        conn.execute(
            text("UPDATE allocation_gpus SET part = 0, parts = 0 WHERE allocation_id = :a"), {"a": a.id}
        )
        conn.execute(
            text("UPDATE allocation_gpus SET part = 0, parts = 0 WHERE allocation_id = :b"), {"b": b.id}
        )
    engine.dispose()
    assert gpu_id is not None


def test_a_slice_group_takes_slices_only_and_never_a_pool(open_ledger):
    led = open_ledger()
    led.slice_groups = frozenset({"students"})
    with pytest.raises(Refusal) as e:
        led.request("ann", ["students"], 1, model="T4")
    assert e.value.reason == "over_limit" and "Ask for 1/4 GPU of A100" in e.value.message
    with pytest.raises(Refusal) as e:
        led.allocate("ann", ["students"], 1, purpose="distributed", lease_seconds=60)
    assert "a %%distributed pool needs whole GPUs" in e.value.message
    with pytest.raises(Refusal) as e:  # nor as slices
        led.allocate("ann", ["students"], 1, purpose="distributed", lease_seconds=60, **QUARTER)
    assert "pools run on whole GPUs" in e.value.message
    assert led.allocate("ann", ["students"], 1, **QUARTER).slice_parts == 4
    # also in a group not listed (a teaching assistant): whole GPUs too
    assert [g.label for g in led.allocate("tom", ["students", "staff"], 1, model="T4").gpus] == ["n1:1"]


def test_a_slices_idle_gpu_hours_are_its_share(led):
    a = led.allocate("s0", [], 1, **QUARTER)
    r = led.record_reclaim(a.id, 3600.0, "idle for an hour")
    assert (r.gpus, r.gpu_hours) == (1, pytest.approx(0.25))


def test_a_wait_for_a_slice_no_longer_offered_ends_with_the_reason(led):
    held = [led.allocate(f"s{i}", [], 1, **QUARTER) for i in range(4)]
    waits = led.request("s4", [], 1, **QUARTER)
    assert waits.entry is not None and held
    led.slice_offers = {}  # the hub restarted without c.GpuHub.gpu_slices
    got = led.wait_turn(waits.entry.id)
    assert got.entry.state == "left" and got.allocation is None
    assert "A100 GPUs are no longer split in 4 here (c.GpuHub.gpu_slices)" in got.entry.end_reason


def test_fair_share_counts_a_slice_as_its_share_of_a_gpus_use(led, clock):
    quarter = led.allocate("ann", [], 1, **QUARTER)
    whole = led.allocate("bob", [], 1, model="T4")
    clock.advance(hours=2)
    led.release(quarter.id)
    led.release(whole.id)
    # both wait for the T4 (carol holds it): ann used a quarter for 2 h, bob a whole GPU
    led.allocate("carol", [], 1, model="T4")
    waits = {u: led.request(u, [], 1, model="T4").entry for u in ("ann", "bob")}
    usage = {u: e.factors.usage for u, e in waits.items()}
    assert usage["ann"] == pytest.approx(usage["bob"] / 4, rel=1e-6) and usage["bob"] > 1.9
    assert [q.user for q in led.queue()] == ["ann", "bob"]  # the lighter use goes first


def test_a_slice_holder_borrows_whole_gpus_beyond_the_limit_in_whole_numbers(open_ledger):
    led = open_ledger(LimitRules(default=Limit(max_gpus=2)))
    led.borrow_settings = BorrowSettings(rules=BorrowRules(default=1))
    led.sync_inventory([*INV, Gpu("n1", 2, "T4", 16384)])
    led.allocate("ann", [], 1, **QUARTER)
    # 2 T4s beside 1/4 of the A100, with a limit of 2: the quarter takes a whole GPU's room
    # from whole GPUs, so 1 is within the limit and 1 borrowed (never a part of one)
    both = led.allocate("ann", [], 2, model="T4")
    assert both.borrowed == 1 and led.allowance("ann", []).held == Fraction(5, 4)
    assert led.allocate("ann", [], 1, **QUARTER).slice_parts == 4  # 3/2 within the limit now
    with pytest.raises(Refusal) as e:  # a whole GPU more: beyond the allowance, a refusal JSON can carry
        led.allocate("ann", [], 1, model="A100")
    assert json.dumps({"fits": e.value.fits}) and "may borrow at most 1" in e.value.message
