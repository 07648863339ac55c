"""Games with the queue and its notices, played as a second real user (issue 27, items 5-8).

A real hub, proxy and broker on the demo's 4 simulated GPUs; every actor calls the broker's
REST API with a token of their own (every answer validated against openapi.yaml). A limit of 2
for everyone, a borrowing allowance of 2, notices due 4 s after they are given, the broker's
pass every second. Each test is an attack that worked on the main branch before the fix, then
what must hold: it is refused and the victim's work is unchanged.

- dave's instant allocate/release cycles do not make his runs look short: he cannot backfill
  ahead of the head an admin moved to the front (409, the head's place and expected start
  unchanged);
- an allocation that does start ahead of a reservation (a user whose runs really are short) is
  taken back for that reservation at its turn, with notice, and the head starts;
- bob queues, the borrower carol is given notice, bob leaves: the notice is withdrawn and carol
  told (GET me, GET allocations/{id}, her kernel's lease keeper), and nothing of hers is taken
  at the due time;
- a preempted burst ends at its due time, whatever its lease: the waiter gets its GPUs, the
  kernel's lease keeper learns it is gone;
- the preempted user is not told whose request it was (``for_user``: admins only).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

import spawner.broker
from gpu_magics.kernel.broker import BrokerClient, LeaseKeeper
from spawner.ledger import Ledger, utcnow

from .hubtools import Hub, tidy_ledger, user_tokens, wait_for
from .ledgertools import Clock

pytestmark = pytest.mark.hub

SPEC = OpenAPI.from_file_path(str(Path(spawner.broker.__file__).with_name("openapi.yaml")))

GRACE = 4
CONFIG = f"""
c.GpuHub.default_limit = 2
c.GpuHub.group_limits = {{}}
c.GpuHub.user_limits = {{}}
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = {GRACE}
c.GpuHub.queue_keepalive_seconds = 600
c.GpuBroker.sweep_seconds = 1
"""


def checked(r):
    SPEC.validate_response(RequestsOpenAPIRequest(r.request), RequestsOpenAPIResponse(r))
    return r


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("games"), extra_config=CONFIG).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return user_tokens(hub, ("alice", "bob", "carol", "dave", "erin", "admin"))


@pytest.fixture
def ledger(hub):
    """The hub's ledger; after each test nothing waits and no burst or server is held."""
    yield from tidy_ledger(hub, stop_servers=True)


def burst(hub, token, gpus, **extra):
    return checked(
        hub.broker("POST", "allocations", token, json={"gpus": gpus, "lease_seconds": 600, **extra})
    )


def held(hub, token, gpus):
    r = burst(hub, token, gpus)
    assert r.status_code == 201, r.text
    return r.json()


def queued(hub, token, gpus):
    r = burst(hub, token, gpus, wait=True)
    assert r.status_code == 202, r.text
    return r.json()["queued"]


def entry(hub, token, entry_id):
    return checked(hub.broker("GET", f"queue/{entry_id}", token)).json()


def keeper(hub, token, allocation, seen):
    """The kernel's own channel: the lease keeper a %%distributed pool runs for its burst,
    looking for notices every half second; what it is told goes into ``seen``."""
    client = BrokerClient(hub.broker_url + "/api/v1/", token)
    return LeaseKeeper(client, allocation, 600, check_seconds=0.5, on_notice=seen.append)


def notice_for(ledger, user, entry_id):
    return wait_for(
        lambda: next(
            (
                p
                for p in ledger.preemptions(user=user)
                if p.entry_id == entry_id and getattr(p, "withdrawn", None) is None  # (main: no such field)
            ),
            None,
        ),
        30,
        f"{user}'s notice for entry {entry_id}",
    )


def planned_start(ledger, entry_id):
    """The queue's planned start of an entry (what the ledger reserves by), said or not."""
    [q] = [q for q in ledger.queue() if q.id == entry_id]
    return q.expected


# item 5 ---------------------------------------------------------------------------------


