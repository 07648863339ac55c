"""Time limits end to end: a real hub and proxy with 4 simulated GPUs, the real broker, real
servers and kernels, the spawn form in a real browser (Debian's headless Chromium).

- alice's sessions may run for a minute (``user_max_hours``): the spawn form says so, her
  server's allocation ends a minute after its start, ``%gpus`` in her kernel says when; a pool
  with ``--autosave`` busy in a long cell is warned in the cell (24 s before the end), then
  interrupted, saved and stopped, with the report; at the end the broker stops the server
  through the hub: its GPU is free and the ledger says why.
- a burst asked for with ``"hours"`` ends at its time limit, whatever its lease, and the
  request waiting for its GPUs starts.
- a request for more than the longest session is refused at once, saying the longest.
- extensions: bob's server gets 30 min more from ``%gpus --extend`` in its kernel, his burst
  1 h more from "Extend by hours" on My GPUs in Chromium; with carol waiting behind the burst a
  second one is refused (she would start later), carol cannot extend bob's (404), an admin
  can, and GPU admin lists each with who asked.

Every API answer is validated against spawner/broker/openapi.yaml.
"""

from __future__ import annotations

import os
import re
import time
from datetime import timedelta

import pytest

from .hubtools import ADMIN_PASSWORD, DEMO_PASSWORD, Hub, tidy_ledger, user_tokens, wait_for
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
c.GpuHub.time_warning_minutes = [0.4]
c.GpuHub.extension_max_hours = 2
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
    ends = server.time_ends
    page = login(browser, hub, "alice", DEMO_PASSWORD)  # My GPUs says when it ends
    page.goto(f"{hub.url}/services/gpuhub/")
    badge = page.locator(f'tr[data-allocation="{server.id}"] [data-time-ends]')
    assert badge.inner_text() == f"ends at {ends:%Y-%m-%d %H:%M:%S} UTC", badge.inner_text()
    page.close()
    # a pool on the server's GPU with --autosave, busy in a long cell when the warning comes:
    # warned in the cell, interrupted before the end, w saved, the engines stopped, the report
    status, out = run_cell(kc, "%config DistributedMagics.preempt_save_seconds = 5")
    assert status == "ok", out
    status, out = run_cell(
        kc, "%%distributed --gpus 1 --autosave w\nimport torch\nw = torch.arange(6.0) * (rank + 1)"
    )
    assert status == "ok", out
    status, out = run_cell(
        kc, "%%distributed --gpus 1\nimport time\nfor _ in range(1200):\n    time.sleep(0.1)"
    )
    assert status == "error", out
    at = f"{ends:%H:%M:%S} UTC"
    assert (
        f"gpuhub: TIME: the server's time limit (1 min, allocation #{server.id}) runs out at {at} (in " in out
    ), out
    assert "a running cell is interrupted, w autosaved to " in out, out
    assert "interrupting the cell to save w before the time limit runs out" in out, out
    assert "Time is up: the pool's time limit ran out." in out, out
    [path] = re.findall(r"^  w: (\S+)$", out, flags=re.M)
    assert os.path.exists(path), path
    assert f"The engines were stopped; the hub stops the server at {at}." in out, out
    kc.stop_channels()
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


