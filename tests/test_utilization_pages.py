"""The live GPU use on the broker's pages, in a real browser on a real hub.

The single-user servers report simulated GPU readings from the file the test writes (as
tests/test_reclaim_hub.py does); the admin's grid and the user's page poll the API and must
show those numbers, update them in place, warn before an idle reclaim and list it after.
"""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

from spawner.ledger import Ledger

from .hubtools import DEMO_PASSWORD, Hub, wait_for
from .test_broker_pages import ADMIN_PASSWORD, login
from .test_reclaim_hub import ALL_BUSY, reclaim_hub_in, set_utilization

pytestmark = pytest.mark.hub

# the reclaim test's policy with a longer notice: the warning stays up long enough to be
# seen in the page (warned after 3 s idle, reclaimed after 20 s)
TIMING = """
c.GpuReclaim.warn_after_seconds = 3
c.GpuReclaim.reclaim_after_seconds = 20
"""


@pytest.fixture(scope="module")
def util_hub(tmp_path_factory):
    with reclaim_hub_in(tmp_path_factory.mktemp("utilization-pages"), TIMING) as found:
        yield found


def start_servers(hub: Hub, ledger: Ledger, *users: str) -> dict[str, str]:
    """Start each user's 1-GPU server; their GPUs' labels."""
    for user in users:
        assert hub.spawn(user, {"gpus": 1}).status_code in (201, 202)
    for user in users:
        hub.wait_ready(user)
    return {user: ledger.active(user=user)[0].gpus[0].label for user in users}


def test_the_admin_grid_shows_what_the_servers_report_and_updates_live(util_hub, browser, tmp_path):
    hub, ledger, util_file = util_hub
    gpu = start_servers(hub, ledger, "alice", "dave", "bob")  # bob is in "students": exempt
    set_utilization(util_file, ALL_BUSY | {gpu["alice"]: 73.0, gpu["dave"]: 12.0})

    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.broker_url}/admin")
    alice = page.locator(f'#gpu-grid [data-gpu="{gpu["alice"]}"]')
    dave = page.locator(f'#gpu-grid [data-gpu="{gpu["dave"]}"]')
    expect(alice.locator(".gpu-util-value")).to_have_text("73", timeout=30_000)
    expect(dave.locator(".gpu-util-value")).to_have_text("12", timeout=30_000)
    expect(alice.locator(".gpu-holder-user")).to_have_text("alice")
    expect(dave.locator(".gpu-holder-user")).to_have_text("dave")
    alice_id = ledger.active(user="alice")[0].id
    expect(alice.locator(".gpu-holder-allocation")).to_have_text(f"#{alice_id}")
    expect(alice.locator(".gpu-holder-purpose")).to_have_text("server")
    expect(alice.locator(".gpu-mem")).to_contain_text("7300 / ")  # the file's memory_used_mib
    expect(alice.locator(".gpu-model")).to_have_text("Simulated A100")
    # every GPU has a cell, the free ones say so
    expect(page.locator("#gpu-grid [data-gpu]")).to_have_count(len(ledger.gpu_table()))
    expect(page.locator('#gpu-grid [data-state="free"] .gpu-holder-free')).to_have_count(
        len(ledger.gpu_table()) - 3
    )
    expect(page.locator('[data-gpuhub="free"]')).to_have_text(str(len(ledger.gpu_table()) - 3))
    # the sparkline is drawn from the readings' history
    expect(alice.locator("svg.gpu-spark path.spark-line")).to_have_count(1)
    assert alice.locator("svg.gpu-spark path.spark-line").get_attribute("d").count("L") >= 1
    # busy GPUs carry no idle badge; an exempt user's say so
    expect(alice.locator(".gpu-idle")).to_have_count(0)
    bob = page.locator(f'#gpu-grid [data-gpu="{gpu["bob"]}"]')
    expect(bob.locator(".gpu-idle")).to_have_text("exempt", timeout=30_000)
    # per user: GPUs held and mean utilization
    expect(page.locator('#user-utilization tr[data-user="alice"] td').nth(1)).to_have_text("1")
    expect(page.locator('#user-utilization tr[data-user="dave"] td').nth(1)).to_have_text("1")

    # the grid is live: a new reading shows without reloading the page
    page.evaluate("window.__notReloaded = true")
    set_utilization(util_file, ALL_BUSY | {gpu["alice"]: 41.0, gpu["dave"]: 12.0})
    expect(alice.locator(".gpu-util-value")).to_have_text("41", timeout=30_000)
    expect(alice.locator(".gpu-mem")).to_contain_text("4100 / ")
    assert page.evaluate("window.__notReloaded") is True
    page.screenshot(path=str(tmp_path / "admin-grid.png"), full_page=True)
    for user in ("alice", "dave", "bob"):
        hub.stop_server(user)
    set_utilization(util_file, ALL_BUSY)