def test_instant_cycles_do_not_let_dave_backfill_ahead_of_the_head(hub, tokens, ledger):
    # the attack's history: 20 bursts taken and given back at once
    for _ in range(20):
        a = held(hub, tokens["dave"], 1)
        assert checked(hub.broker("DELETE", f"allocations/{a['id']}", tokens["dave"])).status_code == 200
    # alice's 1 GPU is expected to end first, carol's 2 later; 1 GPU is free. bob waits for 2:
    # his reservation is alice's GPU and the free one, from when alice's is expected to end
    held(hub, tokens["alice"], 1)
    held(hub, tokens["carol"], 2)
    bob = queued(hub, tokens["bob"], 2)
    moved = checked(hub.broker("POST", f"queue/{bob['id']}/front", tokens["admin"]))
    assert moved.status_code == 200, moved.text
    before = entry(hub, tokens["bob"], bob["id"])
    # nobody here has a finished run to go by: the API says "cannot tell yet", but the plan
    # still reserves bob's GPUs from the default run length's end
    assert (before["position"], before["expected_sure"], before["expected_start"]) == (1, "default", None)
    planned = planned_start(ledger, bob["id"])
    assert planned is not None

    r = burst(hub, tokens["dave"], 1)  # on the free GPU, ahead of bob's reservation
    assert (r.status_code, r.json().get("reason")) == (409, "no_capacity"), r.text
    assert ledger.active(user="dave") == []
    after = entry(hub, tokens["bob"], bob["id"])
    assert (after["state"], after["position"], after["expected_sure"]) == ("waiting", 1, "default")
    assert planned_start(ledger, bob["id"]) == planned
    assert sum(len(a.gpus) for a in ledger.active()) == 3  # the free GPU is still free


def test_an_allocation_that_started_ahead_of_the_head_is_taken_back_at_its_turn(hub, tokens, ledger):
    # erin's runs really are short: three of 10 minutes yesterday (written as the hub would have)
    clock = Clock(utcnow() - timedelta(days=1))
    past = Ledger(hub.ledger_url, clock=clock)
    try:
        for _ in range(3):
            a = past.allocate("erin", [], 1, purpose="distributed", lease_seconds=3600)
            clock.advance(minutes=10)
            past.release(a.id, "done")
    finally:
        past.close()
    alice = held(hub, tokens["alice"], 1)
    carol = held(hub, tokens["carol"], 2)
    bob = queued(hub, tokens["bob"], 2)
    erin = held(hub, tokens["erin"], 1)  # expected done long before bob's turn: backfilled
    assert erin["backfill"] is True and erin["preemption"] is None
    assert ledger.get(erin["id"]).backfill

    # alice gives back her GPU: bob's turn has come but for erin's; she is given notice
    checked(hub.broker("DELETE", f"allocations/{alice['id']}", tokens["alice"]))
    p = notice_for(ledger, "erin", bob["id"])
    assert (p.allocation_id, p.borrowed, p.gpus) == (erin["id"], 0, 1)
    assert p.reason.startswith("preempted: 1 GPU that started ahead of a waiting request (backfill)")
    shown = checked(hub.broker("GET", f"allocations/{erin['id']}", tokens["erin"])).json()
    assert shown["preemption"]["reason"] == p.reason

    # at the due time her burst ends (her lease has 10 min left) and bob starts on its GPU
    ended = wait_for(lambda: (a := ledger.get(erin["id"])).state == "released" and a, 30, "erin's end")
    assert ended.end_reason == p.reason and ended.ended >= p.due
    got = checked(hub.broker("POST", f"queue/{bob['id']}/wait", tokens["bob"])).json()["allocation"]
    assert got is not None and {(g["node"], g["index"]) for g in got["gpus"]} >= {
        (g["node"], g["index"]) for g in erin["gpus"]
    }
    assert ledger.get(carol["id"]).active  # within her limit, ahead of nobody: never touched


# item 6 ---------------------------------------------------------------------------------


