"""The queue in the ledger, on a real SQLite file and a real PostgreSQL database, with a clock
the test moves: 4 simulated GPUs, three users (alice, bob, carol). Waiting, the fair-share
order, backfill, the direct allocate that must not pass the queue, limits, keepalive, restarts."""

from datetime import datetime, timedelta

import pytest
from sqlalchemy import create_engine, text

from spawner.ledger import Ledger, QueueSettings
from spawner.policy import schedule as queueplan
from spawner.policy.fairshare import Shares
from spawner.policy.limits import EffectiveLimit, Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu

from .ledgertools import Clock

INV = [Gpu("n1", i, "A100") for i in range(4)]
RULES = LimitRules(default=Limit(max_gpus=4))
START = datetime(2026, 11, 2, 9, 0)


@pytest.fixture
def clock():
    return Clock(START)


@pytest.fixture
def url(db_url):
    return db_url


@pytest.fixture
def open_ledger(url, clock):
    opened = []

    def make(**settings):
        led = Ledger(url, config_rules=RULES, clock=clock, queue=QueueSettings(**settings))
        led.sync_inventory(INV)
        opened.append(led)
        return led

    yield make
    for led in opened:
        led.close()


@pytest.fixture
def led(open_ledger):
    return open_ledger(keepalive_seconds=3600)  # most tests do not poll; keepalive has its own


def entry_rows(url):
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text('SELECT id, "user", state FROM queue_entries ORDER BY id')).all()
    engine.dispose()
    return rows


def order(led):
    return [(q.user, q.position) for q in led.queue()]


def held_by(led, user):
    return sum(len(a.gpus) for a in led.active(user=user))


def test_a_request_that_does_not_fit_waits_with_its_place_and_expected_start(led, clock):
    led.allocate("alice", [], 2)
    led.allocate("bob", [], 1)
    clock.advance(minutes=5)
    got = led.request("carol", [], 2)
    assert got.allocation is None and got.entry is not None
    carol = got.entry
    assert (carol.state, carol.position, carol.waiting, carol.gpu_count) == ("waiting", 1, 1, 2)
    # alice's and bob's servers are planned with the default 2 h (both end at 11:00), but
    # nobody has a finished run to go by: the line says so rather than inventing hours
    assert (carol.expected, carol.sure) == (START + timedelta(hours=2), "default")
    assert carol.line(clock()) == (
        "1st of 1 waiting for 2 GPUs; cannot tell yet when it starts (no run here has ended yet to go by)"
    )
    clock.advance(minutes=1)
    bob = led.request("bob", [], 2).entry  # bob holds 1: asks for 2 more, 1 is free
    assert (bob.position, bob.waiting) == (2, 2)
    assert order(led) == [("carol", 1), ("bob", 2)]
    again = led.wait_turn(carol.id)
    assert again.allocation is None and (again.entry.position, again.entry.waiting) == (1, 2)
    assert held_by(led, "carol") == 0


def test_a_heavy_recent_user_waits_behind_a_light_one(led, clock):
    history = led.allocate("bob", [], 4)  # bob used the whole machine for 3 hours
    clock.advance(hours=3)
    led.release(history.id)
    blocker = led.allocate("carol", [], 4)
    clock.advance(minutes=10)
    bob = led.request("bob", [], 3).entry  # bob asks first ...
    clock.advance(minutes=1)
    alice = led.request("alice", [], 3).entry  # ... alice, who used nothing, goes first
    assert order(led) == [("alice", 1), ("bob", 2)]
    factors = {q.user: q.factors for q in led.queue()}
    assert factors["alice"].fairshare == 1.0 > factors["bob"].fairshare
    assert factors["bob"].usage > factors["alice"].usage == 0.0
    led.release(blocker.id)
    # bob asks first after the release, but only 3 of 4 can start and alice is ahead
    asked = led.wait_turn(bob.id)
    assert asked.allocation is None and asked.entry.state == "waiting"
    assert held_by(led, "bob") == 0
    got = led.wait_turn(alice.id)
    assert got.allocation is not None and len(got.allocation.gpus) == 3
    assert order(led) == [("bob", 1)]


