"""Energy and cost end to end: a real hub, proxy and broker on simulated GPUs, whose power the
broker's own sampler reads (60 W idle to 300 W busy, from the utilization file the test
writes). An idle server and a busy ``%%distributed`` pool are held for a measured time; their
energy must follow the power model, the idle part must be the idle server's, and the API, the
CSV, the metrics (checked by promtool), the admin page (Chromium) and ``%gpus`` must say the
same numbers."""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import socket
import subprocess
from datetime import datetime, timedelta

import pytest
from playwright.sync_api import expect
from prometheus_client.parser import text_string_to_metric_families

from spawner.ledger import Ledger

from .hubtools import DEMO_PASSWORD, Hub, wait_for
from .kerneltools import run_cell as run
from .test_broker_pages import ADMIN_PASSWORD, login
from .test_reclaim_hub import set_utilization

pytestmark = pytest.mark.hub

HOST = socket.gethostname()
GPUS = [f"{HOST}:{i}" for i in range(4)]
CONFIG = """
c.GpuHub.report_seconds = 0.5
c.GpuHub.simulated_utilization_file = {util_file!r}
c.GpuReclaim.stale_seconds = 4
c.GpuReclaim.reclaim_after_seconds = 3600
c.GpuReclaim.warn_after_seconds = 3000
c.GpuHub.pue = 1.5
c.GpuHub.energy_price = 0.2
c.GpuHub.energy_currency = "EUR"
c.GpuHub.carbon_intensity = 300
# budgets: carol's GPU-hours (10.8 GPU-seconds), dave's energy (0.0002 kWh at the meter: 8 s idle)
c.GpuHub.user_limits = {{"carol": {{"max_gpus": 2, "gpu_hours": 0.003}}, "dave": 2}}
c.GpuHub.user_energy_budgets = {{"dave": {{"kwh": 0.0002}}}}
"""
IDLE_W, BUSY_W = 60.0, 300.0  # gpu_magics.report.gpustats' simulated power model


@pytest.fixture(scope="module")
def energy_hub(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("energy")
    util_file = workdir / "utilization.json"
    set_utilization(util_file, {})
    hub = Hub(workdir, extra_config=CONFIG.format(util_file=str(util_file))).start().wait_for_broker()
    ledger = Ledger(hub.ledger_url)
    yield hub, ledger, util_file
    hub.stop()
    ledger.close()


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.rstrip("Z"))


def sampled_after(hub, labels, when: datetime) -> bool:
    """Whether gpuhub's sampler has read each of ``labels`` after ``when``."""
    grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
    seen = {f"{g['node']}:{g['index']}": g["sampled"] for g in grid["gpus"]}
    return all(seen.get(label) and parse_iso(seen[label]) > when + timedelta(seconds=1) for label in labels)


def measured_seconds(hub, user: str) -> float:
    me = hub.broker("GET", "me", hub.user_token(user)).json()
    return sum((a["energy"] or {}).get("measured_gpu_hours", 0.0) * 3600 for a in me["allocations"])


