"""The broker's pages in a real browser (Debian's headless Chromium, driven by Playwright).

Log in through the hub's login page, follow JupyterHub OAuth to the service, click the
page's buttons (which call the API with JupyterHub's XSRF token), and check the ledger.
Screenshots land in each test's temporary directory.
"""

import re
from datetime import datetime, timedelta

import pytest
from playwright.sync_api import expect

from .hubtools import DEMO_PASSWORD

pytestmark = pytest.mark.hub

ADMIN_PASSWORD = "gpuhub-demo-admin-password-change-me"


@pytest.fixture
def hub(tidy_demo_hub):
    return tidy_demo_hub


def login(browser, hub, user, password):
    page = browser.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    return page


BARS = """() => {
  const chart = Chart.getChart(document.getElementById("usage-plot"));
  return chart.data.datasets.map((ds, i) => {
    const bars = chart.getDatasetMeta(i).data;
    const last = bars[bars.length - 1];
    return {user: ds.gpuhubUser, values: ds.data, x: last.x, y: last.y};
  });
}"""
TOOLTIP_TITLE = """() => Chart.getChart(document.getElementById("usage-plot")).tooltip.title.join(" ")"""
TOOLTIP = """() => {
  const tip = Chart.getChart(document.getElementById("usage-plot")).tooltip;
  return tip.opacity > 0 && tip.body && tip.body.map((b) => b.lines.join(" ")).join(" | ");
}"""


def test_user_page_shows_and_releases_my_gpus(hub, ledger, browser, tmp_path):
    token = hub.user_token("alice")
    burst = hub.broker("POST", "allocations", token, json={"gpus": 2}).json()
    page = login(browser, hub, "alice", DEMO_PASSWORD)
    page.goto(f"{hub.broker_url}/")  # OAuth with the hub, then the page
    row = page.locator(f'tr[data-allocation="{burst["id"]}"]')
    expect(row).to_contain_text("distributed")
    for g in burst["gpus"]:
        expect(row).to_contain_text(f"{g['node']}:{g['index']}")
    expect(page.locator('[data-gpuhub="held"]')).to_have_text("2")
    expect(page.locator("#usage-plot")).to_be_visible()
    page.screenshot(path=str(tmp_path / "user-page.png"), full_page=True)
    row.locator("button[data-release]").click()
    expect(page.locator(f'tr[data-allocation="{burst["id"]}"]')).to_have_count(0)
    assert ledger.get(burst["id"]).state == "released"
    assert "by owner" in ledger.get(burst["id"]).end_reason


def test_a_write_without_the_xsrf_token_is_refused(hub, ledger, browser):
    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.broker_url}/admin")
    before = [(e.scope, e.name, e.limit) for e in ledger.limit_entries()]
    # the browser's cookies, but no X-XSRFToken: what a cross-site form would send
    r = page.request.put(f"{hub.broker_url}/api/v1/limits/user/mallory", data={"max_gpus": 4})
    assert r.status == 403
    assert [(e.scope, e.name, e.limit) for e in ledger.limit_entries()] == before


def test_an_admin_lands_on_gpu_admin_and_a_user_on_their_server(hub, ledger, browser):
    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    assert page.url.startswith(f"{hub.broker_url}/admin"), page.url  # not a spawn form of 1 GPU
    expect(page.locator("h1, h2").first).to_contain_text("GPUs")
    page.goto(f"{hub.url}/hub/")
    assert page.url.startswith(f"{hub.broker_url}/admin"), page.url
    page.goto(f"{hub.url}/hub/home")  # their own server is still a click away
    expect(page.locator("#start")).to_be_visible()
    bob = login(browser, hub, "bob", DEMO_PASSWORD)
    assert "/hub/spawn" in bob.url or "/user/bob/" in bob.url, bob.url


