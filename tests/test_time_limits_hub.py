"""Time limits end to end: a real hub and proxy with 4 simulated GPUs, the real broker, real
servers and kernels, the spawn form in a real browser (Debian's headless Chromium).

- alice's sessions may run for a minute (``user_max_hours``): the spawn form says so, her
  server's allocation ends a minute after its start, ``%gpus`` in her kernel says when, and at
  the end the broker stops the server through the hub: its GPU is free and the ledger says
  why.
- a burst asked for with ``"hours"`` ends at its time limit, whatever its lease, and the
  request waiting for its GPUs starts.
- a request for more than the longest session is refused at once, saying the longest.

Every API answer is validated against spawner/broker/openapi.yaml.
"""

from __future__ import annotations

import time

import pytest

from .hubtools import DEMO_PASSWORD, Hub, tidy_ledger, user_tokens, wait_for
from .kerneltools import run_cell
from .test_queue_pages import checked, login
from .test_release_paths import server_kernel

pytestmark = pytest.mark.hub

MINUTE = 1 / 60
CONFIG = f"""
c.GpuHub.default_limit = 4
c.GpuHub.group_limits = {{}}
c.GpuHub.user_limits = {{}}
c.GpuHub.default_max_hours = 8
c.GpuHub.user_max_hours = {{"alice": {MINUTE!r}}}
c.GpuHub.queue_keepalive_seconds = 600
"""
LEASE = 300  # the broker's default lease: what an end must not wait for


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("time-hub"), extra_config=CONFIG).start().wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return user_tokens(hub)


@pytest.fixture
def ledger(hub):
    yield from tidy_ledger(hub, stop_servers=True)


def test_a_server_runs_for_its_time_limit_then_the_hub_stops_it(hub, ledger, browser):
    page = login(browser, hub, "alice", DEMO_PASSWORD)
    page.goto(f"{hub.url}/hub/spawn/alice")
    help_text = page.locator("#gpuhub-hours-help").inner_text()
    assert "Your session may run for up to 1 min (user alice)" in help_text, help_text
    assert page.locator("#gpuhub-hours").get_attribute("max") == f"{MINUTE:g}"
    page.close()
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [server] = ledger.active(user="alice")
    assert server.time_limit_seconds == pytest.approx(60) and server.started is not None
    kc, _ = server_kernel(hub, "alice")
    status, out = run_cell(kc, "%gpus")
    assert status == "ok", out
    assert f"TIME: allocation #{server.id} ends at " in out and "(its time limit, 1 min)." in out, out
    kc.stop_channels()
    ends = server.time_ends
    wait_for(lambda: ledger.get(server.id).state == "released", 60 + 60, "the hub to stop the server")
    ended = ledger.get(server.id)
    assert ended.end_reason == f"its time limit (1 min) ran out at {ends:%H:%M:%S} UTC", ended.end_reason
    assert ended.ended >= ends and (ended.ended - ends).total_seconds() < LEASE / 10, (ended.ended, ends)
    wait_for(lambda: hub.server("alice") is None, 60, "the server to be gone from the hub")
    assert not any(st.holder for st in ledger.gpu_table())


def test_a_burst_ends_at_its_time_limit_and_the_waiter_starts(hub, ledger, tokens):
    r = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 3, "hours": MINUTE}))
    assert r.status_code == 201, r.text
    bob = r.json()
    assert (
        bob["time_limit"]["seconds"] == pytest.approx(60) and bob["lease_expires"] > bob["time_limit"]["ends"]
    )
    r = checked(hub.broker("POST", "allocations", tokens["carol"], json={"gpus": 2, "wait": True}))
    assert r.status_code == 202, r.text
    entry = r.json()["queued"]

    def carol_started():
        got = checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["carol"])).json()
        return got.get("allocation")

    started = None
    deadline = time.monotonic() + 120
    while started is None and time.monotonic() < deadline:
        started = carol_started()
        if started is None:
            time.sleep(0.5)
    assert started is not None, "carol's request did not start"
    ended = ledger.get(bob["id"])
    assert ended.state == "released" and ended.end_reason.startswith("its time limit (1 min) ran out at")
    assert (ended.ended - ended.time_ends).total_seconds() < LEASE / 10
    assert started["time_limit"]["seconds"] == pytest.approx(8 * 3600)  # carol's: the default longest


def test_a_request_longer_than_the_longest_session_is_refused_at_once(hub, ledger, tokens):
    r = hub.spawn("bob", {"gpus": 1, "hours": 9})
    assert r.status_code == 403, r.text
    assert "A session of 9 h is longer than the 8 h a session may run for you (default)" in r.text
    r = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 1, "hours": 9}))
    assert r.status_code == 403 and r.json()["reason"] == "over_time_limit", r.text
    r = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 1, "hours": "nine"}))
    assert r.status_code == 400 and "'hours' must be a number of hours" in r.json()["message"], r.text
    assert ledger.active(user="bob") == []
