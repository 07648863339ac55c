"""gpuhub inside JupyterLab (labextension/ and gpu_magics.lab), as researchers meet it: a real
hub, proxy and broker on the demo's 4 simulated GPUs whose use follows their processes
(``c.GpuHub.simulated_load = "processes"``), each user's JupyterLab in Debian's headless
Chromium (Playwright). Limits: 1 GPU, alice 2; everyone may borrow 2 with 20 s' notice.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from playwright.sync_api import expect

from .hubtools import Hub, tidy_ledger, user_tokens, wait_for
from .kerneltools import run_cell
from .test_borrow_pages import login

pytestmark = pytest.mark.hub

CONFIG = """
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {}
c.GpuHub.user_limits = {"alice": 2}
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = 20
c.GpuHub.queue_keepalive_seconds = 600
c.GpuHub.simulated_load = "processes"
c.GpuHub.report_seconds = 1
c.GpuBroker.sweep_seconds = 1
c.GpuReclaim.warn_after_seconds = 15
c.GpuReclaim.reclaim_after_seconds = 900
c.GpuHub.default_max_hours = 1
c.GpuHub.extension_max_hours = 2
"""
TOAST = ".Toastify__toast"  # JupyterLab's notifications


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("lab"), extra_config=CONFIG).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return user_tokens(hub)


@pytest.fixture
def ledger(hub):
    yield from tidy_ledger(hub, stop_servers=True)


def open_lab(browser, hub, user):
    page = login(browser, hub, user)
    page.goto(f"{hub.url}/user/{user}/lab")
    expect(page.locator(".gpuhub-status")).to_be_visible(timeout=60_000)
    return page


def toasts(page, text: str) -> int:
    return page.locator(TOAST, has_text=text).count()


def test_lab_shows_this_servers_gpus_their_live_use_and_the_kernels_icon(
    hub, tokens, ledger, browser, tmp_path
):
    assert hub.spawn("alice", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("alice")
    [mine] = ledger.active(user="alice")
    page = open_lab(browser, hub, "alice")
    bar = page.locator(".gpuhub-status")
    expect(bar).to_contain_text("GPUs: 2 GPUs Simulated A100")
    # the launcher's GPU kernel has its own icon
    icon = page.locator('.jp-LauncherCard[title="Python 3 (GPUs)"] img').first
    expect(icon).to_have_attribute("src", re.compile(r"kernelspecs/python3-gpus/logo"))

    # the panel's allocation and GPUs are GET me's; its limit line too
    bar.click()
    box = page.locator(f'.gpuhub-alloc[data-allocation="{mine.id}"]')
    expect(box).to_be_visible()
    me = hub.broker("GET", "me", tokens["alice"]).json()
    [a] = me["allocations"]
    labels = [f"{g['node']}:{g['index']}" for g in a["gpus"]]
    assert [box.locator(".gpuhub-gpu").nth(i).get_attribute("data-gpu") for i in range(2)] == labels
    expect(page.locator(".gpuhub-limits")).to_contain_text(
        "limit 2 GPUs (user alice) · holding 2 GPUs · may take 0 more · "
        f"may borrow {me['borrow']['may_borrow_now']} now"
    )

    # a busy cell makes its GPUs busy: the simulated reading follows the kernel's CPU time
    kc = hub.server_kernel("alice")
    stop = tmp_path / "stop"  # the busy cell runs until the test has seen what it needs
    try:
        kc.execute(
            "import os, time\nt = time.time()\n"
            f"while not os.path.exists({str(stop)!r}) and time.time() - t < 120: pass"
        )
        for label in labels:
            gpu = box.locator(f'.gpuhub-gpu[data-gpu="{label}"]')
            wait_for(
                lambda gpu=gpu: float(gpu.get_attribute("data-utilization") or 0) >= 20,
                40,
                f"{label} busy in the panel",
            )
            chart = gpu.locator("canvas.gpuhub-chart")
            wait_for(
                lambda chart=chart: float(chart.get_attribute("data-max") or 0) >= 20, 20, "the chart's peak"
            )
        util = hub.broker("GET", "utilization", tokens["alice"]).json()
        readings = {f"{g['node']}:{g['index']}": g["utilization"] for g in util["gpus"]}
        assert all(readings[label] is not None and readings[label] >= 20 for label in labels), readings
    finally:
        stop.touch()
        kc.get_shell_msg(timeout=60)  # the busy cell's reply: it ended (no load left for the next test)
        kc.stop_channels()

    # bad input: another user's allocation is not this server's to release; bob cannot read
    # alice's status at all (the hub's own login stands in front of the server extension)
    assert hub.spawn("bob", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("bob")
    [bobs] = ledger.active(user="bob")
    alice = hub.login("alice")
    alice.get(f"{hub.url}/user/alice/lab")  # the server's _xsrf cookie
    xsrf = {"X-XSRFToken": alice.cookies.get("_xsrf", path="/user/alice/")}
    r = alice.post(f"{hub.url}/user/alice/gpuhub/api/allocations/{bobs.id}/release", headers=xsrf)
    assert r.status_code == 404 and "not a %%distributed burst of this server" in r.json()["message"]
    r = alice.post(f"{hub.url}/user/alice/gpuhub/api/allocations/{mine.id}/release", headers=xsrf)
    assert r.status_code == 400 and "stop the server" in r.json()["message"]
    assert ledger.get(bobs.id).state != "released" and ledger.get(mine.id).state != "released"
    bob = hub.login("bob")
    r = bob.get(f"{hub.url}/user/alice/gpuhub/api/status", allow_redirects=False)
    assert r.status_code in (302, 403) and "gpus" not in r.text

    # a broker that does not answer: the status bar says so, the page shows no error
    pid = hub.broker_pid()
    os.kill(pid, signal.SIGSTOP)
    try:
        expect(bar).to_have_text("GPU status unavailable", timeout=30_000)
        expect(page.locator(".jp-Dialog")).to_have_count(0)
        # nothing is known to be this server's then: an action is refused as unavailable
        r = alice.post(
            f"{hub.url}/user/alice/gpuhub/api/allocations/{mine.id}/extend", headers=xsrf, json={"hours": 1}
        )
        assert r.status_code == 503 and r.json()["message"].startswith("GPU status unavailable"), r.text
    finally:
        os.kill(pid, signal.SIGCONT)
    expect(bar).to_contain_text("GPUs: 2 GPUs", timeout=30_000)


def test_a_preempted_server_is_told_in_lab_with_a_countdown_then_why_it_stopped(hub, tokens, ledger, browser):
    assert hub.spawn("bob", {"gpus": 3}).status_code in (201, 202)  # 1 within his limit, 2 borrowed
    hub.wait_ready("bob")
    [mine] = ledger.active(user="bob")
    assert mine.borrowed == 2
    page = open_lab(browser, hub, "bob")  # only the launcher is open
    expect(page.locator(".gpuhub-status")).to_contain_text("2 borrowed")
    assert hub.broker("POST", "allocations", tokens["carol"], json={"gpus": 1}).status_code == 201
    assert hub.spawn("dave", {"gpus": 1}).status_code == 202  # within his limit: bob's borrowed GPUs
    [p] = wait_for(lambda: ledger.preemptions(user="bob"), 30, "bob's server given notice")
    notice = page.locator(TOAST, has_text="This server stops in")
    expect(notice).to_have_count(1, timeout=15_000)
    first = notice.inner_text()
    wait_for(lambda: notice.inner_text() != first, 10, "the countdown moving")
    assert "2 borrowed GPUs taken back for a waiting request. Save your work now." in notice.inner_text()
    # the broker stops bob's server at the due time: JupyterLab says why, not another error
    stopped = page.locator(TOAST, has_text="This server stopped: 2 borrowed GPUs were taken back")
    expect(stopped).to_have_count(1, timeout=60_000)
    ended = wait_for(lambda: (a := ledger.get(mine.id)).state == "released" and a, 30, "the stop recorded")
    assert ended.end_reason == p.reason
    expect(page.get_by_text("IPP Extension Server Error")).to_have_count(0)
    expect(page.get_by_text("Failed to list clusters")).to_have_count(0)
    hub.wait_ready("dave")


def test_an_idle_warning_a_queue_turn_and_a_lowered_limit_each_notify_once(hub, tokens, ledger, browser):
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    page = open_lab(browser, hub, "alice")
    # idle for c.GpuReclaim.warn_after_seconds: warned once, with the time left
    idle = page.locator(TOAST, has_text="taken back for idleness in")
    expect(idle).to_have_count(1, timeout=120_000)  # c.GpuReclaim.warn_after_seconds, on a busy machine
    # the other 3 GPUs taken: alice's burst waits, her place shown
    for user in ("bob", "carol", "dave"):
        assert hub.broker("POST", "allocations", tokens[user], json={"gpus": 1}).status_code == 201
    waits = hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 1, "wait": True, "server": ""})
    assert waits.status_code == 202, waits.text
    entry = waits.json()["queued"]["id"]
    expect(page.locator(".gpuhub-status")).to_contain_text("queue: 1 of 1", timeout=20_000)
    [carols] = ledger.active(user="carol")
    ledger.release(carols.id, "test")
    wait_for(
        lambda: hub.broker("POST", f"queue/{entry}/wait", tokens["alice"]).json()["allocation"],
        30,
        "alice's turn",
    )
    turn = page.locator(TOAST, has_text="your turn came")
    expect(turn).to_have_count(1, timeout=20_000)
    # an admin raises her limit to 4 and she waits for 2 more; then it goes down to 1: a wait
    # for 2 can never start
    r = hub.broker("PUT", "limits/user/alice", tokens["admin"], json={"max_gpus": 4})
    assert r.status_code == 200, r.text
    waits = hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 2, "wait": True, "server": ""})
    assert waits.status_code == 202, waits.text
    second = waits.json()["queued"]["id"]
    expect(page.locator(".gpuhub-status")).to_contain_text("queue: 1 of 1", timeout=20_000)
    r = hub.broker("PUT", "limits/user/alice", tokens["admin"], json={"max_gpus": 1})
    assert r.status_code == 200, r.text
    wait_for(
        lambda: (
            hub.broker("POST", f"queue/{second}/wait", tokens["alice"]).json()["entry"]["state"] != "waiting"
        ),
        30,
        "alice's second wait ended",
    )
    ended = page.locator(TOAST, has_text="ended.")
    expect(ended).to_have_count(1, timeout=20_000)
    # each once: every later one came from later polls, and none was told again
    for text in ("taken back for idleness in", "your turn came", "ended."):
        assert toasts(page, text) == 1, text
    assert hub.broker("DELETE", "limits/user/alice", tokens["admin"]).status_code in (200, 204)


def test_the_panel_shows_a_pools_ranks_and_its_autosave_and_extends_the_time_limit(
    hub, tokens, ledger, browser
):
    assert hub.spawn("alice", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("alice")
    [mine] = ledger.active(user="alice")
    page = open_lab(browser, hub, "alice")
    kc = hub.server_kernel("alice")
    try:
        status, out = run_cell(kc, "%%distributed --gpus 2 --autosave x\nimport os\nx = os.getpid()")
        assert status == "ok", out
        status, out = run_cell(kc, "%%distributed\nprint(os.environ['RANK'], os.getpid(), flush=True)")
        assert status == "ok", out
        pids = {int(r): int(p) for r, p in re.findall(r"(\d+) (\d+)", out)}
        bar = page.locator(".gpuhub-status")
        expect(bar).to_contain_text("pool: 2 ranks", timeout=20_000)
        bar.click()
        pool = page.locator(".gpuhub-pool")
        expect(pool).to_have_count(1)
        gpus = [g.label for g in mine.gpus]
        for rank in (0, 1):
            row = pool.locator(f'tr[data-rank="{rank}"]')
            expect(row).to_have_attribute("data-state", "idle")
            cells = [row.locator("td").nth(i).inner_text() for i in range(4)]
            assert cells == [str(rank), gpus[rank].rsplit(":", 1)[0], gpus[rank], str(pids[rank])], cells
        expect(pool.locator(".gpuhub-autosave")).to_contain_text("--autosave: x to ")
        # the time limit (c.GpuHub.default_max_hours = 1) is extended from the panel
        assert ledger.get(mine.id).time_limit_seconds == 3600
        page.locator(f'.gpuhub-extend[data-allocation="{mine.id}"]').click()
        wait_for(lambda: ledger.get(mine.id).time_limit_seconds == 7200, 20, "the time limit extended")
        # the pool stopped: the panel says no more of it
        status, out = run_cell(kc, "%distributed shutdown")
        assert status == "ok", out
        expect(pool).to_have_count(0, timeout=20_000)
    finally:
        kc.stop_channels()