def test_admin_page_shows_every_gpu_edits_limits_and_plots_usage(hub, ledger, browser, tmp_path):
    bob = hub.user_token("bob")
    held = hub.broker("POST", "allocations", bob, json={"gpus": 1}).json()
    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.broker_url}/admin")
    rows = page.locator("#cluster tbody tr")
    expect(rows).to_have_count(len(ledger.gpu_table()))
    g = held["gpus"][0]
    expect(page.locator(f'tr[data-gpu="{g["node"]}:{g["index"]}"] .holder')).to_have_text("bob")

    # dave (default limit 1, and the demo's 2 to borrow) is refused 4 GPUs; the admin raises
    # his limit in the page
    assert hub.spawn("dave", {"gpus": 4}).status_code == 403
    new = page.locator('tr[data-limit="new"]')
    new.locator('[name="scope"]').select_option("user")
    new.locator('[name="name"]').fill("dave")
    new.locator('[name="max_gpus"]').fill("3")
    new.locator("button[data-save-limit]").click()
    saved = page.locator('tr[data-limit="user/dave"]')
    expect(saved).to_contain_text("ledger")
    expect(saved.locator('[name="max_gpus"]')).to_have_value("3")
    # enforced on the next spawn: 3 within the limit (bob holds the fourth GPU)
    assert hub.spawn("dave", {"gpus": 3}).status_code in (201, 202)
    hub.wait_ready("dave")
    assert len(hub.server_env("dave")["CUDA_VISIBLE_DEVICES"].split(",")) == 3
    assert [a.borrowed for a in ledger.active(user="dave")] == [0]

    hub.stop_server("dave")
    hub.broker("DELETE", "limits/user/dave", hub.user_token("admin"))
    hub.broker("DELETE", f"allocations/{held['id']}", bob)

    # the usage chart (chart.js, served by the broker) has bars of GPU-hours per day per user,
    # from the API's data; hovering today's bars shows bob's value (nothing is held now,
    # so the numbers stand still)
    page.reload()
    plot = page.locator("canvas#usage-plot")
    expect(plot).to_be_visible()
    assert page.evaluate("() => typeof window.Chart") == "function"
    assert page.request.get(f"{hub.broker_url}/static/vendor/chart.umd.min.js").status == 200
    usage = hub.broker("GET", "usage?since=14d", hub.user_token("admin")).json()
    bars = page.evaluate(BARS)
    assert {b["user"] for b in bars} == set(usage["series"]) and "bob" in usage["series"]
    bob = next(b for b in bars if b["user"] == "bob")
    assert bob["values"] == pytest.approx(usage["series"]["bob"], abs=1e-3)
    assert len(bob["values"]) == len(usage["buckets"]) >= 14
    plot.scroll_into_view_if_needed()
    box = plot.bounding_box()  # in the viewport, where the mouse is
    page.mouse.move(box["x"] + bob["x"], box["y"] + box["height"] / 2)  # over today's bars
    tooltip = page.wait_for_function(TOOLTIP)
    title = page.evaluate(TOOLTIP_TITLE)
    last = usage["buckets"][-1].replace("T", " ")[:16]
    # the period the bar covers: the page read its usage moments before this test did, so its
    # buckets may start a minute earlier
    shown = datetime.strptime(title[:16], "%Y-%m-%d %H:%M")
    want = datetime.strptime(last, "%Y-%m-%d %H:%M")
    assert timedelta(0) <= want - shown <= timedelta(minutes=2) and title.endswith(" UTC"), (title, last)
    shown = re.search(r"bob: ([0-9.e+-]+) GPU-hours", tooltip.json_value())
    assert shown, tooltip.json_value()
    assert float(shown.group(1)) == pytest.approx(usage["series"]["bob"][-1], rel=0.05, abs=1e-4)
    # the same data as CSV, from the page's download link (the browser's session)
    href = page.locator("#usage-csv").get_attribute("href")
    csv_text = page.request.get(href if href.startswith("http") else f"{hub.url}{href}").text()
    rows = [line.split(",") for line in csv_text.strip().splitlines()]
    assert rows[0][:3] == ["bucket_start", "user", "gpu_hours"]  # then the energy columns
    bob_rows = [float(h) for start, u, h, *_energy in rows[1:] if u == "bob"]
    assert bob_rows == pytest.approx(usage["series"]["bob"], abs=1e-3)
    expect(page.locator("#usage-table tbody tr")).not_to_have_count(0)
    shot = tmp_path / "admin-page.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000


def test_a_user_cannot_open_the_admin_page(hub, browser):
    page = login(browser, hub, "carol", DEMO_PASSWORD)
    resp = page.goto(f"{hub.broker_url}/admin")
    assert resp.status == 403


def test_a_refusal_on_the_spawn_form_is_the_message_alone(hub, ledger, browser):
    page = login(browser, hub, "dave", DEMO_PASSWORD)
    page.goto(f"{hub.url}/hub/spawn")
    page.fill("#gpuhub-gpus", "4")  # dave's limit is 1, and he may borrow 2 beyond it
    page.locator("#spawn_form input[type=submit], #spawn_form button[type=submit]").first.click()
    error = page.locator(".spawn-error-msg")
    expect(error).to_contain_text("but you hold 0 of a limit of 1 (default)")
    text = error.inner_text()
    assert "SpawnException" not in text and "gpuhub_" not in text and "403" not in text, text
    assert text.startswith("Error: You asked for 4 GPU"), text  # JupyterHub's prefix, then the message
    assert ledger.active(user="dave") == [] and hub.server("dave") is None