def test_the_head_starts_on_its_first_ask_after_a_release(led, clock):
    a = led.allocate("alice", [], 2)
    led.allocate("bob", [], 2)
    carol = led.request("carol", [], 2).entry
    assert led.wait_turn(carol.id).allocation is None
    led.release(a.id)  # no other step: no clock, no sweep
    got = led.wait_turn(carol.id)
    assert got.allocation is not None and sorted(g.label for g in got.allocation.gpus) == sorted(
        g.label for g in a.gpus
    )
    assert got.entry.state == "granted" and got.entry.allocation_id == got.allocation.id
    assert led.queue() == []


def test_backfill_starts_a_small_request_only_where_it_does_not_delay_the_head(led, clock):
    short = led.allocate("bob", [], 1)  # bob's runs are 10 min long
    led.mark_running(short.id)
    clock.advance(minutes=10)
    led.release(short.id)
    led.allocate("alice", [], 3)  # alice's (the default 2 h) end about 11:10
    clock.advance(minutes=5)
    carol = led.request("carol", [], 4).entry  # the head: all 4, at about 11:10
    assert carol.position == 1 and carol.expected == START + timedelta(hours=2, minutes=10)
    # one GPU is free, but alice's 2 h run on it would pass 11:10: she waits behind carol
    alice = led.request("alice", [], 1)
    assert alice.allocation is None and alice.entry.position == 2
    assert led.wait_turn(alice.entry.id).allocation is None
    # bob's 10 min run ends long before: it starts now, on the free GPU
    bob = led.request("bob", [], 1)
    assert bob.allocation is not None and [g.label for g in bob.allocation.gpus] == ["n1:3"]
    after = led.queue_entry(carol.id)
    assert (after.position, after.expected, after.sure) == (1, carol.expected, carol.sure)


def test_a_direct_allocate_does_not_pass_the_queue(led, clock):
    led.allocate("alice", [], 3)
    assert led.allocate("bob", [], 1).gpus  # an empty queue: a free GPU is taken directly
    led.release(led.active(user="bob")[0].id)
    clock.advance(minutes=5)
    carol = led.request("carol", [], 4).entry
    with pytest.raises(Refusal) as err:
        led.allocate("bob", [], 1)
    assert err.value.reason == "no_capacity"
    assert "1 request waits for GPUs ahead of yours (a fair-share queue)" in err.value.message
    assert held_by(led, "bob") == 0
    led.leave_queue(carol.id)
    assert led.allocate("bob", [], 1).gpus


def test_the_limit_counts_what_a_user_already_waits_for(led, clock):
    led.set_limit("user", "bob", Limit(max_gpus=3))
    led.allocate("alice", [], 4)
    led.request("bob", [], 2)
    led.request("bob", [], 1, server_name="second")  # 2 + 1 of 3
    before = entry_rows(led.url)
    with pytest.raises(Refusal) as err:
        led.request("bob", [], 1, purpose="distributed")
    assert err.value.reason == "over_limit"
    assert "you hold 0 and already wait for 3 of a limit of 3 (user bob)" in err.value.message
    with pytest.raises(Refusal) as err:  # a direct allocate counts them too
        led.allocate("bob", [], 1, server_name="third")
    assert err.value.reason == "over_limit"
    assert entry_rows(led.url) == before


def test_held_and_waiting_and_asked_may_reach_the_limit_but_not_pass_it(led, clock):
    led.set_limit("user", "bob", Limit(max_gpus=3))
    led.allocate("alice", [], 3)
    led.allocate("bob", [], 1)
    assert led.request("bob", [], 2, server_name="more").entry.gpu_count == 2  # 1 + 2 of 3
    with pytest.raises(Refusal) as err:
        led.request("bob", [], 1, server_name="yet more")
    assert err.value.reason == "over_limit" and "you hold 1 and already wait for 2" in err.value.message


