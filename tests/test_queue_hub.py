"""The queue end to end: a real hub and proxy with 4 simulated GPUs, real spawns, a real
kernel's `%%distributed`, Chromium on the spawn page.

- spawns that fit the limit but not the free GPUs wait in fair-share order (a heavy recent
  user behind a light one), with their place and expected start on the progress API and
  the spawn page; a small request backfills without moving the head's expected start; the
  impossible is refused at once; the spawn page's stop button leaves the queue; the head
  starts when a server stops;
- a burst waits in the queue with its line in the cell, Ctrl-C leaves holding nothing, and
  a burst that waits starts when GPUs free;
- a hub restart, down for longer than the keepalive, keeps a waiting burst in its place; a
  spawn lost with the hub keeps its place when started again in time; a waiting user deleted
  by an admin leaves the queue.
"""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
from playwright.sync_api import expect

from spawner.ledger import Ledger, utcnow

from .hubtools import Hub, tidy, wait_for
from .kerneltools import BrokerKernel

pytestmark = pytest.mark.hub

CONFIG = """
c.GpuHub.default_limit = 2
c.GpuHub.queue_keepalive_seconds = 20
"""


def holders(ledger) -> dict[str, str]:
    return {st.gpu.label: st.holder.user for st in ledger.gpu_table() if st.holder}


def queue(hub) -> list[dict]:
    r = hub.broker("GET", "queue", hub.user_token("admin"))
    assert r.status_code == 200, r.text
    return r.json()["queue"]


def end_servers_left(ledger) -> None:
    """Stop the local servers the ledger still counts as running (their pids), as the hub would."""
    for a in ledger.active(purpose="server"):
        if a.backend_job_id:
            try:
                os.killpg(int(a.backend_job_id), signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass


def give_history(url: str, user: str, gpus: int, hours_ago: float, hours: float) -> None:
    """``user`` held ``gpus`` GPUs for ``hours``, ending ``hours_ago`` (their recent use): a
    released allocation in the ledger, as one from earlier today would be."""
    from spawner.ledger.models import Allocation

    end = utcnow() - timedelta(hours=hours_ago)
    start = end - timedelta(hours=hours)
    ledger = Ledger(url)
    try:
        with ledger._tx() as s:
            s.add(
                Allocation(
                    user=user,
                    purpose="distributed",
                    server_name="",
                    state="released",
                    created=start,
                    started=start,
                    ended=end,
                    backend="local",
                    gpu_count=gpus,
                    end_reason="earlier today",
                )
            )
    finally:
        ledger.close()


@pytest.fixture(scope="module")
def shared_hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("queue-hub"), extra_config=CONFIG).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture
def hub(shared_hub):
    """The module's hub; after each test nothing waits, no burst is held, no server runs
    (the recent usage that orders the queue stays: the tests that share it ask about
    users' usage they made themselves)."""
    yield shared_hub
    tidy(shared_hub, stop_servers=True, users=("alice", "bob", "carol", "dave", "erin", "frank"))


@pytest.fixture
def ledger(hub):
    ledger = Ledger(hub.ledger_url)
    yield ledger
    ledger.close()


def login(page, hub, user):
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", hub_password())
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)


def hub_password():
    from .hubtools import DEMO_PASSWORD

    return DEMO_PASSWORD