def test_an_idle_server_and_a_busy_pool_use_what_the_power_model_says(energy_hub, browser, tmp_path):
    hub, ledger, util_file = energy_hub
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [server] = ledger.active(user="alice")
    # alice's GPU idles (0 %); every other one is busy before bob's pool takes two of them
    set_utilization(util_file, {g: 100.0 for g in GPUS if g != server.gpus[0].label})
    assert hub.spawn("bob", {"gpus": 0}).status_code in (201, 202)
    hub.wait_ready("bob")
    kc = hub.server_kernel("bob")
    try:
        status, out = run(kc, "%%distributed --gpus 2\nimport os\nos.getpid()")
        assert status == "ok", out
        [pool] = ledger.active(user="bob")
        assert pool.purpose == "distributed" and len(pool.gpus) == 2

        # both held for a measured time: at least 10 GPU-seconds each of known energy
        wait_for(lambda: measured_seconds(hub, "alice") >= 10, 60, "alice's energy measured")
        wait_for(lambda: measured_seconds(hub, "bob") >= 20, 60, "bob's energy measured")
        me = hub.broker("GET", "me", hub.user_token("bob")).json()
        [live] = [a for a in me["allocations"] if a["id"] == pool.id]
        assert live["energy"]["gpu_kwh"] > 0 and me["energy"]["currency"] == "EUR"
        status, out = run(kc, "%gpus")
        assert status == "ok", out
        assert "This session so far:" in out and "kWh at the GPUs" in out and "EUR" in out, out

        status, out = run(kc, "%distributed shutdown")
        assert status == "ok", out
        wait_for(lambda: ledger.get(pool.id).state == "released", 60, "bob's pool released")
        # the session so far still counts the pool that ended (bob's server holds no GPU itself)
        status, out = run(kc, "%gpus")
        assert status == "ok", out
        [line] = [ln for ln in out.splitlines() if ln.startswith("This session so far")]
        kwh = float(re.match(r"This session so far: ([0-9.]+) kWh at the GPUs", line).group(1))
        assert kwh == pytest.approx(ledger.energy_of([pool.id]).joules / 3.6e6, abs=0.0015), line
    finally:
        kc.stop_channels()
    hub.stop_server("alice")
    hub.stop_server("bob")
    wait_for(lambda: ledger.get(pool.id).state == "released", 60, "bob's pool released")
    ended = max(ledger.get(server.id).ended, ledger.get(pool.id).ended)
    labels = [g.label for g in (*server.gpus, *pool.gpus)]
    # the interval in which each ended is written at the sampler's next reading: then all is final
    wait_for(lambda: sampled_after(hub, labels, ended), 30, "a reading after both ended")

    for a, watts in ((server, IDLE_W), (pool, BUSY_W)):
        a = ledger.get(a.id)
        e = ledger.energy_of([a.id])
        held = (a.ended - a.created).total_seconds() * len(a.gpus)
        # every GPU-second held is measured or said unknown, to within a reading each end
        assert abs(e.measured_seconds + e.unknown_seconds - held) <= 2 * 0.5 * len(a.gpus) + 1.5, (e, held)
        assert e.measured_seconds >= 10
        assert e.joules / e.measured_seconds == pytest.approx(watts, rel=0.01), e
        assert e.idle_joules == (pytest.approx(e.joules) if watts == IDLE_W else 0.0), e

    # the same numbers through the API, the CSV, the metrics, the admin page
    alice_e, bob_e = ledger.energy_of([server.id]), ledger.energy_of([pool.id])
    admin = hub.user_token("admin")
    usage = hub.broker("GET", "usage?since=2d", admin).json()["energy"]
    for user, e in (("alice", alice_e), ("bob", bob_e)):
        # each figure is the ledger's, rounded once (kWh and kg to 6 decimals, money to 4): held
        # to the unrounded value, not to another rounded figure (1.5 x a rounded kWh can be 1e-6 off)
        f, kwh = usage["total"][user], e.joules / 3.6e6
        assert f["gpu_kwh"] == pytest.approx(kwh, abs=5e-7)
        assert f["meter_kwh"] == pytest.approx(1.5 * kwh, abs=5e-7)
        assert f["cost"] == pytest.approx(0.2 * 1.5 * kwh, abs=5e-5) and f["currency"] == "EUR"
        assert f["co2e_kg"] == pytest.approx(0.3 * 1.5 * kwh, abs=5e-7)
    assert usage["total"]["alice"]["idle_share"] == pytest.approx(1.0)
    assert usage["total"]["bob"]["idle_share"] == 0.0
    mine = hub.broker("GET", "usage?since=2d", hub.user_token("alice")).json()["energy"]
    assert set(mine["total"]) == {"alice"} and "groups" not in mine  # a user sees only their own

    r = hub.broker("GET", "usage?since=2d&format=csv", admin)
    rows = list(csv.DictReader(io.StringIO(r.text)))
    for user, e in (("alice", alice_e), ("bob", bob_e)):
        kwh = sum(float(row["gpu_kwh"]) for row in rows if row["user"] == user)
        assert kwh == pytest.approx(e.joules / 3.6e6, abs=1e-5)
        assert all(row["currency"] == "EUR" for row in rows if row["user"] == user)

    metrics = requests_metrics(hub)
    joules = {}
    for family in text_string_to_metric_families(metrics):
        if family.name == "gpuhub_energy_joules":
            for s in family.samples:
                if s.name.endswith("_total"):
                    joules[s.labels["user"]] = joules.get(s.labels["user"], 0.0) + s.value
        if family.name == "gpuhub_gpu_power_watts":
            power = {f"{s.labels['node']}:{s.labels['index']}": s.value for s in family.samples}
    assert joules["alice"] == pytest.approx(alice_e.joules, rel=1e-9)
    assert joules["bob"] == pytest.approx(bob_e.joules, rel=1e-9)
    assert power[server.gpus[0].label] == IDLE_W and power[pool.gpus[0].label] == BUSY_W
    promtool_check(metrics, tmp_path)

    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.broker_url}/admin")
    row = page.locator('#gpuhub-energy-table tr[data-user="bob"]')
    expect(row).to_contain_text(f"{bob_e.joules / 3.6e6:.3f}", timeout=30_000)
    expect(page.locator('#gpuhub-energy-table tr[data-user="alice"]')).to_contain_text("100 %")
    page.screenshot(path=str(tmp_path / "admin-energy.png"), full_page=True)


