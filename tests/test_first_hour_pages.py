"""What a user and an admin read on the broker's pages and the hub's home page in a busy hour
(issue 29, items 7 and 8), in Debian's headless Chromium at 1400x900 against a real hub: one
time format (UTC), counts in words, one true sentence for what a user holds, notices said once,
the Services menu and a way in to GPU admin, and an admin page without empty sections.

The hub: the demo's 4 simulated GPUs, a limit of 1 for everyone and a borrowing allowance of
2; a notice stands for 10 minutes (nothing is taken back while the test reads it). The state:
bob's server (1 GPU), alice's burst of 2 (1 borrowed, then given notice for dave), carol's
burst of 1, dave waiting for 1. Screenshots go to the test's directory, and to
``$GPUHUB_SHOTS`` when it is set.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
from playwright.sync_api import expect

from .hubtools import ADMIN_PASSWORD, DEMO_PASSWORD, Hub, tidy_ledger, user_tokens, wait_for

pytestmark = pytest.mark.hub

CONFIG = """
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {}
c.GpuHub.user_limits = {}
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = 600
c.GpuHub.queue_keepalive_seconds = 600
"""
ISO = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d")  # the API's form, never for people
TWELVE_HOUR = re.compile(r"\d:\d\d(:\d\d)?\s?[AP]M\b")  # the browser's local 12-hour clock
UPDATED = re.compile(r"^updated \d\d:\d\d:\d\d UTC$")
SCALE = """() => {
  const chart = Chart.getChart(document.getElementById("usage-plot"));
  return [chart.scales.y.max, Math.max(...chart.data.datasets.flatMap((d) => d.data))];
}"""
# the page's own drawPlot with what the API answers for GPUs held only for moments
ZEROS = """() => drawPlot(document.querySelector(".usage-plot"), {
  series: {bob: [0, 0]}, total: {bob: 0}, buckets: ["2026-12-03T00:00:00Z", "2026-12-04T00:00:00Z"],
  until: "2026-12-05T00:00:00Z"})"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("first-hour"), extra_config=CONFIG).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return user_tokens(hub)


@pytest.fixture
def ledger(hub):
    yield from tidy_ledger(hub, stop_servers=True)


def login(browser, hub, user, password=DEMO_PASSWORD):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    return page


def shot(page, tmp_path, name):
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("GPUHUB_SHOTS"):
        os.makedirs(os.environ["GPUHUB_SHOTS"], exist_ok=True)
        shutil.copy(path, os.path.join(os.environ["GPUHUB_SHOTS"], path.name))


def max_depth(text: str) -> int:
    depth = most = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        most = max(most, depth)
    return most


def readable(page, quoted: str = "") -> str:
    """What the page shows, after its live parts have been filled at least once; ``quoted``:
    a text the page shows as the ledger wrote it (a preemption's reason, for admins)."""
    expect(page.locator("[data-live-status]").first).to_have_text(UPDATED, timeout=30_000)
    text = page.locator("body").inner_text().replace(quoted, "")
    assert not ISO.search(text), ISO.search(text)
    assert not TWELVE_HOUR.search(text), TWELVE_HOUR.search(text)
    assert "GPU(s)" not in text and "1 GPUs" not in text
    return text