@pytest.mark.parametrize(
    "user, count, kw, reason",
    [
        ("carol", 5, {}, "too_large"),  # more than the machine has
        ("carol", 4, {"gpus_per_node": 3, "max_nodes": None}, "too_large"),  # 4 cannot be split 3 per node
        ("bob", 3, {}, "over_limit"),  # bob's limit is 2
        ("carol", 1, {"model": "H100"}, "unknown_model"),
        ("carol", 0, {}, "bad_request"),
    ],
)
def test_impossible_requests_are_refused_at_once_and_leave_no_entry(led, clock, user, count, kw, reason):
    led.set_limit("user", "bob", Limit(max_gpus=2))
    led.allocate("alice", [], 4)  # the machine is full: the refusal must not be "wait"
    led.request("carol", [], 1, server_name="waiting")
    before = entry_rows(led.url)
    with pytest.raises(Refusal) as err:
        led.request(user, [], count, **kw)
    assert err.value.reason == reason
    assert entry_rows(led.url) == before


def test_an_entry_nobody_asks_about_leaves_the_queue(open_ledger, clock):
    led = open_ledger(keepalive_seconds=30)
    led.allocate("alice", [], 4)
    carol = led.request("carol", [], 1).entry
    bob = led.request("bob", [], 1).entry
    clock.advance(seconds=20)
    assert led.wait_turn(bob.id).entry.state == "waiting"
    clock.advance(seconds=15)  # carol's waiter has been silent 35 s, bob's 15 s
    assert led.wait_turn(bob.id).entry.state == "waiting"
    gone = led.queue_entry(carol.id)
    assert gone.state == "left" and gone.end_reason == (
        "nobody waited for it any more (not asked about for 30 s)"
    )
    asked = led.wait_turn(carol.id)  # a waiter coming back late finds it ended, with the reason
    assert asked.allocation is None and asked.entry.state == "left"
    assert order(led) == [("bob", 1)]


def test_an_outage_of_the_broker_costs_no_waiter_its_place(open_ledger, clock):
    """Waiters ask through the broker: when it comes back (``resume_waiting``) every waiting
    entry counts as asked about then, however long it was down; one whose waiter died with
    the outage ends a keepalive later. Entries that no longer wait are left as they are."""
    led = open_ledger(keepalive_seconds=30)
    led.allocate("alice", [], 4)
    carol = led.request("carol", [], 1).entry
    bob = led.request("bob", [], 1).entry
    dave = led.request("dave", [], 1).entry
    led.leave_queue(dave.id)
    clock.advance(seconds=45)  # the broker was down longer than the keepalive
    assert led.resume_waiting() == 2
    assert led.resume_waiting() == 0  # nothing left to move: no write counted as a change
    clock.advance(seconds=20)
    asked = led.wait_turn(bob.id)  # bob's kernel asks again: his place is kept
    assert asked.entry.state == "waiting" and order(led) == [("carol", 1), ("bob", 2)]
    assert led.queue_entry(dave.id).state == "left"
    clock.advance(seconds=15)  # carol's waiter never came back: 35 s since the broker did
    assert led.wait_turn(bob.id).entry.state == "waiting"
    gone = led.queue_entry(carol.id)
    assert gone.state == "left" and "not asked about for 30 s" in gone.end_reason
    assert order(led) == [("bob", 1)]


def test_a_waiter_asking_after_the_keepalive_finds_its_entry_ended(open_ledger, clock):
    """The keepalive ends an entry whether or not something else ran first: its own late ask
    does not bring it back."""
    led = open_ledger(keepalive_seconds=30)
    led.allocate("alice", [], 4)
    carol = led.request("carol", [], 1).entry
    clock.advance(seconds=31)
    asked = led.wait_turn(carol.id)
    assert asked.entry.state == "left" and "not asked about for 30 s" in asked.entry.end_reason
    assert led.queue() == []