def test_spawns_wait_in_fair_share_order_and_the_head_starts_when_gpus_free(hub, ledger, browser):
    give_history(hub.ledger_url, "bob", 4, hours_ago=2, hours=10)  # bob used a lot today
    for i in range(12):  # erin even more, in short runs (an hour each)
        give_history(hub.ledger_url, "erin", 4, hours_ago=2 + i, hours=1)
    for user in ("alice", "dave"):  # the holders' usual runs, 3 h: what the expected starts go by
        give_history(hub.ledger_url, user, 1, hours_ago=30, hours=3)
    for user, n in (("alice", 2), ("dave", 1)):
        assert hub.spawn(user, {"gpus": n}).status_code in (201, 202)
        hub.wait_ready(user)
    held = holders(ledger)
    assert len(held) == 3  # one GPU free

    # bob (heavy) then carol (light) ask for 2: both wait, carol goes ahead
    assert hub.spawn("bob", {"gpus": 2}).status_code == 202
    assert hub.wait_progress("bob", "waiting for 2 GPUs").startswith("1st of 1 waiting for 2 GPUs")
    assert hub.spawn("carol", {"gpus": 2}).status_code == 202
    assert hub.wait_progress("carol", "waiting for 2 GPUs").startswith("1st of 2 waiting for 2 GPUs")
    assert hub.wait_progress("bob", "2nd of 2").startswith("2nd of 2 waiting for 2 GPUs, expected start")
    carol, bob = queue(hub)
    assert (carol["user"], bob["user"]) == ("carol", "bob")
    assert carol["factors"]["fairshare"] > bob["factors"]["fairshare"]
    assert bob["factors"]["recent_gpu_hours"] > 10 and carol["factors"]["recent_gpu_hours"] == 0
    assert holders(ledger) == held  # waiting takes nothing

    # erin, the heaviest user, waits behind both; her 1 GPU for about an hour (her usual
    # run) fits the free one before anyone ahead needs it: it starts now (backfill), and
    # nobody's expected start moves
    before = {q["user"]: q["expected_start"] for q in queue(hub)}
    assert hub.spawn("erin", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("erin")
    assert {q["user"]: q["expected_start"] for q in queue(hub)} == before
    assert len(holders(ledger)) == 4

    # what can never fit is refused at once, and joins nothing
    r = hub.spawn("frank", {"gpus": 3})
    assert r.status_code == 403 and "a limit of 2" in r.json()["message"], r.text
    r = hub.spawn("frank", {"gpus": 9})
    assert r.status_code == 400 and "at most 4" in r.json()["message"], r.text
    assert [q["user"] for q in queue(hub)] == ["carol", "bob"]

    # bob's spawn page shows his place; its stop button leaves the queue
    page = browser.new_page()
    login(page, hub, "bob")
    page.goto(f"{hub.url}/hub/spawn-pending/bob")
    expect(page.locator("#progress-message")).to_contain_text("2nd of 2 waiting for 2 GPUs", timeout=30_000)
    expect(page.locator("#progress-message")).to_contain_text("expected start")
    page.click("#stop-server-btn")
    wait_for(lambda: [q["user"] for q in queue(hub)] == ["carol"], 30, "bob to leave the queue")
    wait_for(lambda: not hub.server("bob"), 30, "bob's server to be gone")
    [left] = [q for q in ledger.queue_history(utcnow() - timedelta(hours=1)) if q.user == "bob"]
    assert left.state == "left" and "stopped" in left.end_reason
    page.close()

    # alice stops: carol, now the head, starts on alice's GPUs
    alice_gpus = {g for g, u in holders(ledger).items() if u == "alice"}
    hub.stop_server("alice")
    hub.wait_ready("carol")
    assert {g for g, u in holders(ledger).items() if u == "carol"} == alice_gpus
    assert queue(hub) == []
    [granted] = [q for q in ledger.queue_history(utcnow() - timedelta(hours=1)) if q.user == "carol"]
    assert granted.state == "granted" and granted.allocation_id == ledger.active(user="carol")[0].id
    for user in ("carol", "dave", "erin"):
        hub.stop_server(user)
    assert ledger.active() == []


def test_a_burst_waits_in_the_queue_and_ctrl_c_leaves_it(hub, ledger, tmp_path):
    for user in ("alice", "dave"):
        assert hub.spawn(user, {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready(user)
    kernel = BrokerKernel(hub, tmp_path, user="bob")
    try:
        out = kernel.run("%%distributed --gpus 2\nrank", interrupt_when="waiting for 2 GPUs")
        assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
        assert "1st of 1 waiting for 2 GPUs" in out["text"]
        assert "left the queue; nothing is held" in out["text"] and "queuewait.py" not in out["text"]
        assert ledger.active(user="bob") == [] and queue(hub) == []

        # waiting again; alice stops meanwhile: the burst starts on her GPUs and runs the cell
        alice_gpus = {g for g, u in holders(ledger).items() if u == "alice"}
        out = kernel.run(
            "%%distributed --gpus 2\nrank",
            interrupt_when="waiting for 2 GPUs",
            then=lambda: hub.stop_server("alice"),
        )
        assert out["status"] == "ok", out["text"]
        assert "your turn came after" in out["text"] and "2 engines up" in out["text"]
        [burst] = ledger.active(user="bob")
        assert burst.purpose == "distributed" and {g.label for g in burst.gpus} == alice_gpus
    finally:
        kernel.close()
    wait_for(lambda: ledger.active(user="bob") == [], 30, "bob's burst to be released")
    hub.stop_server("dave")


def test_a_hub_restart_keeps_waiting_bursts_and_an_admin_deleting_a_user_ends_their_wait(tmp_path):
    keepalive = 12
    hub = Hub(
        tmp_path,
        extra_config=CONFIG
        + f"c.GpuHub.queue_keepalive_seconds = {keepalive}\nc.JupyterHub.cleanup_servers = False\n",
    ).start()
    ledger = Ledger(hub.ledger_url)
    try:
        hub.wait_for_broker()
        for user in ("alice", "dave"):
            assert hub.spawn(user, {"gpus": 2}).status_code in (201, 202)
            hub.wait_ready(user)
        bob = hub.user_token("bob")
        r = hub.broker("POST", "allocations", bob, json={"gpus": 2, "wait": True})
        assert r.status_code == 202, r.text
        bobs = r.json()["queued"]
        assert hub.spawn("carol", {"gpus": 1}).status_code == 202
        hub.wait_progress("carol", "waiting for 1 GPU")
        assert hub.spawn("erin", {"gpus": 1}).status_code == 202
        hub.wait_progress("erin", "waiting for 1 GPU")
        order = [(q["user"], q["created"]) for q in queue(hub)]

        hub.stop()  # the servers stay (cleanup_servers = False); the spawns die with the hub
        # down for longer than the keepalive (bob's kernel cannot ask meanwhile): the outage
        # must not cost his burst its place
        seen = next(q.seen for q in ledger.queue() if q.id == bobs["id"])
        wait_for(
            lambda: utcnow() > seen + timedelta(seconds=keepalive + 1), keepalive + 5, "the keepalive to pass"
        )
        hub.start()
        hub.wait_for_broker()
        # bob's kernel goes on asking: his burst is where it was
        r = hub.broker("POST", f"queue/{bobs['id']}/wait", bob)
        assert r.status_code == 200 and r.json()["entry"]["state"] == "waiting", r.text

        # the spawns died with the hub: their entries end, saying why (at the hub's shutdown,
        # or once nobody asked about them for the keepalive), while bob's kernel keeps asking
        def spawns_gone():
            assert hub.broker("POST", f"queue/{bobs['id']}/wait", bob).json()["entry"]["state"] == "waiting"
            return [q["user"] for q in queue(hub)] == ["bob"]

        wait_for(spawns_gone, 60, "the lost spawns to leave the queue", interval=1)
        since = utcnow() - timedelta(hours=1)
        for gone in [q for q in ledger.queue_history(since) if q.user in ("carol", "erin")]:
            assert gone.state == "left" and (
                "stopped while it waited" in gone.end_reason or "nobody waited for it" in gone.end_reason
            ), gone
        assert [(q["user"], q["created"]) for q in queue(hub)] == [(u, c) for u, c in order if u == "bob"]
        # carol starts again: she waits behind bob
        assert hub.spawn("carol", {"gpus": 1}).status_code == 202
        assert hub.wait_progress("carol", "waiting for 1 GPU").startswith("2nd of 2")

        # an admin deletes carol while she waits: her entry ends, nothing is held.
        # (JupyterHub 6 answers 500 for a user whose spawn is pending, "active and cannot be
        # deleted", and keeps the user: nothing may break then, and stopping first works.)
        r = hub.api("DELETE", "/users/carol")
        if r.status_code == 500:
            assert [q["user"] for q in queue(hub)] == ["bob", "carol"] and ledger.active(user="carol") == []
            hub.stop_server("carol")
            r = hub.api("DELETE", "/users/carol")
        assert r.status_code == 204, r.text
        wait_for(lambda: "carol" not in [q["user"] for q in queue(hub)], 30, "carol's entry to end")
        assert ledger.active(user="carol") == []

        # GPUs free up: bob's next ask is granted
        hub.stop_server("alice")
        got = wait_for(
            lambda: hub.broker("POST", f"queue/{bobs['id']}/wait", bob).json()["allocation"], 30, "bob's turn"
        )
        assert got["user"] == "bob" and len(got["gpus"]) == 2
        assert hub.broker("DELETE", f"allocations/{got['id']}", bob).status_code == 200
        hub.stop_server("dave")
        assert ledger.active() == []
    finally:
        try:
            end_servers_left(ledger)  # cleanup_servers is off: a failure above must not leave them
        finally:
            hub.stop()
            ledger.close()