def test_a_notice_is_withdrawn_when_its_request_leaves_and_the_server_lives_on(hub, tokens, ledger):
    held(hub, tokens["alice"], 1)
    r = hub.spawn("carol", {"gpus": 3})  # 2 within her limit, 1 borrowed
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("carol")
    [server] = ledger.active(user="carol", purpose="server")
    assert (len(server.gpus), server.borrowed) == (3, 1)

    bob = queued(hub, tokens["bob"], 1)  # within his limit: only carol's borrowed GPU serves him
    p = notice_for(ledger, "carol", bob["id"])
    assert p.allocation_id == server.id
    me = checked(hub.broker("GET", "me", tokens["carol"])).json()
    assert [(n["id"], n.get("withdrawn")) for n in me["preempted"]] == [(p.id, None)]

    # bob leaves at no cost to himself: the notice is withdrawn, and carol told
    left = checked(hub.broker("DELETE", f"queue/{bob['id']}", tokens["bob"]))
    assert left.status_code == 200, left.text
    row = wait_for(
        lambda: next(
            (q for q in ledger.preemptions(user="carol") if q.id == p.id and getattr(q, "withdrawn", None)),
            None,
        ),
        30,
        "the notice withdrawn",
    )
    assert row.withdrawn_reason == "withdrawn: the request it was for no longer waits (it left the queue)"
    mine = checked(hub.broker("GET", f"allocations/{server.id}", tokens["carol"])).json()
    assert mine["preemption"] is None
    assert mine["preemption_withdrawn"] == {
        "at": row.withdrawn.isoformat(timespec="seconds") + "Z",
        "reason": row.withdrawn_reason,
    }
    [told] = checked(hub.broker("GET", "me", tokens["carol"])).json()["preempted"]
    assert (told["id"], told["withdrawn_reason"]) == (p.id, row.withdrawn_reason)

    # past the due time: a pass of the broker's after it (it gives dave a notice to the same
    # allocation, so it was live then) has not stopped carol's server
    wait_for(lambda: utcnow() > p.due + timedelta(seconds=1), 30, "the old due time to pass")
    dave = queued(hub, tokens["dave"], 1)
    again = notice_for(ledger, "carol", dave["id"])
    assert again.id == p.id and again.created > p.due  # the same row, given again
    assert ledger.get(server.id).active and hub.server("carol")["ready"]
    checked(hub.broker("DELETE", f"queue/{dave['id']}", tokens["dave"]))
    wait_for(
        lambda: checked(hub.broker("GET", f"allocations/{server.id}", tokens["carol"])).json()[
            "preemption_withdrawn"
        ],
        30,
        "the second notice withdrawn",
    )
    assert ledger.get(server.id).active and hub.server("carol")["ready"]


def test_a_withdrawn_notice_reaches_the_kernel_and_its_burst_is_renewed_past_the_due_time(
    hub, tokens, ledger
):
    held(hub, tokens["carol"], 2)  # her limit
    lent = held(hub, tokens["carol"], 1)  # beyond it: borrowed while nobody waits
    assert lent["borrowed"] == 1
    held(hub, tokens["alice"], 1)  # nothing is free now
    seen: list[dict] = []
    lease = keeper(hub, tokens["carol"], lent, seen)
    try:
        bob = queued(hub, tokens["bob"], 1)
        p = notice_for(ledger, "carol", bob["id"])
        assert p.allocation_id == lent["id"]
        wait_for(lambda: any("due" in n for n in seen), 30, "the notice in carol's kernel")
        checked(hub.broker("DELETE", f"queue/{bob['id']}", tokens["bob"]))
        told = wait_for(lambda: [n for n in seen if "withdrawn" in n], 30, "the withdrawal in carol's kernel")
        row = next(q for q in ledger.preemptions(user="carol") if q.id == p.id)
        assert row.withdrawn is not None  # what the kernel was told is the ledger's row
        assert told == [{"withdrawn": {"at": row.withdrawn.isoformat(timespec="seconds") + "Z",
                                       "reason": row.withdrawn_reason}}]  # fmt: skip
        assert lease.preemption is None and not lease.lost
        # past the due time the burst is still hers: renewed, not refused as preempted
        wait_for(lambda: utcnow() > p.due + timedelta(seconds=1), 30, "the due time to pass")
        r = checked(hub.broker("POST", f"allocations/{lent['id']}/renew", tokens["carol"], json={}))
        assert r.status_code == 200, r.text
        assert ledger.get(lent["id"]).active and not lease.lost
    finally:
        lease.stop()