def test_the_sweep_ends_a_wait_nobody_asks_about_with_nobody_else_asking(open_ledger, clock):
    """A waiter lost to a hub restart never asks again; nothing else may ask either (an idle
    hub): the broker's sweep ends its entry a keepalive later, with the reason; and a wait past
    the longest allowed (36 s here), asked about or not."""
    led = open_ledger(keepalive_seconds=30, max_wait_hours=0.01)
    led.allocate("alice", [], 4)
    carol = led.request("carol", [], 1).entry
    bob = led.request("bob", [], 1).entry
    clock.advance(seconds=20)
    led.wait_turn(bob.id)
    assert led.end_stale_waits() == []  # within the keepalive: both still wait
    clock.advance(seconds=11)
    assert led.end_stale_waits() == [carol.id]
    assert "not asked about for 30 s" in led.queue_entry(carol.id).end_reason
    assert [q.user for q in led.queue()] == ["bob"]
    clock.advance(seconds=9)  # bob asked 20 s ago, but has waited 40 s
    assert led.end_stale_waits() == [bob.id] and led.queue() == []
    assert "waited the longest allowed" in led.queue_entry(bob.id).end_reason


def test_a_request_waits_at_most_the_max_wait(open_ledger, clock):
    led = open_ledger(keepalive_seconds=3600, max_wait_hours=0.5)
    led.allocate("alice", [], 4)
    carol = led.request("carol", [], 1).entry
    clock.advance(minutes=20)
    assert led.wait_turn(carol.id).entry.state == "waiting"
    clock.advance(minutes=11)
    ended = led.wait_turn(carol.id).entry
    assert ended.state == "left"
    assert ended.end_reason == "it waited the longest allowed (0.5 h, c.GpuHub.queue_max_wait_hours)"
    assert led.queue() == [] and held_by(led, "carol") == 0


def test_a_server_asked_for_again_within_the_keepalive_keeps_its_place(open_ledger, clock):
    led = open_ledger(keepalive_seconds=30)
    led.allocate("alice", [], 4)
    carol = led.request("carol", [], 1).entry
    clock.advance(seconds=10)
    bob = led.request("bob", [], 1).entry
    clock.advance(seconds=10)
    # the hub restarted, or the user clicked start again: the same user and server
    again = led.request("carol", [], 1).entry
    assert (again.id, again.created, again.position, again.waiting) == (carol.id, START, 1, 2)
    assert [r.state for r in entry_rows(led.url)] == ["waiting", "waiting"]
    assert order(led) == [("carol", 1), ("bob", 2)]
    # after the keepalive it is a new request, behind bob
    clock.advance(seconds=15)
    led.wait_turn(bob.id)
    clock.advance(seconds=16)  # carol silent for 31 s
    later = led.request("carol", [], 1).entry
    assert later.id != carol.id and later.created == clock() and later.position == 2
    assert led.queue_entry(carol.id).state == "left"


def test_leave_queue_and_leave_queue_of(led, clock):
    led.allocate("alice", [], 4)
    first = led.request("carol", [], 1).entry
    second = led.request("carol", [], 1, server_name="gpu2").entry
    burst = led.request("carol", [], 1, purpose="distributed", server_name="gpu2").entry  # its kernel's
    bob = led.request("bob", [], 1).entry
    assert led.leave_queue(first.id, "stop button") is True
    assert led.leave_queue(first.id) is False  # no longer waits
    ended = led.queue_entry(first.id)
    assert (ended.state, ended.end_reason, ended.position) == ("left", "stop button", 0)
    assert [q.id for q in led.queue()] == [second.id, burst.id, bob.id]
    assert [q.position for q in led.queue()] == [1, 2, 3]
    # the server gpu2 was stopped: its spawn entry leaves; the burst and bob stay
    assert led.leave_queue_of("carol", "gpu2", "server stopped") == [second.id]
    assert led.leave_queue_of("carol", "gpu2", "server stopped") == []
    assert led.queue_entry(second.id).end_reason == "server stopped"
    assert [q.id for q in led.queue()] == [burst.id, bob.id]
    assert led.leave_queue_of("bob", "gpu2", "not bob's") == []
    assert held_by(led, "carol") == 0