def spent(hub, user: str) -> bool:
    me = hub.broker("GET", "me", hub.user_token(user)).json()
    if user == "carol":
        return me["gpu_hours_used"] >= 0.003
    return sum((a["energy"] or {}).get("meter_kwh", 0.0) for a in me["allocations"]) >= 0.0002


@pytest.mark.parametrize(
    "user, reason",
    [
        ("carol", "You have used 0.0 of your 0.003 GPU-hours over the last 168 hours (user carol)"),
        ("dave", "of your energy budget, 0.0002 kWh of energy over 168 hours (user dave)"),
    ],
)
def test_a_spent_budget_refuses_a_burst_in_a_cell_and_a_spawn_on_the_form(energy_hub, browser, user, reason):
    hub, ledger, util_file = energy_hub
    set_utilization(util_file, {})  # idle: 60 W each
    assert hub.spawn(user, {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready(user)
    [server] = ledger.active(user=user)
    wait_for(lambda: spent(hub, user), 90, f"{user}'s budget spent")
    kc = hub.server_kernel(user)
    try:  # a pool of 2 needs a burst of 1 beside the server's GPU: refused, with the reason
        status, out = run(kc, "%%distributed --gpus 2\nimport os\nos.getpid()")
        assert status == "error", out
        assert reason in out, out
        assert [a.id for a in ledger.active(user=user)] == [server.id]
    finally:
        kc.stop_channels()
    hub.stop_server(user)

    page = login(browser, hub, user, DEMO_PASSWORD)
    page.goto(f"{hub.url}/hub/spawn")
    page.fill("#gpuhub-gpus", "1")
    page.locator("#spawn_form button[type=submit], #spawn_form input[type=submit]").first.click()
    expect(page.locator(".spawn-error-msg")).to_contain_text(reason, timeout=30_000)
    assert hub.server(user) is None and ledger.active(user=user) == []
    # a server without GPUs still starts
    assert hub.spawn(user, {"gpus": 0}).status_code in (201, 202)
    hub.wait_ready(user)
    hub.stop_server(user)


def requests_metrics(hub) -> str:
    r = hub.broker("GET", "../../metrics", hub.user_token("admin"))
    assert r.status_code == 200, r.text
    return r.text


def promtool_check(text: str, tmp_path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        assert os.geteuid() != 0, "scripts/test installs promtool as root"
        pytest.skip("promtool is not installed (sudo apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr
