"""GPU slices for teaching, end to end (issue 34): a real hub and proxy with one simulated A100
split in quarters and one whole T4, real spawns through the REST API and through the spawn form
in Chromium.

Four students each start a 1/4-GPU server on the one A100; a fifth waits in the queue with its
place and starts, on the quarter given back, when one stops; a whole-A100 request waits while
any quarter is held and starts once all are given back; a student asking for a whole GPU or a
share that is not one slice is refused with the reason; the servers see their slice."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from playwright.sync_api import expect

from spawner.ledger import Ledger

from .hubtools import ADMIN_PASSWORD, Hub, browser_login, tidy
from .kerneltools import run_cell

pytestmark = pytest.mark.hub

GPUHUB = Path(sys.executable).parent / "gpuhub"  # the admin's command, as installed


def gpuhub(*args: str) -> str:
    r = subprocess.run([GPUHUB, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


STUDENTS = [f"s{i}" for i in range(1, 7)]
CONFIG = f"""
c.GpuHub.simulated_gpus = [
    {{"node": "sim", "count": 1, "model": "Simulated A100", "memory_mib": 40960}},
    {{"node": "sim", "count": 1, "model": "Simulated T4", "memory_mib": 16384, "first_index": 1}},
]
c.GpuHub.gpu_slices = {{"Simulated A100": 4}}
c.GpuHub.slice_groups = ["students"]
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {{}}
c.GpuHub.queue_keepalive_seconds = 20
c.JupyterHub.load_groups = {{"students": {{"users": {STUDENTS!r}}}}}
"""


@pytest.fixture(scope="module")
def shared_hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("slices-hub"), extra_config=CONFIG).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture
def hub(shared_hub):
    """The module's hub; after each test nothing waits and no server runs."""
    yield shared_hub
    tidy(shared_hub, stop_servers=True, users=(*STUDENTS, "rita"))


@pytest.fixture
def ledger(hub):
    ledger = Ledger(hub.ledger_url)
    yield ledger
    ledger.close()


def slices_held(ledger) -> dict[str, str]:
    return {g.label: a.user for a in ledger.active() for g in a.gpus}


def admins_see_the_slices(hub, held: dict[str, str], browser) -> None:
    """``gpuhub gpus``, the live grid's API and the GPU admin page show the split A100 with each
    slice's holder; a student's own view shows their slice alone."""
    [a100, t4] = json.loads(gpuhub("--db-url", hub.ledger_url, "gpus", "--json"))
    assert a100["holder"] is None and t4["holder"] is None and t4["slices"] == []
    assert {s["label"]: s["holder"]["user"] for s in a100["slices"]} == held
    table = gpuhub("--db-url", hub.ledger_url, "gpus")
    assert "4 of 4 slices held" in table and re.search(r"sim +0s3 +1/4 +s\d", table), table
    metrics = hub.broker("GET", "../../metrics", hub.user_token("admin")).text
    for line in (
        'gpuhub_gpus{model="Simulated A100",node="sim",state="sliced"} 1.0',
        'gpuhub_gpus{model="Simulated T4",node="sim",state="free"} 1.0',
        'gpuhub_gpu_slices{model="Simulated A100",node="sim",size="1/4",state="held"} 4.0',
        'gpuhub_gpu_slices{model="Simulated A100",node="sim",size="1/4",state="free"} 0.0',
        'gpuhub_allocated_gpus{purpose="server"} 1.0',  # four quarters
    ):
        assert line in metrics, metrics
    grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
    [split] = [g for g in grid["gpus"] if g["index"] == 0]
    assert {s["label"]: s["holder"]["user"] for s in split["slices"]} == held
    mine = hub.broker("GET", "utilization", hub.user_token("s1")).json()
    assert [[s["holder"]["user"] for s in g["slices"]] for g in mine["gpus"]] == [["s1"]]
    page = browser_login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.broker_url}/admin")
    cell = page.locator('.gpu-cell[data-gpu="sim:0"]')
    expect(cell).to_have_attribute("data-state", "sliced")
    expect(cell.locator(".gpu-slices-held")).to_have_text("4 of 4 slices held")
    for label, user in held.items():
        expect(cell.locator(f'[data-slice="{label}"] .gpu-holder-user')).to_have_text(user)
    page.close()