# item 7 ---------------------------------------------------------------------------------


def test_a_preempted_burst_ends_at_its_due_time_whatever_its_lease(hub, tokens, ledger):
    held(hub, tokens["carol"], 2)
    r = burst(hub, tokens["carol"], 2, lease_seconds=3600)  # borrowed, on a lease of an hour
    assert r.status_code == 201 and r.json()["borrowed"] == 2, r.text
    lent = r.json()
    seen: list[dict] = []
    lease = keeper(hub, tokens["carol"], lent, seen)
    try:
        bob = queued(hub, tokens["bob"], 2)
        p = notice_for(ledger, "carol", bob["id"])
        assert p.allocation_id == lent["id"]
        # bob's expected start is the notice's due time (firm), not a guess from run lengths
        shown = entry(hub, tokens["bob"], bob["id"])
        assert (shown["expected_start"], shown["expected_sure"]) == (f"{p.due:%Y-%m-%dT%H:%M:%S}Z", "firm"), (
            shown
        )
        # carol's kernel goes on renewing (a kernel that ignores the notice): it cannot keep them
        ended = wait_for(lambda: (a := ledger.get(lent["id"])).state == "released" and a, 30, "the end")
        assert ended.end_reason == p.reason and p.due <= ended.ended < ended.lease_expires
        # the kernel's channel says so: its lease keeper finds the burst gone, with the reason
        wait_for(lambda: lease.lost, 30, "carol's kernel to learn its burst is gone")
        assert lease.reason == p.reason
        r = hub.broker("POST", f"allocations/{lent['id']}/renew", tokens["carol"], json={})
        assert r.status_code == 409
        got = checked(hub.broker("POST", f"queue/{bob['id']}/wait", tokens["bob"])).json()["allocation"]
        assert got is not None
        assert {(g["node"], g["index"]) for g in got["gpus"]} == {(g.node, g.index) for g in ended.gpus}
    finally:
        lease.stop()


# item 8 ---------------------------------------------------------------------------------


def test_the_preempted_user_is_not_told_whose_request_it_was(hub, tokens, ledger):
    held(hub, tokens["carol"], 2)
    lent = held(hub, tokens["carol"], 2)
    bob = queued(hub, tokens["bob"], 1)
    p = notice_for(ledger, "carol", bob["id"])
    me = checked(hub.broker("GET", "me", tokens["carol"])).json()
    [mine] = [n for n in me["preempted"] if n["id"] == p.id]
    own = checked(hub.broker("GET", "preemptions", tokens["carol"])).json()["preemptions"]
    [listed] = [n for n in own if n["id"] == p.id]
    for shown in (mine, listed):
        assert "for_user" not in shown and "bob" not in repr(shown), shown
        assert shown["allocation_id"] == lent["id"]
    admin = checked(hub.broker("GET", "preemptions?user=carol", tokens["admin"])).json()["preemptions"]
    assert [n["for_user"] for n in admin if n["id"] == p.id] == ["bob"]


def test_the_lease_keeper_is_told_each_notice_once(hub, tokens, ledger):
    """A notice given again after a withdrawal (another request) reaches the kernel again."""
    held(hub, tokens["carol"], 2)
    lent = held(hub, tokens["carol"], 1)
    held(hub, tokens["alice"], 1)
    seen: list[dict] = []
    lease = keeper(hub, tokens["carol"], lent, seen)
    try:
        for user in ("bob", "dave"):
            waiting = queued(hub, tokens[user], 1)
            p = notice_for(ledger, "carol", waiting["id"])
            want = {"due": p.due.isoformat(timespec="seconds") + "Z", "reason": p.reason}
            wait_for(lambda want=want: want in seen, 30, f"the notice for {user} in carol's kernel")
            checked(hub.broker("DELETE", f"queue/{waiting['id']}", tokens[user]))
            wait_for(lambda: "withdrawn" in seen[-1], 30, "the withdrawal in carol's kernel")
        assert [next(iter(n)) for n in seen] == ["due", "withdrawn", "due", "withdrawn"]
    finally:
        lease.stop()