def test_a_busy_hour_reads_right_to_a_user_and_an_admin(hub, tokens, ledger, browser, tmp_path):
    assert hub.spawn("bob", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("bob")
    lent = hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 2, "lease_seconds": 900})
    assert lent.status_code == 201 and lent.json()["borrowed"] == 1, lent.text
    lent = lent.json()
    assert hub.broker("POST", "allocations", tokens["carol"], json={"gpus": 1}).status_code == 201
    waits = hub.broker("POST", "allocations", tokens["dave"], json={"gpus": 1, "wait": True})
    assert waits.status_code == 202, waits.text
    [p] = wait_for(lambda: ledger.preemptions(user="alice"), 30, "alice's borrowed GPU given notice")

    # My GPUs: one sentence for what she holds, borrowed included; the notice said once
    alice = login(browser, hub, "alice")
    alice.goto(hub.broker_url + "/")
    text = readable(alice)
    expect(alice.locator("#allowance")).to_contain_text(
        "You hold 2 GPUs: 1 within your limit of 1 (default) and 1 borrowed; 0 more would fit now."
    )
    notice = alice.locator(f'#preemption-notices [data-preemption="{p.id}"]')
    expect(notice).to_contain_text(f"Your burst #{lent['id']}'s 1 borrowed GPU will be taken back at ")
    expect(notice).to_contain_text(" UTC, in ")
    assert "preempted:" not in notice.inner_text() and max_depth(notice.inner_text()) == 0
    assert text.count("Times are UTC.") == 1
    expect(alice.locator("#my-allocations th", has_text="Lease until")).to_have_count(1)  # a burst's lease
    expect(alice.locator('[data-empty="my-queue"]')).to_have_text("You are not waiting for GPUs.")
    expect(alice.locator("#my-queue")).to_be_hidden()
    shot(alice, tmp_path, "my-gpus-alice")

    # bob holds a server only: no empty lease column, no chart of nothing
    bob = login(browser, hub, "bob")
    bob.goto(hub.broker_url + "/")
    readable(bob)
    expect(bob.locator("#allowance")).to_contain_text("You hold 1 GPU of your limit of 1 (default)")
    expect(bob.locator("#my-allocations th", has_text="Lease until")).to_have_count(0)
    # his chart's scale is his usage's, not an empty 0-1; all zeros would be a line instead
    expect(bob.locator("canvas#usage-plot")).to_be_visible()
    top, most = bob.evaluate(SCALE)
    assert 0 < most <= top < 1, (top, most)
    shot(bob, tmp_path, "my-gpus-bob")
    bob.evaluate(ZEROS)
    expect(bob.locator("#usage-plot")).to_have_text(
        "No GPU-hours to chart in this period yet (under 0.0001)."
    )

    # the hub's home page: the Services menu names the pages as the README does; alice's
    # notice there has no parentheses inside parentheses and says it once
    home = alice
    home.goto(f"{hub.url}/hub/home")
    menu = home.locator(".dropdown-menu .dropdown-item")
    expect(menu).to_have_text(["My GPUs"])
    session = hub.login("alice")
    wait_for(  # the home page's notices are cached for up to 10 s per user
        lambda: f'data-preemption="{p.id}"' in session.get(f"{hub.url}/hub/home").text, 30, "the notice"
    )
    home.goto(f"{hub.url}/hub/home")
    told = home.locator(f'.gpuhub-preemption[data-preemption="{p.id}"]').inner_text()
    assert "preempted:" not in told and "GPU(s)" not in told and max_depth(told) <= 1, told
    expect(home.locator(".gpuhub-admin-link")).to_have_count(0)
    shot(home, tmp_path, "hub-home-alice")

    # the admin: GPU admin from the home page and the Services menu
    admin = login(browser, hub, "admin", ADMIN_PASSWORD)
    admin.goto(f"{hub.url}/hub/home")
    expect(admin.locator(".dropdown-menu .dropdown-item")).to_have_text(["My GPUs", "GPU admin"])
    shot(admin, tmp_path, "hub-home-admin")
    admin.locator(".gpuhub-admin-link a").click()
    admin.wait_for_url(re.compile(r"/services/gpuhub/admin$"))
    text = readable(admin, quoted=p.reason)
    shot(admin, tmp_path, "gpu-admin")

    # who holds what, the queue and the limits come first; a table of contents
    order = admin.evaluate("() => [...document.querySelectorAll('main > section')].map((s) => s.id)")
    assert order[:3] == ["holders-section", "queue-section", "limits-section"], order
    expect(admin.locator("#admin-toc a")).to_have_count(len(order))
    expect(admin.locator('[data-toc="queue"]')).to_have_text("(1 waiting)")
    expect(admin.locator('#queue tr[data-user="dave"]')).to_be_visible()
    # empty sections are one line, not an empty table
    expect(admin.locator('[data-empty="reclaims"]')).to_have_text("No idle reclaims in the last 14 days.")
    expect(admin.locator("#reclaims")).to_be_hidden()
    expect(admin.locator("#reclaim-users")).to_be_hidden()
    assert "None." not in text and not re.search(r"Total\s+0\s+0", text)
    expect(admin.locator('[data-empty="borrowing"]')).to_be_hidden()  # alice borrows
    expect(admin.locator(f'#preemptions tr[data-preemption="{p.id}"]')).to_be_visible()
    # every column of the holders has a header; each GPU card's line says what it is
    headers = admin.locator("#cluster thead th").all_inner_texts()
    assert all(h.strip() for h in headers) and headers[-1] == "Release", headers
    cells = admin.locator(".gpu-cell")
    expect(cells).to_have_count(4)
    for i in range(4):
        expect(cells.nth(i).locator(".gpu-spark-caption")).to_have_text(
            re.compile(r"^utilization(, last \d+ min \(0\u2013100%\)|: no samples yet)$")
        )
    assert admin.locator("svg.gpu-spark").count() == admin.locator(".gpu-spark-box").count()
    # the limits editor shows a window only where a GPU-hours quota is set
    default = admin.locator('tr[data-limit^="default/"]')
    expect(default.locator('[name="window_hours"]')).to_be_hidden()
    expect(default.locator("[data-no-quota]")).to_have_text("no quota")
    default.locator('[name="gpu_hours"]').fill("10")
    expect(default.locator('[name="window_hours"]')).to_be_visible()
    expect(default.locator("[data-no-quota]")).to_be_hidden()
    # an empty hour: the sections say so in a line each
    ledger.leave_queue(waits.json()["queued"]["id"], "test: dave leaves")
    expect(admin.locator('[data-empty="queue"]')).to_have_text(
        "Nobody is waiting for GPUs now.", timeout=30_000
    )
    expect(admin.locator("#queue")).to_be_hidden()