def test_move_to_front(led, clock):
    a = led.allocate("alice", [], 4)
    carol = led.request("carol", [], 3).entry
    clock.advance(minutes=1)
    bob = led.request("bob", [], 3).entry
    assert order(led) == [("carol", 1), ("bob", 2)]
    moved = led.move_to_front(bob.id)
    assert moved.front == clock()
    assert order(led) == [("bob", 1), ("carol", 2)]
    assert led.queue_entry(bob.id).factors.front
    clock.advance(minutes=1)
    led.move_to_front(carol.id)  # the latest move goes first
    assert order(led) == [("carol", 1), ("bob", 2)]
    clock.advance(minutes=1)
    led.move_to_front(bob.id)
    led.release(a.id)
    assert led.wait_turn(carol.id).allocation is None
    assert led.wait_turn(bob.id).allocation is not None
    with pytest.raises(LookupError):
        led.move_to_front(bob.id)  # granted: no longer waits


def test_a_limit_lowered_below_a_waiting_request_ends_it_at_the_next_ask(led, clock):
    a = led.allocate("alice", [], 4)
    bob = led.request("bob", ["students"], 2).entry
    carol = led.request("carol", [], 1).entry
    assert [q.id for q in led.queue()] == [bob.id, carol.id]
    led.set_limit("group", "students", Limit(max_gpus=1))
    # not its turn, GPUs all held: it leaves anyway, with the new limit and what to do
    ended = led.wait_turn(bob.id)
    assert ended.allocation is None and ended.entry.state == "left"
    assert ended.entry.end_reason == (
        "your limit is now 1 GPU (group students); your request for 2 GPUs can never fit: "
        "start again with 1 or fewer, or ask an admin to raise the limit"
    )
    # whoever waited behind it moves up
    assert [(q.id, q.position) for q in led.queue()] == [(carol.id, 1)]
    led.release(a.id)
    assert led.wait_turn(carol.id).allocation is not None
    assert held_by(led, "bob") == 0


def test_a_request_that_fits_a_lowered_limit_waits_and_ends_at_its_turn_beside_what_is_held(led, clock):
    led.set_limit("user", "bob", Limit(max_gpus=3))
    led.allocate("bob", [], 1)
    a = led.allocate("alice", [], 3)
    bob = led.request("bob", [], 2).entry
    led.set_limit("user", "bob", Limit(max_gpus=2))  # 2 still fits the limit: it may wait
    assert led.wait_turn(bob.id).entry.state == "waiting"
    led.release(a.id)
    ended = led.wait_turn(bob.id)  # its turn, but beside the 1 bob holds it passes the limit
    assert ended.allocation is None and ended.entry.state == "left"
    assert ended.entry.end_reason == (
        "your limit no longer leaves room for it: you hold 1 of a limit of 2 (user bob); stop "
        "something you hold and start again, or start again with 1 or fewer"
    )
    assert held_by(led, "bob") == 1 and led.queue() == []


@pytest.mark.parametrize(
    "gpus, limit, says",
    [
        (2, Limit(max_gpus=2), None),  # fits: it waits
        (2, Limit(max_gpus=None), None),  # no limit
        (2, Limit(max_gpus=5, gpu_hours=0.0), None),  # a quota used up frees in time: it waits
        (
            2,
            Limit(max_gpus=1),
            "your limit is now 1 GPU (group students); your request for 2 GPUs can never fit: "
            "start again with 1 or fewer, or ask an admin to raise the limit",
        ),
        (
            1,
            Limit(max_gpus=0),
            "your limit is now 0 GPUs (group students); your request for 1 GPU can never fit: "
            "start again without GPUs (0), or ask an admin to raise the limit",
        ),
    ],
)
def test_limit_ends_wait(gpus, limit, says):
    assert queueplan.limit_ends_wait(gpus, EffectiveLimit(limit, "group students")) == says