def test_four_students_share_a_gpu_a_fifth_waits_and_a_whole_gpu_waits_for_every_slice(hub, ledger, browser):
    for user in STUDENTS[:4]:
        assert hub.spawn(user, {"gpu_share": "1/4"}).status_code in (201, 202)
    for user in STUDENTS[:4]:
        hub.wait_ready(user)
    held = slices_held(ledger)
    assert sorted(held) == ["sim:0s1", "sim:0s2", "sim:0s3", "sim:0s4"], held
    env = hub.server_env(held["sim:0s2"])
    assert (env["CUDA_VISIBLE_DEVICES"], env["GPUHUB_GPUS"], env["GPUHUB_GPU_SLICE"]) == (
        "0",
        "sim:0s2",
        "1/4",
    )
    assert (env["GPUHUB_GPU_MEMORY_MIB"], env["GPUHUB_SLICE_MPS"]) == (
        "10240",
        "0",
    )  # simulated: counted only
    admins_see_the_slices(hub, held, browser)

    # the fifth student waits, with its place; a researcher's whole A100 waits behind it
    line = hub.spawn_waits("s5", {"gpu_share": "25%"}, "waiting for 1/4 GPU")
    # no run has ended on this hub: when a quarter frees up cannot be told yet
    assert line.startswith("1st of 1 waiting for 1/4 GPU; cannot tell yet when it starts"), line
    line = hub.spawn_waits("rita", {"gpus": 1, "gpu_model": "Simulated A100"}, "waiting for 1 GPU")
    assert line.startswith("2nd of 2 waiting for 1 GPU"), line
    r = hub.broker("GET", "queue", hub.user_token("admin"))
    assert [(q["user"], q["slice_parts"]) for q in r.json()["queue"]] == [("s5", 4), ("rita", None)]

    # a student's whole GPU, and a share that is not one slice, are refused at once
    r = hub.spawn("s6", {"gpus": 1, "gpu_model": "Simulated T4"})
    assert r.status_code == 403 and "take slices of GPUs here, not whole GPUs" in r.json()["message"], r.text
    r = hub.spawn("s6", {"gpu_share": "3/4"})
    assert r.status_code == 400 and "gpuhub does not round it" in r.json()["message"], r.text
    assert hub.server("s6") is None and ledger.active(user="s6") == []

    # s2 stops: s5 starts on the quarter given back; rita still waits (three quarters held)
    s2_slice = next(g for g, u in slices_held(ledger).items() if u == "s2")
    hub.stop_server("s2")
    hub.wait_ready("s5")
    assert slices_held(ledger)[s2_slice] == "s5"
    assert hub.server_env("s5")["GPUHUB_GPUS"] == s2_slice
    assert hub.wait_progress("rita", "1st of 1 waiting for 1 GPU")
    for user in ("s1", "s3", "s4"):
        hub.stop_server(user)
    assert ledger.active(user="rita") == []  # s5's quarter is still held
    hub.stop_server("s5")
    hub.wait_ready("rita")
    assert slices_held(ledger) == {"sim:0": "rita"}
    hub.stop_server("rita")


def test_a_student_chooses_a_slice_on_the_spawn_form(hub, ledger, browser):
    page = browser_login(browser, hub, "s6")
    page.goto(f"{hub.url}/hub/spawn")
    expect(page.locator("[data-gpuhub=slices-only]")).to_contain_text(
        "You take slices of GPUs here, not whole GPUs. You hold 0 GPUs of a limit of 1 (default)."
    )
    assert page.locator("#gpuhub-gpus").count() == 0  # no count of whole GPUs to give
    options = page.locator("#gpuhub-share option").all_inner_texts()
    assert options == ["No GPU", "1/4 GPU of Simulated A100, 10 GiB (4 of 4 free)"], options
    expect(page.locator("[data-gpuhub=slice-isolation]")).to_contain_text("a fatal GPU fault in one user")
    page.locator("#spawn_form input[type=submit], #spawn_form button[type=submit]").first.click()
    hub.wait_ready("s6")
    [a] = ledger.active(user="s6")
    assert (a.slice_parts, [g.label for g in a.gpus]) == (4, ["sim:0s1"])
    page.close()
    hub.stop_server("s6")


def test_a_students_kernel_and_jupyterlab_see_its_slice_and_a_pool_is_refused_with_the_reason(
    hub, ledger, browser
):
    assert hub.spawn("s1", {"gpu_share": "1/4"}).status_code in (201, 202)
    hub.wait_ready("s1")
    [a] = ledger.active(user="s1")
    kc = hub.server_kernel("s1")
    try:
        status, out = run_cell(kc, "%gpus")
        assert status == "ok", out
        assert (
            f"Server allocation #{a.id}: a 1/4 slice of GPU sim:0 (sim:0s1), 10240 MiB of its memory" in out
        )
        status, out = run_cell(kc, "%%distributed --gpus 1\nprint('ran')")
        assert status == "error" and "ran" not in out, out
        assert "a %%distributed pool needs whole GPUs (NCCL runs on whole GPUs)" in out, out
        assert [x.id for x in ledger.active(user="s1")] == [a.id]  # nothing taken, the slice kept
    finally:
        kc.stop_channels()
    # JupyterLab's status bar and GPU panel say the slice, not "1 GPU"
    page = browser_login(browser, hub, "s1")
    page.goto(f"{hub.url}/user/s1/lab")
    bar = page.locator(".gpuhub-status")
    expect(bar).to_contain_text("GPUs: 1/4 GPU Simulated A100", timeout=60_000)
    bar.click()
    head = page.locator(f'.gpuhub-alloc[data-allocation="{a.id}"] .gpuhub-alloc-head')
    expect(head).to_contain_text("a 1/4 GPU slice")
    page.close()