def test_extensions_granted_refused_when_someone_waits_and_shown_to_admins(hub, ledger, tokens, browser):
    # bob's server (the default 8 h) gets 30 min more from his kernel
    assert hub.spawn("bob", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("bob")
    [server] = ledger.active(user="bob")
    kc, _ = server_kernel(hub, "bob")
    try:
        status, out = run_cell(kc, "%gpus --extend 30min")
        assert status == "ok", out
        ends = server.time_ends + timedelta(minutes=30)
        assert (
            f"Extended allocation #{server.id} by 30 min: it now ends at {ends:%Y-%m-%d %H:%M:%S} UTC "
            "(its time limit, 8 h 30 min)." in out
        ), out
        status, out = run_cell(kc, "%gpus --extend two hours")
        assert status == "error" and "--extend takes a length such as 2h, 90min or 1.5 (hours)" in out, out
    finally:
        kc.stop_channels()
    assert ledger.get(server.id).time_ends == ends
    # a burst of the other 3 GPUs for an hour, extended by an hour on My GPUs
    r = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 3, "hours": 1}))
    assert r.status_code == 201, r.text
    burst = r.json()
    page = login(browser, hub, "bob", DEMO_PASSWORD)
    page.goto(f"{hub.url}/services/gpuhub/")
    page.fill(f"#extend-{burst['id']}", "1")
    with page.expect_navigation():  # the page reloads with the new end
        page.click(f'[data-extend="{burst["id"]}"]')
    extended = ledger.get(burst["id"])
    assert extended.time_limit_seconds == pytest.approx(2 * 3600)
    badge = page.locator(f'tr[data-allocation="{burst["id"]}"] [data-time-ends]')
    assert badge.inner_text() == f"ends at {extended.time_ends:%Y-%m-%d %H:%M:%S} UTC", badge.inner_text()
    # carol waits for 2 GPUs: bob's burst ending is what she waits for
    r = checked(hub.broker("POST", "allocations", tokens["carol"], json={"gpus": 2, "wait": True}))
    assert r.status_code == 202, r.text
    assert r.json()["queued"]["expected_sure"] == "limit", r.text
    # bob's second extension would make her start later: refused at once, on the page too
    page.fill(f"#extend-{burst['id']}", "0.5")
    page.click(f'[data-extend="{burst["id"]}"]')
    alert = page.locator("#gpuhub-alert")
    alert.wait_for(state="visible")
    assert alert.inner_text().startswith("Not extended: 1 request waits for these GPUs"), alert.inner_text()
    page.close()
    r = checked(hub.broker("POST", f"allocations/{burst['id']}/extend", tokens["bob"], json={"hours": 0.5}))
    assert r.status_code == 403 and r.json()["reason"] == "extension_refused", r.text
    assert ledger.get(burst["id"]).time_limit_seconds == pytest.approx(2 * 3600)
    # bad input: the field named and what it takes
    for bad in (0, -1, "2", None, 10**6):
        r = checked(
            hub.broker("POST", f"allocations/{burst['id']}/extend", tokens["bob"], json={"hours": bad})
        )
        assert r.status_code == 400 and "'hours'" in r.json()["message"], (bad, r.text)
    # carol cannot extend bob's: it is not even confirmed to exist
    r = checked(hub.broker("POST", f"allocations/{burst['id']}/extend", tokens["carol"], json={"hours": 1}))
    assert r.status_code == 404, r.text
    # an admin can, past the waiters, and it is theirs in the record
    r = checked(
        hub.broker("POST", f"allocations/{burst['id']}/extend", hub.user_token("admin"), json={"hours": 1})
    )
    assert r.status_code == 200 and r.json()["extension"]["by"] == "admin", r.text
    listed = checked(hub.broker("GET", "extensions", tokens["bob"])).json()["extensions"]
    assert [(e["allocation_id"], e["by"], e["seconds"]) for e in listed] == [
        (burst["id"], "admin", 3600.0),
        (burst["id"], "bob", 3600.0),
        (server.id, "bob", 1800.0),
    ]
    assert checked(hub.broker("GET", "extensions", tokens["carol"])).json()["extensions"] == []
    r = checked(hub.broker("GET", "extensions?user=bob", tokens["carol"]))
    assert r.status_code == 403, r.text
    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.url}/services/gpuhub/admin")
    rows = page.locator("#extensions tbody tr").all_inner_texts()
    assert len(rows) == 3 and "admin" in rows[0] and "2 h → 3 h" in rows[0], rows
    assert "30 min" in rows[2] and "8 h → 8 h 30 min" in rows[2], rows
    page.close()