def test_a_granted_entry_is_a_normal_allocation(led, clock):
    a = led.allocate("alice", [], 2)
    led.allocate("alice", [], 2, server_name="other")
    burst = led.request("carol", [], 2, purpose="distributed", lease_seconds=60).entry
    server = led.request("bob", [], 1).entry
    clock.advance(minutes=1)
    led.release(a.id)
    got = led.wait_turn(burst.id).allocation
    assert (got.state, got.purpose, got.user, len(got.gpus)) == ("running", "distributed", "carol", 2)
    assert got.lease_expires == clock() + timedelta(seconds=60)
    assert led.wait_turn(burst.id).allocation == got  # asking again: the same allocation
    history = led.queue_history(START)
    assert [(h.id, h.state, h.allocation_id, h.end_reason) for h in history] == [
        (burst.id, "granted", got.id, "started after 60 s")
    ]
    assert led.renew(got.id, 120).lease_expires == clock() + timedelta(seconds=120)
    clock.advance(minutes=3)
    assert led.expire_leases() == [got.id]  # a lease that runs out ends as any other
    bob = led.wait_turn(server.id).allocation
    assert (bob.state, bob.purpose, bob.lease_expires) == ("starting", "server", None)
    assert led.mark_running(bob.id, "job-1").state == "running"
    assert led.release(bob.id) is True and led.get(bob.id).state == "released"
    assert held_by(led, "bob") == 0


def test_a_reopened_ledger_sees_the_same_queue_in_the_same_order(open_ledger, clock):
    led = open_ledger(keepalive_seconds=60)
    history = led.allocate("bob", [], 2)
    clock.advance(hours=1)
    led.release(history.id)
    led.allocate("alice", [], 4)
    led.request("bob", [], 1)
    clock.advance(seconds=5)
    led.request("carol", [], 2, purpose="distributed", lease_seconds=30)
    clock.advance(seconds=5)
    led.request("bob", [], 2, server_name="big")
    before = led.queue()
    assert [q.user for q in before] == ["carol", "bob", "bob"]
    led.close()
    clock.advance(seconds=20)  # the hub restarts within the keepalive
    reopened = open_ledger(keepalive_seconds=60)
    after = reopened.queue()
    assert [(q.id, q.user, q.created, q.position, q.waiting) for q in after] == [
        (q.id, q.user, q.created, q.position, q.waiting) for q in before
    ]
    for q in after:  # their waiters ask again and keep waiting
        assert reopened.wait_turn(q.id).entry.state == "waiting"


def test_a_new_request_is_ranked_with_its_groups_share(open_ledger, clock):
    """Whether a request starts now or waits is decided with the share of the groups it
    names, as it is once it waits: a staff member (share 8) with more recent use than
    alice still goes ahead of her."""
    led = open_ledger(keepalive_seconds=3600, shares=Shares(default=1, groups={"staff": 8}))
    past = led.allocate("alice", [], 1)
    clock.advance(hours=1)
    led.release(past.id)
    past = led.allocate("bob", ["staff"], 3)
    clock.advance(hours=1)
    led.release(past.id)
    led.allocate("carol", [], 2)
    clock.advance(minutes=5)
    alice = led.request("alice", [], 4).entry  # waits for carol's 2
    got = led.request("bob", ["staff"], 2)
    # bob's 3 GPU-hours against his 8 of 10 shares beat alice's 1 against 1 of 10: he is
    # ahead of her, and the 2 free GPUs are his now
    assert got.allocation is not None, [(q.user, q.factors) for q in led.queue()]
    assert led.queue_entry(alice.id).position == 1
