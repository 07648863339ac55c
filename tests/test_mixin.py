"""The spawner mixin's lifecycle on a real ledger, with the hub-side parts stubbed."""

import asyncio
import signal
import subprocess
import threading
from types import SimpleNamespace

import pytest
from jupyterhub.spawner import Spawner
from traitlets.config import Config

from spawner.spawners.base import STATE_KEY
from spawner.spawners.local import LocalGpuMixin


class StubBackend(Spawner):
    """A backend that starts nothing (the ledger side is what is under test)."""

    started = False

    async def start(self):
        self.started = True
        return ("127.0.0.1", 1)

    async def stop(self, now=False):
        raise RuntimeError("the backend failed to stop")

    async def poll(self):
        return None


class GpuStub(LocalGpuMixin, StubBackend):
    pid = 0


@pytest.fixture
def make_spawner(tmp_path):
    cfg = Config()
    cfg.GpuHub.db_url = f"sqlite:///{tmp_path / 'gpuhub.sqlite'}"
    cfg.GpuHub.inventory = "simulated"
    cfg.GpuHub.simulated_gpus = [{"node": "n1", "count": 4}]
    cfg.GpuHub.default_limit = 4

    def make():
        user = SimpleNamespace(name="alice", groups=[], url="/user/alice/")
        return GpuStub(config=cfg, user=user, hub=SimpleNamespace())

    return make


async def test_a_spawn_cancelled_during_admission_gives_the_gpus_back(make_spawner, monkeypatch):
    sp = make_spawner()
    sp.user_options = {"gpus": 2}
    ledger = await asyncio.to_thread(lambda: sp.ledger)
    entered, proceed = threading.Event(), threading.Event()
    real = ledger.request  # a local spawn asks to be admitted or queued

    def slow_request(*args, **kw):
        entered.set()
        proceed.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(ledger, "request", slow_request)
    task = asyncio.ensure_future(sp.start())
    await asyncio.to_thread(entered.wait, 10)
    task.cancel()  # JupyterHub's stop or start_timeout, while the ledger is committing
    with pytest.raises(asyncio.CancelledError):
        await task  # at once: JupyterHub's stop answers 500 if a cancelled start is still pending
    assert not proceed.is_set()
    proceed.set()
    await sp._settle_cancelled()
    assert not sp.started
    assert not any(st.holder for st in ledger.gpu_table()), "the cancelled spawn still holds GPUs"
    assert ledger.active() == []


async def test_a_failing_backend_stop_still_releases(make_spawner):
    sp = make_spawner()
    sp.user_options = {"gpus": 1}
    await sp.start()
    assert sp.get_state()[STATE_KEY] == sp.allocation_id
    ledger = sp.ledger
    assert len(ledger.active()) == 1
    with pytest.raises(RuntimeError):
        await sp.stop()
    assert ledger.active() == []
    sp.clear_state()
    assert STATE_KEY not in sp.get_state()


async def test_a_stale_allocation_is_released_on_the_next_start(make_spawner):
    sp = make_spawner()
    sp.user_options = {"gpus": 1}
    await sp.start()
    first = sp.allocation_id
    again = make_spawner()
    again.load_state({STATE_KEY: first})  # the hub restarted between start and stop
    again.user_options = {"gpus": 1}
    await again.start()
    ledger = sp.ledger
    assert ledger.get(first).state == "released" and ledger.get(first).end_reason == "replaced by a new start"
    assert [a.id for a in ledger.active()] == [again.allocation_id]


def hold_every_gpu(ledger):
    return ledger.allocate("bob", [], 4, purpose="server")


async def start_waiting(sp, ledger):
    """``sp``'s start for 1 GPU, waiting in the queue behind bob's 4 GPUs; its entry."""
    sp.user_options = {"gpus": 1}
    sp.gpuhub.queue_poll_seconds = 0.05
    task = asyncio.ensure_future(sp.start())
    while not ledger.queue():
        await asyncio.sleep(0.02)
    [entry] = ledger.queue()
    return task, entry.id


def blocked(monkeypatch, ledger, method):
    """Make ``ledger.method`` wait (in its worker thread) until the test lets it go on."""
    entered, proceed = threading.Event(), threading.Event()
    real = getattr(ledger, method)

    def slow(*args, **kw):
        entered.set()
        proceed.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(ledger, method, slow)
    return entered, proceed


async def test_a_start_stopped_in_the_queue_ends_at_once_and_leaves_the_queue_after(
    make_spawner, monkeypatch
):
    sp = make_spawner()
    ledger = await asyncio.to_thread(lambda: sp.ledger)
    hold_every_gpu(ledger)
    task, entry = await start_waiting(sp, ledger)
    entered, proceed = blocked(monkeypatch, ledger, "leave_queue")
    task.cancel()  # the stop button while it waits
    with pytest.raises(asyncio.CancelledError):
        await task  # at once, though the ledger has not written its leaving yet
    assert ledger.queue_entry(entry).state == "waiting"
    await asyncio.to_thread(entered.wait, 10)
    proceed.set()
    await sp._settle_cancelled()
    left = ledger.queue_entry(entry)
    assert (left.state, left.end_reason) == ("left", "the server was stopped while it waited")
    assert not sp.started


