"""Borrowing beyond the limit and taking it back.

The pure decisions (spawner/policy/borrowing.py) in tables; the traits (GpuHub.borrow_settings);
then the ledger (spawner/ledger/borrowing.py and the borrowing path of allocations.py) on a
real SQLite file and a real PostgreSQL database, with a clock the test moves: 4 simulated
GPUs, a limit of 2 each and a borrowing allowance of 2 each, users alice, bob, carol, dave."""

from datetime import datetime, timedelta

import pytest
from sqlalchemy import create_engine, text

from spawner.broker.responses import allocation_json
from spawner.ledger import BorrowSettings, Ledger, QueueSettings
from spawner.policy.borrowing import (
    Borrowed,
    BorrowRules,
    Split,
    allowance_problem,
    backfill_ids,
    backfill_text,
    effective_borrow,
    notice_reason,
    split,
    usable_allowance,
    victims,
    withdrawal,
)
from spawner.policy.limits import EffectiveLimit, Holdings, Limit, LimitRules, Refusal, check_request
from spawner.policy.placement import Gpu, Request
from spawner.settings import GpuHub

from .ledgertools import Clock

T = datetime(2026, 11, 2, 9, 0)

# the pure decisions ----------------------------------------------------------------------

RULES_B = BorrowRules(default=1, groups={"staff": 3, "night": 5, "none": 0}, users={"alice": 0, "bob": 7})


@pytest.mark.parametrize(
    "user, groups, want",
    [
        ("carol", [], (1, "default")),
        ("carol", ["other"], (1, "default")),
        ("carol", ["staff"], (3, "group staff")),
        ("carol", ["staff", "night"], (5, "group night")),  # the most generous group
        ("carol", ["none"], (0, "group none")),  # a group's 0 wins over the default
        ("alice", ["night"], (0, "user alice")),  # the user's entry wins, even 0
        ("bob", ["none"], (7, "user bob")),
    ],
)
def test_effective_borrow_sources(user, groups, want):
    assert effective_borrow(user, groups, RULES_B) == want


def test_effective_borrow_defaults_to_no_borrowing():
    assert effective_borrow("anyone", ["staff"], BorrowRules()) == (0, "default")


@pytest.mark.parametrize(
    "count, held, held_borrowed, max_gpus, allowance, want",
    [
        (1, 0, 0, 2, 2, Split(1, 0)),  # under the limit
        (2, 0, 0, 2, 2, Split(2, 0)),  # exactly at the limit
        (1, 1, 0, 2, 0, Split(1, 0)),  # at the limit after it, no allowance needed
        (1, 2, 0, 2, 2, Split(1, 1)),  # at the limit: all of it borrowed
        (3, 1, 0, 2, 2, Split(3, 2)),  # partly within the limit, partly borrowed
        (2, 2, 0, 2, 2, Split(2, 2)),  # up to the allowance
        (3, 2, 0, 2, 2, None),  # beyond the allowance
        (5, 0, 0, 2, 2, None),  # beyond limit + allowance from nothing
        (1, 2, 0, 2, 0, None),  # no allowance: nothing beyond the limit
        (1, 3, 1, 2, 2, Split(1, 1)),  # holds 1 borrowed: one more may be borrowed
        (1, 4, 2, 2, 2, None),  # holds the whole allowance borrowed
        (1, 2, 2, 2, 2, Split(1, 0)),  # 2 borrowed held, the limit's 2 unused: in the limit
        (1, 3, 2, 2, 2, Split(1, 0)),  # 1 in the limit held: 1 more in it
        (2, 3, 2, 2, 2, None),  # ... but not 2: 3 beyond the limit, more than the allowance
        (100, 50, 0, None, 0, Split(100, 0)),  # unlimited: never borrowed
        (1, 0, 0, 0, 1, Split(1, 0)),  # a limit of 0 lends nothing: the limit refuses it
        (3, 0, 0, 0, 8, Split(3, 0)),
    ],
)
def test_split(count, held, held_borrowed, max_gpus, allowance, want):
    assert split(count, held, held_borrowed, max_gpus, allowance) == want


@pytest.mark.parametrize(
    "max_gpus, allowance, want",
    [(2, 3, 3), (1, 0, 0), (0, 3, 0), (0, 0, 0), (None, 3, 0)],  # 0 means none, not even borrowed
)
def test_usable_allowance(max_gpus, allowance, want):
    assert usable_allowance(max_gpus, allowance) == want


@pytest.mark.parametrize(
    "count, source, refused",
    [
        (1, "group students", "You asked for 1 GPU, but your limit is 0 GPUs (group students)"),
        (3, "user bob", "You asked for 3 GPUs, but your limit is 0 GPUs (user bob)"),
        (0, "default", None),  # a server without GPUs is fine
    ],
)
def test_a_limit_of_0_refuses_every_gpu_and_says_to_ask_an_admin(count, source, refused):
    eff = EffectiveLimit(Limit(max_gpus=0), source)
    inv = [Gpu("n1", i, "A100") for i in range(4)]
    if refused is None:
        check_request(Request("bob", count), eff, Holdings(), inv, inv)
        return
    with pytest.raises(Refusal) as err:
        check_request(Request("bob", count), eff, Holdings(), inv, inv)
    assert (err.value.reason, err.value.status_code, err.value.fits) == ("over_limit", 403, 0)
    assert err.value.message == (
        f"{refused}: no GPUs at all, not even idle ones lent beyond a limit. "
        "Ask an admin of this hub to raise your limit."
    )


@pytest.mark.parametrize(
    "value, bad",
    [(0, False), (3, False), (-1, True), (True, True), (False, True), (1.5, True), (2.0, True), ("2", True)],
)
def test_allowance_problem(value, bad):
    problem = allowance_problem(value, "c.GpuHub.x")
    assert (problem is not None) == bad
    if bad:
        assert problem.startswith("c.GpuHub.x must be a whole number of GPUs") and repr(value) in problem


def g(node, index, model="A100"):
    return Gpu(node, index, model)


ONE = [g("n1", i) for i in range(4)]  # one node of 4
TWO = [g(n, i) for n in ("n1", "n2") for i in range(2)]  # two nodes of 2
MIXED = [g("n1", 0), g("n1", 1), g("n2", 0, "H100"), g("n2", 1, "H100")]


def b(id, minute, *gpus):
    return Borrowed(id, T + timedelta(minutes=minute), tuple(gpus))


@pytest.mark.parametrize(
    "request_, free, inventory, borrowed, want",
    [
        # it fits already: nobody is preempted
        (Request("c", 1), [g("n1", 3)], ONE, [b(1, 0, g("n1", 0))], []),
        # newest borrowing first
        (Request("c", 1), [], ONE, [b(1, 0, g("n1", 0)), b(2, 5, g("n1", 1))], [2]),
        (Request("c", 1), [], ONE, [b(2, 0, g("n1", 0)), b(1, 5, g("n1", 1))], [1]),  # by time, not id
        (Request("c", 1), [], ONE, [b(1, 0, g("n1", 0)), b(2, 0, g("n1", 1))], [2]),  # a tie: the later id
        # only as many as needed
        (Request("c", 2), [], ONE, [b(1, 0, g("n1", 0)), b(2, 5, g("n1", 1)), b(3, 9, g("n1", 2))], [2, 3]),
        (Request("c", 1), [g("n1", 3)], ONE, [b(1, 0, g("n1", 0)), b(2, 5, g("n1", 1))], []),
        (Request("c", 2), [g("n1", 3)], ONE, [b(1, 0, g("n1", 0)), b(2, 5, g("n1", 1))], [2]),
        # fewest GPUs: newest first would take 1 + 2 GPUs; the older 2-GPU one alone will do
        (Request("c", 2), [], ONE, [b(1, 0, g("n1", 0), g("n1", 1)), b(2, 5, g("n1", 2))], [1]),
        # nothing would help: None (never preempt for nothing)
        (Request("c", 3), [], ONE, [b(1, 0, g("n1", 0)), b(2, 5, g("n1", 1))], None),
        (Request("c", 1), [], ONE, [], None),
        (Request("c", 5), [], ONE, [b(1, 0, *ONE)], None),
        # node constraints: one node only; the newest is on the wrong node
        (
            Request("c", 2, max_nodes=1),
            [g("n1", 1)],
            TWO,
            [b(1, 0, g("n1", 0)), b(2, 5, g("n2", 0))],
            [1],
        ),
        # a model: borrowed A100s do not help an H100 request
        (Request("c", 1, model="H100"), [], MIXED, [b(1, 5, g("n1", 0))], None),
        (Request("c", 1, model="H100"), [], MIXED, [b(1, 5, g("n1", 0)), b(2, 0, g("n2", 1, "H100"))], [2]),
        # multi-node: 4 over two nodes needs both borrowings
        (
            Request("c", 4, max_nodes=None),
            [g("n1", 1)],
            TWO,
            [b(1, 0, g("n1", 0)), b(2, 5, g("n2", 0), g("n2", 1))],
            [1, 2],
        ),
        # 2 per node on 2 nodes: a whole node each
        (
            Request("c", 4, max_nodes=None, gpus_per_node=2),
            [],
            TWO,
            [b(1, 0, g("n1", 0), g("n1", 1)), b(2, 5, g("n2", 0), g("n2", 1))],
            [1, 2],
        ),
        # one node of 2: the newest (1 GPU on n1) is not needed once the older n2 pair is taken
        (
            Request("c", 2, max_nodes=1),
            [],
            TWO,
            [b(1, 0, g("n2", 0), g("n2", 1)), b(2, 5, g("n1", 0))],
            [1],
        ),
    ],
)
def test_victims(request_, free, inventory, borrowed, want):
    assert victims(request_, free, inventory, borrowed) == want


# the traits ----------------------------------------------------------------------------


def test_good_borrow_settings_pass():
    hub = GpuHub(
        default_borrow=2,
        group_borrow={"staff": 4},
        user_borrow={"alice": 0},
        preempt_grace_seconds=0.0,
        borrowed_hours_count=False,
    )
    assert hub.borrow_settings() == BorrowSettings(
        rules=BorrowRules(default=2, groups={"staff": 4}, users={"alice": 0}),
        grace_seconds=0.0,
        count_borrowed_hours=False,
    )
    assert GpuHub().borrow_settings() == BorrowSettings()  # no borrowing, 300 s grace, hours count


@pytest.mark.parametrize(
    "traits, named",
    [
        ({"default_borrow": -1}, "c.GpuHub.default_borrow"),
        ({"default_borrow": True}, "c.GpuHub.default_borrow"),
        ({"group_borrow": {"staff": -2}}, "c.GpuHub.group_borrow['staff']"),
        ({"group_borrow": {"staff": 1.5}}, "c.GpuHub.group_borrow['staff']"),
        ({"group_borrow": {"staff": 2.0}}, "c.GpuHub.group_borrow['staff']"),
        ({"group_borrow": {"staff": False}}, "c.GpuHub.group_borrow['staff']"),
        ({"user_borrow": {"alice": "2"}}, "c.GpuHub.user_borrow['alice']"),
        ({"user_borrow": {"alice": float("nan")}}, "c.GpuHub.user_borrow['alice']"),
        ({"preempt_grace_seconds": -1.0}, "c.GpuHub.preempt_grace_seconds"),
        ({"preempt_grace_seconds": float("nan")}, "c.GpuHub.preempt_grace_seconds"),
        ({"preempt_grace_seconds": float("inf")}, "c.GpuHub.preempt_grace_seconds"),
        ({"preempt_grace_seconds": float("-inf")}, "c.GpuHub.preempt_grace_seconds"),
    ],
)
def test_bad_borrow_settings_are_refused_with_the_trait_named(traits, named):
    hub = GpuHub(**traits)
    with pytest.raises(ValueError) as err:
        hub.borrow_settings()
    assert named in str(err.value)


