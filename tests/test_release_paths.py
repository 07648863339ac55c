"""GPUs come back the moment they stop being used, end to end: a real hub and proxy with 4
simulated GPUs, real servers and kernels, real engines (gloo on CPU), the real broker.

- alice's server is stopped (REST, as the home page's button and the culler do) while its
  kernel's pool holds a burst: the burst is released with the server, not by its lease.
- alice's kernel is killed outright (SIGKILL) with a pool up: the pool's reaper ends the
  engines and gives the burst back within seconds, saying why.
- alice's kernel is paused (SIGSTOP) with borrowed GPUs in its pool when bob's in-limit spawn
  waits for them: the notice falls due, the ledger ends the borrowed part at its due time, bob's
  server starts, and the reaper stops the paused kernel's engines; resumed, the kernel says
  what happened.

Every wait here is for a release well inside the broker's lease (300 s): a release that fell
back on the lease would fail the test.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from spawner.ledger import Ledger

from .hubtools import Hub, kernel_process, wait_for
from .kerneltools import BrokerKernel
from .kerneltools import run_cell as run

pytestmark = pytest.mark.hub

CONFIG = """
c.GpuHub.default_limit = 2
c.GpuHub.group_limits = {}
c.GpuHub.user_limits = {}
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = 20
c.GpuHub.queue_keepalive_seconds = 20
"""
LEASE = 300  # the broker's default lease: what a release must not wait for
PIDS = "%%distributed --gpus {n}\nimport os\nprint('pid', os.getpid())"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("release-hub"), extra_config=CONFIG).start().wait_for_broker()
    yield h
    h.stop()


@pytest.fixture
def ledger(hub):
    led = Ledger(hub.ledger_url)
    yield led
    for user in ("alice", "bob"):
        if hub.server(user) is not None:
            hub.stop_server(user)
    led.close()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def server_kernel(hub, user: str):
    """``hub.server_kernel`` with the kernel's id, for its process."""
    from jupyter_client import BlockingKernelClient

    r = hub.api_url_request("POST", f"/user/{user}/api/kernels", json={"name": "python3-gpus"})
    assert r.status_code == 201, r.text
    kid = r.json()["id"]
    pid, conn = kernel_process(kid)
    kc = BlockingKernelClient(connection_file=conn)
    kc.load_connection_file()
    # no heartbeat channel: a client that does not own the kernel reads one heartbeat late
    # by 1 s (a busy 2-core machine) as "the kernel died"; kernel_info's reply says it is up
    kc.start_channels(hb=False)
    kc.wait_for_ready(timeout=60)
    return kc, pid


def burst_of(ledger, user: str):
    [burst] = [a for a in ledger.active(user=user) if a.purpose == "distributed"]
    return burst


def test_a_stopped_server_gives_back_its_kernels_burst_with_it(hub, ledger):
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    kc, _ = server_kernel(hub, "alice")
    status, out = run(kc, PIDS.format(n=2))
    assert status == "ok", out
    engines = [int(p) for p in re.findall(r"\] pid (\d+)", out)]
    burst = burst_of(ledger, "alice")
    assert burst.of_server and burst.server_name == "" and burst.lease_expires is not None
    kc.stop_channels()
    hub.stop_server("alice")  # the home page's "Stop My Server" is this request
    wait_for(lambda: ledger.get(burst.id).state == "released", 30, "the burst to be released with the server")
    assert ledger.get(burst.id).end_reason == "server stopped"
    assert ledger.active(user="alice") == []
    wait_for(lambda: not any(alive(p) for p in engines), 30, "the engines to end")


def test_a_killed_kernel_gives_its_burst_back_through_the_reaper(hub, ledger):
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [server] = ledger.active(user="alice")
    kc, kernel = server_kernel(hub, "alice")
    status, out = run(kc, PIDS.format(n=2))
    assert status == "ok", out
    engines = [int(p) for p in re.findall(r"\] pid (\d+)", out)]
    burst = burst_of(ledger, "alice")
    kc.stop_channels()
    os.kill(kernel, signal.SIGKILL)  # the OOM killer, or a crash in native code
    wait_for(lambda: ledger.get(burst.id).state == "released", 30, "the reaper to give the burst back")
    assert ledger.get(burst.id).end_reason == "its kernel ended (given back by the pool's reaper)"
    wait_for(lambda: not any(alive(p) for p in engines), 30, "the engines to end")
    assert [a.id for a in ledger.active(user="alice")] == [server.id]  # the server lives on


def test_a_paused_kernels_borrowed_gpus_end_at_the_due_time_and_the_waiter_starts(hub, ledger, tmp_path):
    kernel = BrokerKernel(hub, tmp_path, "alice")
    try:
        out = kernel.run("%config DistributedMagics.notice_check_seconds = 1")
        assert out["status"] == "ok", out["text"]
        out = kernel.run(PIDS.format(n=4))
        assert out["status"] == "ok", out["text"]
        engines = [int(p) for p in re.findall(r"\] pid (\d+)", out["text"])]
        held = sorted(ledger.active(user="alice"), key=lambda a: a.borrowed)
        assert [(len(a.gpus), a.borrowed) for a in held] == [(2, 0), (2, 2)]
        in_limit, borrowed = held
        pid = kernel.km.provisioner.process.pid
        os.kill(pid, signal.SIGSTOP)  # paused: it renews nothing, and acts on no notice
        try:
            assert hub.spawn("bob", {"gpus": 2}).status_code == 202  # waits for alice's borrowed GPUs
            wait_for(lambda: ledger.get(borrowed.id).preempt_due is not None, 30, "the notice")
            due = ledger.get(borrowed.id).preempt_due
            # the notice's due time ends the borrowed part, whatever its lease; bob starts on it
            hub.wait_ready("bob", timeout=90)
            ended = ledger.get(borrowed.id)
            assert ended.state == "released" and ended.ended is not None and ended.ended >= due, ended
            assert (ended.ended - due).total_seconds() < LEASE / 10, (ended.ended, due)
            assert "preempted" in ended.end_reason or "taken back" in ended.end_reason, ended.end_reason
            # the paused kernel's engines are stopped by its reaper, not left on bob's GPUs
            wait_for(lambda: not any(alive(p) for p in engines), 40, "the paused kernel's engines to end")
            assert alive(pid)  # the kernel itself is the user's: it is only paused
        finally:
            os.kill(pid, signal.SIGCONT)
        out = kernel.run(PIDS.format(n=2), timeout=120)
        text = out["text"]
        # resumed, the kernel asks the broker before the cell: it says which allocation ended,
        # when and why, and what was lost; the cell runs on a new pool within the limit
        assert out["status"] == "ok", text
        assert (
            f"the pool lost its burst allocation: allocation #{borrowed.id} (2 borrowed GPUs) ended at "
            in text
        ), text
        assert "taken back for another user's request within its limit" in text, text
        assert "what the old pool's ranks held is lost with its engines" in text, text
        assert len(re.findall(r"\] pid (\d+)", text)) == 2, text
        [old] = [a for a in ledger.active(user="alice") if a.id == in_limit.id] or [None]
        assert old is None, "the lost pool's in-limit part is given back with it"
    finally:
        kernel.close()