async def test_a_grant_in_flight_when_the_start_is_stopped_is_given_back(make_spawner, monkeypatch):
    sp = make_spawner()
    ledger = await asyncio.to_thread(lambda: sp.ledger)
    bobs = hold_every_gpu(ledger)
    task, entry = await start_waiting(sp, ledger)
    entered, proceed = blocked(monkeypatch, ledger, "wait_turns")
    await asyncio.to_thread(entered.wait, 10)
    ledger.release(bobs.id, "test")  # alice's turn: the ask in flight books her GPU
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    proceed.set()
    await sp._settle_cancelled()
    granted = ledger.queue_entry(entry)
    assert granted.state == "granted", granted
    assert ledger.get(granted.allocation_id).end_reason == "the server was stopped while it waited"
    assert ledger.active() == [], "a grant booked for a stopped start was kept"
    assert not sp.started


class HangingStop(StubBackend):
    """A backend whose stop waits (a server slow to end its kernels)."""

    async def stop(self, now=False):
        await asyncio.Event().wait()


class GpuHanging(LocalGpuMixin, HangingStop):
    pid = 0


async def test_a_stop_cut_short_ends_the_server_before_its_gpus_are_given_back(make_spawner):
    """The hub shutting down cancels a stop in flight: the server must not keep running on
    GPUs the ledger gives back (a soak's hub restart left one running, found by tests/test_soak.py)."""
    sp = make_spawner()
    hanging = GpuHanging(config=sp.config, user=sp.user, hub=sp.hub)
    hanging.user_options = {"gpus": 1}
    await hanging.start()
    server = subprocess.Popen(["sleep", "60"])
    try:
        hanging.pid = server.pid
        stop = asyncio.ensure_future(hanging.stop())
        await asyncio.sleep(0.2)  # in the backend's stop
        assert hanging.ledger.active() != []
        stop.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stop
        assert server.wait(10) == -signal.SIGKILL
        assert hanging.ledger.active() == []
    finally:
        server.kill()
        server.wait()


class HangingStart(StubBackend):
    """A backend whose server process is up but whose start has not returned yet."""

    process: subprocess.Popen | None = None

    async def start(self):
        self.process = subprocess.Popen(["sleep", "60"])
        self.pid = self.process.pid
        await asyncio.Event().wait()


class GpuHangingStart(LocalGpuMixin, HangingStart):
    pid = 0


async def test_a_start_cut_short_ends_the_server_it_began_before_its_gpus_are_given_back(make_spawner):
    sp = make_spawner()
    starting = GpuHangingStart(config=sp.config, user=sp.user, hub=sp.hub)
    starting.user_options = {"gpus": 1}
    start = asyncio.ensure_future(starting.start())
    try:
        while starting.process is None:
            await asyncio.sleep(0.05)
        assert starting.ledger.active() != []
        start.cancel()  # the hub shutting down while the server starts
        with pytest.raises(asyncio.CancelledError):
            await start
        assert starting.process.wait(10) == -signal.SIGKILL
        await starting._settle_cancelled()
        assert starting.ledger.active() == []
    finally:
        if starting.process is not None:
            starting.process.kill()
            starting.process.wait()


async def test_a_hubs_waiting_starts_ask_the_ledger_together_once_a_poll(make_spawner, monkeypatch):
    """Five starts waiting at once: one ledger call a round for all of them (a storm's hundred
    waiters made a hundred reads a second), and each still gets its own place; when GPUs free,
    the head of the queue starts."""
    first = make_spawner()
    ledger = await asyncio.to_thread(lambda: first.ledger)
    bobs = hold_every_gpu(ledger)
    calls = []
    real = ledger.wait_turns

    def counted(ids):
        calls.append(sorted(ids))
        return real(ids)

    monkeypatch.setattr(ledger, "wait_turns", counted)
    spawners, tasks = [], []
    for i in range(5):
        sp = first if i == 0 else make_spawner()
        sp.user = SimpleNamespace(name=f"s{i}", groups=[], url=f"/user/s{i}/")
        sp.user_options = {"gpus": 1}
        sp.gpuhub.queue_poll_seconds = 0.2
        spawners.append(sp)
        tasks.append(asyncio.ensure_future(sp.start()))
        while len(ledger.queue()) < i + 1:
            await asyncio.sleep(0.02)
    calls.clear()
    while len(calls) < 3:
        await asyncio.sleep(0.05)
    entries = {q.user: q.id for q in ledger.queue()}
    assert calls[1:3] == [sorted(entries.values())] * 2  # every waiter in each round's one call
    places = [ev for ev in spawners[4]._gpuhub_events if "waiting" in ev.get("message", "")]
    assert "5th of 5 waiting" in places[-1]["message"], places[-1]
    ledger.release(bobs.id, "test")  # 4 GPUs free: the first four start, in the queue's order
    _, pending = await asyncio.wait(tasks[:4], timeout=30)
    assert not pending and all(sp.started for sp in spawners[:4])
    assert [q.user for q in ledger.queue()] == ["s4"]
    tasks[4].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[4]
    await spawners[4]._settle_cancelled()
    assert ledger.queue() == []