def test_a_float_default_borrow_is_refused_by_the_trait_itself():
    from traitlets import TraitError

    with pytest.raises(TraitError, match="default_borrow"):
        GpuHub(default_borrow=1.5)


def test_open_ledger_refuses_bad_borrow_settings(tmp_path):
    hub = GpuHub(db_url=f"sqlite:///{tmp_path / 'x.sqlite'}", default_borrow=-1)
    with pytest.raises(ValueError, match=r"c\.GpuHub\.default_borrow"):
        hub.open_ledger()


# the ledger ----------------------------------------------------------------------------

INV = [Gpu("n1", i, "A100") for i in range(4)]
RULES = LimitRules(default=Limit(max_gpus=2))
GRACE = 300.0


@pytest.fixture
def clock():
    return Clock(T)


@pytest.fixture
def url(db_url):
    return db_url


@pytest.fixture
def open_ledger(url, clock):
    opened = []

    def make(limits=RULES, keepalive_seconds=3600, **borrow):
        settings = {"rules": BorrowRules(default=2), "grace_seconds": GRACE} | borrow
        led = Ledger(
            url,
            config_rules=limits,
            clock=clock,
            queue=QueueSettings(keepalive_seconds=keepalive_seconds),
            borrow=BorrowSettings(**settings),
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


def rows(url, table):
    engine = create_engine(url)
    with engine.connect() as conn:
        got = conn.execute(text(f"SELECT * FROM {table} ORDER BY id")).all()
    engine.dispose()
    return got


def held(led, user):
    return sum(len(a.gpus) for a in led.active(user=user))


def test_a_user_at_their_limit_borrows_free_gpus_while_nobody_waits(led, clock):
    mine = led.allocate("alice", [], 2)
    assert mine.borrowed == 0
    more = led.request("alice", [], 1, server_name="more")  # request(): the same, never queued
    assert more.entry is None
    assert (more.allocation.borrowed, len(more.allocation.gpus), more.allocation.gpu_count) == (1, 1, 1)
    assert led.get(more.allocation.id).borrowed == 1
    assert rows(led.url, "queue_entries") == []
    led.release(more.allocation.id)
    led.release(mine.id)
    # partly in the limit: bob holds 1 of 2 and asks for 3 (1 in the limit, 2 borrowed)
    led.allocate("bob", [], 1)
    bobs = led.allocate("bob", [], 3, server_name="more")
    assert (bobs.borrowed, len(bobs.gpus)) == (2, 3)
    assert [a.borrowed for a in led.active(user="bob")] == [0, 2]


def test_borrowing_is_bounded_by_limit_plus_allowance(led, clock):
    led.allocate("alice", [], 1)
    got = led.allocate("alice", [], 3, server_name="more")  # 1 + 3 = limit 2 + allowance 2
    assert got.borrowed == 2
    assert held(led, "alice") == 4
    assert led.get(got.id).borrowed == 2
    led.release(got.id)
    with pytest.raises(Refusal) as err:
        led.allocate("alice", [], 4, server_name="too many")  # 1 + 4 > 2 + 2
    assert (err.value.reason, err.value.status_code, err.value.fits) == ("over_limit", 403, 3)
    assert err.value.message == (
        "You asked for 4 GPUs, but you hold 1 of a limit of 2 (default) and may borrow at most "
        "2 beyond it (default): ask for 3 or fewer."
    )
    with pytest.raises(Refusal) as err:  # request() refuses it too, without queueing
        led.request("alice", [], 4, server_name="too many")
    assert err.value.reason == "over_limit" and "may borrow at most 2 beyond it" in err.value.message
    assert rows(led.url, "queue_entries") == []


def test_borrowed_gpus_do_not_count_against_the_limit(led, clock):
    """Borrowed GPUs have their own allowance: a user who gave back their in-limit GPUs and
    kept the borrowed ones may still take their limit within it (not borrowed, never preempted)."""
    first = led.allocate("alice", [], 2)
    extra = led.allocate("alice", [], 2, server_name="more")  # beyond the limit: borrowed
    assert extra.borrowed == 2
    led.release(first.id)
    again = led.allocate("alice", [], 2, server_name="again")  # within the limit again
    assert again.borrowed == 0 and held(led, "alice") == 4
    with pytest.raises(Refusal) as err:  # and nothing more: limit and allowance are both used
        led.allocate("alice", [], 1, server_name="one more")
    assert err.value.reason == "over_limit" and "you hold 2 and 2 borrowed" in err.value.message


def test_the_allowance_comes_from_the_user_and_group_entries(open_ledger, clock):
    led = open_ledger(rules=BorrowRules(default=0, groups={"staff": 1}, users={"carol": 2}))
    led.allocate("alice", [], 2)
    with pytest.raises(Refusal) as err:  # no allowance: the plain limit refusal
        led.allocate("alice", [], 1, server_name="more")
    assert err.value.reason == "over_limit" and "borrow" not in err.value.message
    led.release(led.active(user="alice")[0].id)
    with pytest.raises(Refusal) as err:
        led.allocate("bob", ["staff"], 4)
    assert "may borrow at most 1 beyond it (group staff): ask for 3 or fewer" in err.value.message
    assert led.allocate("bob", ["staff"], 3).borrowed == 1
    led.release(led.active(user="bob")[0].id)
    assert led.allocate("carol", ["staff"], 4).borrowed == 2


def test_the_allowance_on_the_spawn_form(led, clock):
    led.allocate("alice", [], 2)
    facts = led.allowance("alice")
    assert (facts.may_take, facts.borrow_allowance, facts.borrowed, facts.may_borrow_now) == (0, 2, 0, 2)
    led.allocate("alice", [], 1, server_name="more")
    facts = led.allowance("alice")
    assert (facts.borrowed, facts.may_borrow_now, facts.waiting) == (1, 1, 0)
    led.allocate("bob", [], 1)
    led.request("carol", [], 1)  # waits: nothing is lent while it does
    facts = led.allowance("alice")
    assert (facts.waiting, facts.may_borrow_now) == (1, 0)


def test_a_limit_of_0_lends_nothing_even_with_an_allowance(open_ledger, clock):
    """An admin who sets 0 means none: bob's spawn and carol's burst are refused, not borrowed."""
    limits = LimitRules(default=Limit(max_gpus=2), groups={"students": Limit(max_gpus=0)})
    led = open_ledger(limits=limits, rules=BorrowRules(default=2, groups={"students": 2}))
    for user, purpose, lease in [("bob", "server", None), ("carol", "distributed", 600)]:
        with pytest.raises(Refusal) as err:
            led.allocate(user, ["students"], 1, purpose=purpose, lease_seconds=lease)
        assert (
            err.value.reason == "over_limit"
            and "Ask an admin of this hub to raise your limit" in err.value.message
        )
        with pytest.raises(Refusal):  # nor does it wait in the queue
            led.request(user, ["students"], 1, purpose=purpose, lease_seconds=lease)
        facts = led.allowance(user, ["students"])  # the spawn form offers no borrowing
        assert (facts.may_take, facts.borrow_allowance, facts.may_borrow_now) == (0, 0, 0)
        assert led.active(user=user) == []
    assert rows(led.url, "queue_entries") == []
    assert led.allocate("alice", [], 3).borrowed == 1  # a limit above 0 still borrows


def test_borrowing_is_refused_while_someone_waits_and_never_queued(led, clock):
    led.allocate("alice", [], 2)
    led.allocate("bob", [], 1)
    carol = led.request("carol", [], 2)  # 1 free: carol waits
    assert carol.entry is not None
    before = rows(led.url, "queue_entries")
    for ask in (led.request, led.allocate):
        with pytest.raises(Refusal) as err:
            ask("alice", [], 1, server_name="more")
        assert (err.value.reason, err.value.status_code, err.value.fits) == ("no_borrowing", 409, 0)
        assert "lent beyond a limit only while nobody waits for them, and 1 request waits now" in (
            err.value.message
        )
    with pytest.raises(Refusal) as err:  # partly in the limit: bob may wait for 1
        led.request("bob", [], 2, server_name="more")
    assert (err.value.reason, err.value.fits) == ("no_borrowing", 1)
    assert "Ask for 1 or fewer to wait in the queue within your limit." in err.value.message
    assert rows(led.url, "queue_entries") == before
    assert (held(led, "alice"), held(led, "bob")) == (2, 1)
    led.leave_queue(carol.entry.id)
    assert led.allocate("alice", [], 1, server_name="more").borrowed == 1  # nobody waits now


def test_a_waiter_past_its_keepalive_does_not_stop_borrowing(open_ledger, clock):
    led = open_ledger(keepalive_seconds=30)
    led.allocate("alice", [], 2)
    led.allocate("bob", [], 1)
    led.request("carol", [], 2)
    clock.advance(seconds=31)  # carol's waiter is gone
    assert led.allocate("alice", [], 1, server_name="more").borrowed == 1


@pytest.mark.parametrize(
    "borrowed, count, free, within, message",
    [
        (1, 4, 0, 3, "1 of the 4 GPUs you asked for is beyond your limit, and only GPUs free now are lent: "
         "none is free. Ask for 3 or fewer to wait in the queue within your limit."),
        (2, 2, 1, 0, "All 2 GPUs you asked for are beyond your limit, and only GPUs free now are lent: "
         "1 is free. Ask for 1 or fewer to start now."),
        (2, 3, 2, 1, "2 of the 3 GPUs you asked for are beyond your limit, and only GPUs free now are lent: "
         "2 are free. Ask for 2 or fewer to start now, or ask for 1 or fewer to wait in the queue within "
         "your limit."),
        (1, 1, 0, 0, "The GPU you asked for is beyond your limit, and only GPUs free now are lent: "
         "none is free. Try again when GPUs are free, or ask an admin to raise your limit."),
    ],
)  # fmt: skip
def test_a_borrowing_refusal_never_asks_for_nothing(borrowed, count, free, within, message):
    from spawner.ledger.borrowing import borrow_not_free_message

    assert borrow_not_free_message(borrowed, count, free, within) == message


def test_borrowing_is_refused_when_nothing_is_free_and_never_queued(led, clock):
    led.allocate("alice", [], 2)
    led.allocate("bob", [], 2)
    with pytest.raises(Refusal) as err:
        led.request("alice", [], 1, server_name="more")
    assert (err.value.reason, err.value.fits) == ("no_borrowing", 0)
    assert "only GPUs free now are lent: none is free" in err.value.message
    assert "or fewer" not in err.value.message.replace("to wait in the queue", "")  # never "ask for 0"
    led.release(led.active(user="bob")[0].id)
    led.allocate("bob", [], 1)
    with pytest.raises(Refusal) as err:  # 1 free, 2 asked beyond the limit
        led.request("alice", [], 2, server_name="more")
    assert (err.value.reason, err.value.fits) == ("no_borrowing", 1)
    assert "1 is free. Ask for 1 or fewer" in err.value.message
    assert rows(led.url, "queue_entries") == []


# preemption ----------------------------------------------------------------------------


def setup(led, clock, steps):
    """Run ``steps``: ``(user, count)`` allocations one minute apart (a count beyond the user's
    limit borrows), ``("wait", user, count)`` queued requests. Returns what each made."""
    made = []
    for k, step in enumerate(steps):
        clock.advance(minutes=1)
        if step[0] == "wait":
            got = led.request(step[1], [], step[2], server_name=f"s{k}")
            assert got.entry is not None, step
            made.append(got.entry)
        else:
            made.append(led.allocate(step[0], [], step[1], server_name=f"s{k}"))
    return made


@pytest.mark.parametrize(
    "steps, preempted",
    [
        # in-limit holders only: nothing is preempted, though carol (and dave) wait
        ([("alice", 2), ("bob", 2), ("wait", "carol", 1)], []),
        ([("alice", 2), ("bob", 2), ("wait", "carol", 2), ("wait", "dave", 1)], []),
        ([("alice", 1), ("bob", 2), ("carol", 1), ("wait", "dave", 1)], []),
        # one borrowed allocation between carol and her GPU
        ([("alice", 2), ("alice", 1), ("bob", 1), ("wait", "carol", 1)], [1]),
        # newest first: alice's second borrowing, not her first
        ([("alice", 2), ("alice", 1), ("alice", 1), ("wait", "carol", 1)], [2]),
        # only as many as the head needs
        ([("alice", 2), ("alice", 1), ("alice", 1), ("wait", "carol", 2)], [1, 2]),
        # what is free and what is borrowed together: 1 free + the newest borrowing
        ([("alice", 2), ("alice", 1), ("wait", "carol", 2)], [1]),
        # nothing would help: carol needs 2, 1 is borrowed, the rest held in limits
        ([("alice", 2), ("bob", 1), ("alice", 1), ("wait", "carol", 2)], []),
        # nobody waits: nothing is taken back
        ([("alice", 2), ("alice", 2)], []),
    ],
)
def test_preempt_for_queue_takes_back_only_borrowed_gpus(led, clock, steps, preempted):
    made = setup(led, clock, steps)
    got = led.preempt_for_queue()
    assert sorted(p.allocation_id for p in got) == sorted(made[k].id for k in preempted)
    for p in got:
        a = led.get(p.allocation_id)
        assert a.borrowed > 0 and a.active and a.preempt_due == clock() + timedelta(seconds=GRACE)
    for a in led.active():  # in-limit allocations are never given notice
        if a.borrowed == 0:
            assert a.preempt_due is None
    assert led.preempt_for_queue() == []  # what is already being taken back will do
    assert len(led.preemptions()) == len(preempted)


def test_preempt_takes_the_fewest_gpus_that_will_do(open_ledger, clock):
    """Newest first would take alice's 1 GPU and then bob's 2 for carol's 2; bob's older
    2-GPU borrowing alone will do."""
    limits = LimitRules(default=Limit(max_gpus=1), users={"carol": Limit(max_gpus=2)})
    led = open_ledger(limits=limits)
    clock.advance(minutes=1)
    first = led.allocate("bob", [], 1)  # in his limit, given back below: bob keeps 2 borrowed
    older = led.allocate("bob", [], 2, server_name="more")  # all borrowed
    led.release(first.id)
    clock.advance(minutes=1)
    led.allocate("alice", [], 1)  # in her limit
    clock.advance(minutes=1)
    newer = led.allocate("alice", [], 1, server_name="more")  # borrowed
    assert (older.borrowed, newer.borrowed) == (2, 1)
    clock.advance(minutes=1)
    assert led.request("carol", [], 2).entry is not None
    assert [p.allocation_id for p in led.preempt_for_queue()] == [older.id]


def test_nothing_is_preempted_for_the_waiters_own_borrowed_gpus(led, clock):
    led.allocate("alice", [], 2)
    borrowed = led.allocate("alice", [], 2, server_name="more")
    assert borrowed.borrowed == 2
    led.set_limit("user", "alice", Limit(max_gpus=6))  # an admin raises alice's limit
    mine = led.request("alice", [], 1, server_name="third")
    assert mine.entry is not None  # in her limit now; waits
    assert led.preempt_for_queue() == []  # only her own borrowed GPUs stand in the way
    led.leave_queue(mine.entry.id)
    led.request("carol", [], 1)
    [p] = led.preempt_for_queue()  # for someone else they are taken back
    assert (p.allocation_id, p.for_user) == (borrowed.id, "carol")


def test_a_preemption_before_and_after_it_is_due(led, clock):
    led.allocate("alice", [], 2)
    clock.advance(minutes=1)
    burst = led.allocate("alice", [], 2, purpose="distributed", server_name="nb", lease_seconds=600)
    assert burst.borrowed == 2 and burst.preempt_due is None
    assert allocation_json(burst)["preemption"] is None and allocation_json(burst)["borrowed"] == 2
    clock.advance(minutes=1)
    carol = led.request("carol", [], 2).entry
    [p] = led.preempt_for_queue()
    due = clock() + timedelta(seconds=GRACE)
    assert (p.allocation_id, p.user, p.for_user, p.entry_id, p.gpus, p.borrowed, p.due) == (
        burst.id,
        "alice",
        "carol",
        carol.id,
        2,
        2,
        due,
    )
    assert p.reason == (
        "preempted: 2 borrowed GPUs taken back for another user's request within its limit "
        "(2 GPUs, waiting since 09:02 UTC)"
    )
    assert led.due_preemptions() == []
    # before it is due: the kernel saves and renews; the allocation says when it ends
    clock.advance(seconds=GRACE - 1)
    renewed = led.renew(burst.id, 600)
    assert renewed.lease_expires == clock() + timedelta(seconds=600)
    assert (renewed.preempt_due, renewed.preempt_reason) == (due, p.reason)
    assert allocation_json(renewed)["preemption"] == {"due": due.isoformat() + "Z", "reason": p.reason}
    assert led.wait_turn(carol.id).allocation is None  # carol still waits
    # due: renewals are refused, the broker sees it due, a release ends it with the reason
    clock.advance(seconds=1)
    assert [(q.allocation_id, server) for q, server in led.due_preemptions()] == [(burst.id, False)]
    with pytest.raises(LookupError, match=f"allocation {burst.id} was preempted: 2 borrowed GPU"):
        led.renew(burst.id, 600)
    assert led.release(burst.id, "engines stopped") is True
    ended = led.get(burst.id)
    assert (ended.state, ended.end_reason) == ("released", p.reason)
    assert led.due_preemptions() == []
    got = led.wait_turn(carol.id).allocation
    assert got is not None and set(got.gpus) == set(burst.gpus) and got.borrowed == 0


def test_a_release_before_it_is_due_is_a_give_back(led, clock):
    led.allocate("alice", [], 2)
    burst = led.allocate("alice", [], 1, purpose="distributed", lease_seconds=600)
    led.allocate("bob", [], 1)
    carol = led.request("carol", [], 1).entry
    led.preempt_for_queue()
    clock.advance(seconds=10)
    assert led.release(burst.id, "given back") is True  # the owner gives it back early
    reason = led.get(burst.id).end_reason  # the notice's, saying it came back early
    assert reason.startswith("preempted: 1 borrowed GPU taken back") and reason.endswith(
        "; given back before it was due (given back)"
    )
    assert led.wait_turn(carol.id).allocation.gpus == burst.gpus


def test_a_due_server_is_stopped_by_the_broker_and_ends_with_the_reason(led, clock):
    led.allocate("alice", [], 2, purpose="distributed", lease_seconds=3600)
    server = led.allocate("alice", [], 1, server_name="gpu")
    led.mark_running(server.id)
    led.allocate("bob", [], 1)
    carol = led.request("carol", [], 1).entry
    [p] = led.preempt_for_queue()
    clock.advance(seconds=GRACE)
    assert [(q.allocation_id, is_server) for q, is_server in led.due_preemptions()] == [(server.id, True)]
    led.release(server.id, "server stopped")
    assert led.get(server.id).end_reason == p.reason
    assert led.wait_turn(carol.id).allocation.gpus == server.gpus


def test_a_due_lease_expires_with_the_preemptions_reason(led, clock):
    led.allocate("alice", [], 2)
    burst = led.allocate("alice", [], 2, purpose="distributed", lease_seconds=GRACE + 60)
    carol = led.request("carol", [], 1).entry
    [p] = led.preempt_for_queue()
    clock.advance(seconds=GRACE + 60)  # nobody renewed or released it: the lease runs out
    assert led.expire_leases() == [burst.id]
    ended = led.get(burst.id)
    assert (ended.end_reason, ended.ended) == (p.reason, burst.lease_expires)
    assert led.wait_turn(carol.id).allocation is not None


def test_a_lease_that_runs_out_before_the_preemption_is_due_just_expires(led, clock):
    led.allocate("alice", [], 2)
    burst = led.allocate("alice", [], 2, purpose="distributed", lease_seconds=60)
    led.request("carol", [], 1)
    led.preempt_for_queue()
    clock.advance(seconds=60)
    assert led.expire_leases() == [burst.id]
    assert led.get(burst.id).end_reason == "lease expired"


def test_preemptions_and_borrowed_hours(led, clock):
    led.allocate("alice", [], 2)
    first = led.allocate("alice", [], 2, server_name="more")
    led.mark_running(first.id)
    clock.advance(hours=1)
    led.request("bob", [], 1)
    [p] = led.preempt_for_queue()
    clock.advance(seconds=GRACE)
    led.release(first.id)
    assert led.borrowed_hours(T) == pytest.approx({"alice": 2 * (1 + GRACE / 3600)})
    assert led.borrowed_hours(T, T + timedelta(minutes=30)) == pytest.approx({"alice": 1.0})
    assert led.borrowed_hours(clock()) == {}
    assert [q.id for q in led.preemptions()] == [p.id]
    assert [q.id for q in led.preemptions(user="alice")] == [p.id]
    assert led.preemptions(user="bob") == []
    assert led.preemptions(since=clock()) == []


@pytest.mark.parametrize("count_borrowed, used", [(True, 4.0), (False, 2.0)])
def test_borrowed_hours_in_a_gpu_hours_budget_unless_switched_off(open_ledger, clock, count_borrowed, used):
    rules = LimitRules(default=Limit(max_gpus=2, gpu_hours=3.5, window_hours=24))
    led = open_ledger(limits=rules, count_borrowed_hours=count_borrowed)
    a = led.allocate("alice", [], 2)
    b = led.allocate("alice", [], 2, server_name="more")
    for x in (a, b):
        led.mark_running(x.id)
    clock.advance(hours=1)
    for x in (a, b):
        led.release(x.id)
    facts = led.allowance("alice")
    assert facts.gpu_hours == pytest.approx(used)
    if count_borrowed:  # 4 of 3.5 used: nothing more
        with pytest.raises(Refusal) as err:
            led.allocate("alice", [], 1)
        assert err.value.reason == "quota_exhausted"
    else:
        assert led.allocate("alice", [], 1).borrowed == 0


def test_borrowing_and_preemptions_survive_a_hub_restart(open_ledger, url, clock):
    led = open_ledger()
    led.allocate("alice", [], 2)
    borrowed = led.allocate("alice", [], 2, purpose="distributed", lease_seconds=3600)
    carol = led.request("carol", [], 1).entry
    [p] = led.preempt_for_queue()
    led.close()
    clock.advance(seconds=10)
    again = open_ledger()  # the hub restarted
    a = again.get(borrowed.id)
    assert (a.borrowed, a.preempt_due, a.preempt_reason) == (2, p.due, p.reason)
    assert [(q.id, q.due, q.reason) for q in again.preemptions()] == [(p.id, p.due, p.reason)]
    assert again.preempt_for_queue() == []  # not given notice twice
    assert again.allowance("alice").borrowed == 2
    clock.advance(seconds=GRACE)
    assert [q.allocation_id for q, _ in again.due_preemptions()] == [borrowed.id]
    with pytest.raises(LookupError, match="was preempted"):
        again.renew(borrowed.id, 60)
    again.release(borrowed.id)
    assert again.get(borrowed.id).end_reason == p.reason
    assert again.wait_turn(carol.id).allocation is not None


# withdrawn notices, the due pass, backfill (issue 27) ---------------------------------------


@pytest.mark.parametrize(
    "state, want",
    [
        ("waiting", None),
        ("granted", "withdrawn: the request it was for was served by other GPUs"),
        ("left", "withdrawn: the request it was for no longer waits (it left the queue)"),
        (None, "withdrawn: the request it was for no longer waits (it left the queue)"),  # gone
    ],
)
def test_withdrawal(state, want):
    assert withdrawal(state) == want


@pytest.mark.parametrize(
    "borrowed, gpus, backfill, want",
    [
        (
            2,
            3,
            False,
            "preempted: 2 borrowed GPUs taken back for another user's request within its limit "
            "(1 GPU, waiting since 09:00 UTC)",
        ),
        (
            0,
            3,
            True,
            "preempted: 3 GPUs that started ahead of a waiting request (backfill) taken back at its "
            "turn (1 GPU, waiting since 09:00 UTC)",
        ),
    ],
)
def test_notice_reason(borrowed, gpus, backfill, want):
    assert notice_reason(borrowed, gpus, backfill, 1, T) == want


@pytest.mark.parametrize(
    "text, ids", [(None, frozenset()), ("", frozenset()), ("3", {3}), ("3,12", {3, 12}), ("x,4", {4})]
)
def test_backfill_ids(text, ids):
    assert backfill_ids(text) == ids
    assert backfill_ids(backfill_text(ids)) == ids


def lent_burst(led, clock):
    """alice: 2 within her limit, a borrowed burst of 1; bob 1: nothing is free."""
    led.allocate("alice", [], 2)
    clock.advance(minutes=1)
    burst = led.allocate("alice", [], 1, purpose="distributed", server_name="nb", lease_seconds=3600)
    assert burst.borrowed == 1
    bobs = led.allocate("bob", [], 1)
    return burst, bobs


@pytest.mark.parametrize("how", ["left", "cancelled", "quiet", "served"])
def test_a_notice_is_withdrawn_once_its_request_no_longer_waits(open_ledger, clock, how):
    led = open_ledger(keepalive_seconds=60)
    burst, bobs = lent_burst(led, clock)
    carol = led.request("carol", [], 1).entry
    [p] = led.preempt_for_queue()
    assert (p.allocation_id, p.entry_id) == (burst.id, carol.id)
    clock.advance(seconds=30)
    if how == "left":
        assert led.leave_queue(carol.id)
    elif how == "cancelled":
        assert led.leave_queue(carol.id, "cancelled by admin admin")
    elif how == "quiet":
        clock.advance(seconds=31)  # nobody asked about it for the keepalive
    else:  # bob gives his GPU back: carol's turn comes on it, not on the borrowed one
        led.release(bobs.id)
        assert led.wait_turn(carol.id).allocation.gpus == bobs.gpus
    settled = led.settle_preemptions()
    [w] = settled.withdrawn
    assert (w.id, w.withdrawn, settled.ended, settled.servers) == (p.id, clock(), [], [])
    assert w.withdrawn_reason == withdrawal("granted" if how == "served" else "left")
    a = led.get(burst.id)
    assert (a.active, a.preempt_due, a.preempt_reason) == (True, None, None)
    assert (a.withdrawn, a.withdrawn_reason) == (clock(), w.withdrawn_reason)
    assert allocation_json(a)["preemption_withdrawn"] == {
        "at": clock().isoformat() + "Z",
        "reason": w.withdrawn_reason,
    }
    [n] = led.preemption_notices("alice")  # the owner is told
    assert n.withdrawn and not n.pending
    # past the due time nothing is taken: no due pass, renewals go on
    clock.advance(seconds=GRACE)
    assert led.due_preemptions() == []
    assert led.settle_preemptions().ended == []
    assert led.renew(burst.id, 600).active
    assert led.borrowing_totals(T)["alice"]["preemptions"] == 0  # nothing was taken back
    assert led.settle_preemptions().withdrawn == []  # told once


def test_a_renewal_past_the_due_time_withdraws_a_notice_nobody_waits_for(led, clock):
    """Without the broker's pass in between: the renewal itself asks whether the request waits."""
    burst, _ = lent_burst(led, clock)
    carol = led.request("carol", [], 1).entry
    assert len(led.preempt_for_queue()) == 1
    led.leave_queue(carol.id)
    clock.advance(seconds=GRACE)
    renewed = led.renew(burst.id, 600)
    assert renewed.preempt_due is None and renewed.withdrawn == clock()
    assert [q.withdrawn for q in led.preemptions()] == [clock()]


def test_a_withdrawn_notice_is_given_again_for_another_request(led, clock):
    burst, _ = lent_burst(led, clock)
    carol = led.request("carol", [], 1).entry
    [p] = led.preempt_for_queue()
    led.leave_queue(carol.id)
    led.settle_preemptions()
    clock.advance(minutes=1)
    dave = led.request("dave", [], 1).entry
    [again] = led.preempt_for_queue()
    assert (again.id, again.entry_id, again.for_user, again.created) == (p.id, dave.id, "dave", clock())
    assert (again.withdrawn, again.due) == (None, clock() + timedelta(seconds=GRACE))
    assert led.get(burst.id).preempt_due == again.due


def test_the_due_pass_ends_a_burst_whatever_its_lease_and_names_a_server(led, clock):
    led.allocate("alice", [], 2)
    burst = led.allocate("alice", [], 1, purpose="distributed", server_name="nb", lease_seconds=3600)
    server = led.allocate("alice", [], 1, server_name="big")  # borrowed too
    assert (burst.borrowed, server.borrowed) == (1, 1)
    carol = led.request("carol", [], 2).entry
    made = sorted(led.preempt_for_queue(), key=lambda p: p.allocation_id)
    assert [p.allocation_id for p in made] == [burst.id, server.id]
    clock.advance(seconds=GRACE - 1)
    assert led.settle_preemptions().ended == []  # not due yet
    clock.advance(seconds=1)
    settled = led.settle_preemptions()
    assert [p.allocation_id for p in settled.ended] == [burst.id]
    assert [p.allocation_id for p in settled.servers] == [server.id]
    ended = led.get(burst.id)
    assert (ended.state, ended.end_reason, ended.ended) == ("released", made[0].reason, clock())
    assert ended.lease_expires > clock()  # its lease did not end it
    with pytest.raises(LookupError):
        led.renew(burst.id, 600)
    assert led.wait_turn(carol.id).allocation is None  # the server's GPU is not free yet
    led.release(server.id, "server stopped")  # the broker stopped it
    assert set(led.wait_turn(carol.id).allocation.gpus) == set(burst.gpus) | set(server.gpus)


def test_instant_cycles_do_not_make_a_users_runs_look_short(led, clock):
    """The attack of issue 27, item 5, in the ledger: 20 allocations given back at once."""
    for _ in range(20):
        led.release(led.allocate("dave", [], 1, purpose="distributed", lease_seconds=60).id)
    led.allocate("alice", [], 1)
    clock.advance(minutes=1)
    led.allocate("carol", [], 2)
    bob = led.request("bob", [], 2).entry  # alice's GPU and the free one, at alice's expected end
    led.move_to_front(bob.id)
    with pytest.raises(Refusal) as err:
        led.allocate("dave", [], 1)
    assert err.value.reason == "no_capacity"
    assert led.active(user="dave") == [] and led.queue_entry(bob.id).position == 1


def test_an_allocation_that_starts_ahead_of_a_reservation_is_taken_back_for_it(led, clock):
    for _ in range(3):  # erin's runs really are 10 minutes
        a = led.allocate("erin", [], 1, purpose="distributed", lease_seconds=3600)
        clock.advance(minutes=10)
        led.release(a.id)
    alice = led.allocate("alice", [], 1)
    clock.advance(minutes=1)
    led.allocate("carol", [], 2)
    bob = led.request("bob", [], 2).entry
    dave = led.request("dave", [], 1).entry  # behind bob, 2 h expected: waits
    erin = led.allocate("erin", [], 1, purpose="distributed", lease_seconds=3600)
    assert erin.backfill and not erin.borrowed
    assert led.preempt_for_queue() == []  # bob's turn has not come: nothing stands in its way
    led.release(alice.id)  # now it has, but for erin's GPU
    [p] = led.preempt_for_queue()
    assert (p.allocation_id, p.entry_id, p.borrowed, p.gpus) == (erin.id, bob.id, 0, 1)
    assert p.reason == notice_reason(0, 1, True, 2, bob.created)
    clock.advance(seconds=GRACE)
    assert [q.allocation_id for q in led.settle_preemptions().ended] == [erin.id]
    got = led.wait_turn(bob.id).allocation
    assert set(got.gpus) == set(alice.gpus) | set(erin.gpus)
    assert led.queue_entry(dave.id).state == "waiting"


def test_a_backfilled_allocation_is_ordinary_once_its_reservations_start(led, clock):
    for _ in range(3):
        a = led.allocate("erin", [], 1, purpose="distributed", lease_seconds=3600)
        clock.advance(minutes=10)
        led.release(a.id)
    alice = led.allocate("alice", [], 2)
    led.allocate("carol", [], 1)
    bob = led.request("bob", [], 2).entry  # 1 free: bob waits for alice's GPUs
    erin = led.allocate("erin", [], 1, purpose="distributed", lease_seconds=3600)
    assert led.get(erin.id).backfill
    led.release(alice.id)
    assert led.wait_turn(bob.id).allocation is not None  # bob starts on alice's GPUs
    led.settle_preemptions()
    assert not led.get(erin.id).backfill  # nobody it went ahead of waits
    dave = led.request("dave", [], 1).entry  # every GPU is taken: dave waits
    assert dave is not None
    assert led.preempt_for_queue() == []  # erin's is not taken back for dave


def test_a_give_back_after_the_request_left_is_not_called_a_preemption(led, clock):
    """Before the broker's pass has withdrawn the notice: the release reads the request too."""
    burst, _ = lent_burst(led, clock)
    carol = led.request("carol", [], 1).entry
    assert len(led.preempt_for_queue()) == 1
    led.leave_queue(carol.id)
    assert led.release(burst.id, "released through the API by owner")
    assert led.get(burst.id).end_reason == "released through the API by owner"


@pytest.mark.parametrize("ended_by", ["user", "reclaim", "preemption"])
def test_only_runs_their_user_ended_make_a_run_length(led, clock, ended_by):
    """erin's three 10-minute runs let her start ahead of bob; not when gpuhub ended them."""
    if ended_by == "preemption":
        led.set_limit("user", "erin", Limit(max_gpus=1))  # what she takes beyond 1 is borrowed
    for _ in range(3):
        clock.advance(minutes=1)
        if ended_by == "preemption":  # borrowed while nobody waits, taken back for dave's wait
            led.allocate("alice", [], 2)
            a = led.allocate("erin", [], 2, purpose="distributed", lease_seconds=3600)
            assert a.borrowed == 1
            d = led.request("dave", [], 1).entry
            assert [p.allocation_id for p in led.preempt_for_queue()] == [a.id]
        else:
            a = led.allocate("erin", [], 1, purpose="distributed", lease_seconds=3600)
        if ended_by == "reclaim":
            assert led.record_reclaim(a.id, 600, "idle") is not None
        clock.advance(minutes=10)
        led.release(a.id)
        if ended_by == "preemption":
            led.leave_queue(d.id)
            for other in led.active(user="alice"):
                led.release(other.id)
    led.unset_limit("user", "erin")
    led.allocate("alice", [], 1)
    clock.advance(minutes=1)
    led.allocate("carol", [], 2)
    bob = led.request("bob", [], 2).entry  # from alice's expected end (2 h), on the free GPU too
    assert bob is not None
    if ended_by == "user":
        assert led.allocate("erin", [], 1, purpose="distributed", lease_seconds=60).backfill
    else:
        with pytest.raises(Refusal) as err:
            led.allocate("erin", [], 1, purpose="distributed", lease_seconds=60)
        assert err.value.reason == "no_capacity"