def test_the_user_page_shows_my_gpus_warns_when_idle_and_the_admin_sees_the_reclaim(
    util_hub,
    browser,
    tmp_path,
):
    hub, ledger, util_file = util_hub
    gpu = start_servers(hub, ledger, "alice")["alice"]
    [a] = ledger.active(user="alice")
    set_utilization(util_file, ALL_BUSY | {gpu: 64.0})

    page = login(browser, hub, "alice", DEMO_PASSWORD)
    page.goto(f"{hub.broker_url}/")
    use = page.locator(f'[data-allocation-use="{a.id}"] [data-gpu="{gpu}"]')
    expect(use.locator(".gpu-util-value")).to_have_text("64", timeout=30_000)
    expect(use.locator(".gpu-mem")).to_contain_text("6400 / ")
    expect(page.locator("[data-idle-warning]")).to_have_count(0)
    # the admin watches too (nothing reloads either page from here on)
    admin = login(browser, hub, "admin", ADMIN_PASSWORD)
    admin.goto(f"{hub.broker_url}/admin")
    cell = admin.locator(f'#gpu-grid [data-gpu="{gpu}"]')
    expect(cell.locator(".gpu-util-value")).to_have_text("64", timeout=30_000)
    expect(admin.locator('[data-empty="reclaims"]')).to_contain_text("No idle reclaims in the last")
    expect(admin.locator("#reclaims")).to_be_hidden()  # a line, not an empty table

    # idle: the page warns (live) while there is time to act
    set_utilization(util_file, {})
    warning = page.locator(f'[data-idle-warning="{a.id}"]')
    expect(warning).to_contain_text("Your GPUs have been idle for", timeout=30_000)
    expect(warning).to_contain_text(f"allocation {a.id} will be reclaimed in")
    expect(warning).to_contain_text("unless used")
    expect(warning).to_contain_text("below 5% utilization")
    expect(use.locator(".gpu-util-value")).to_have_text("0")
    page.screenshot(path=str(tmp_path / "user-warned.png"), full_page=True)
    assert ledger.get(a.id).state == "running"
    expect(cell.locator(".gpu-idle")).to_have_text(re.compile(r"^reclaim in \d+ s$"), timeout=10_000)

    # reclaimed: the page says why, and the warning is gone
    notice = page.locator("#reclaim-notices [data-reclaim]")
    expect(notice).to_contain_text("Your server was stopped by gpuhub", timeout=60_000)
    expect(notice).to_contain_text("because its 1 GPU stayed below 5% utilization")
    expect(warning).to_have_count(0, timeout=30_000)
    wait_for(lambda: hub.server("alice") is None, 30, "alice's server stopped by the reclaim")

    # the admin's reclaims table lists it, with the per-user and total GPU-hours
    [rec] = hub.broker("GET", "reclaims", hub.user_token("admin")).json()["reclaims"]
    row = admin.locator(f'#reclaims tbody tr[data-reclaim="{rec["id"]}"]')
    expect(row).to_contain_text("alice", timeout=30_000)
    expect(row).to_contain_text(f"server #{a.id}")
    expect(row).to_contain_text("stayed below 5% utilization with no kernel activity")
    cells = row.locator("td")
    expect(cells.nth(1)).to_have_text("alice")
    expect(cells.nth(3)).to_have_text("1")
    expect(cells.nth(6)).to_have_text(re.compile(r"^\d+\.\d{3} kWh$"))  # its saving, estimated
    expect(admin.locator("#reclaim-saved")).to_contain_text("kWh at the GPUs")
    per_user = admin.locator('#reclaim-users tbody tr[data-user="alice"] td')
    expect(per_user.nth(1)).to_have_text("1")
    hours = float(per_user.nth(2).text_content())
    assert hours == pytest.approx(rec["gpu_hours"], rel=0.1)  # shown to 2 digits
    expect(admin.locator("#reclaim-total th").nth(1)).to_have_text("1")
    admin.screenshot(path=str(tmp_path / "admin-reclaims.png"), full_page=True)
