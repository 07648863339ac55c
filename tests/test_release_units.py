"""GPUs back when they stop being used, the parts without a hub: the guard file a kernel keeps
of what it holds, the reaper's decisions on it, and the ledger's release of a stopped server
with every burst its kernels asked for (SQLite and PostgreSQL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import datetime

import pytest

from gpu_magics.common import guard
from gpu_magics.launch import reaper
from spawner.ledger import Ledger, QueueSettings
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu

from .ledgertools import Clock


@pytest.mark.parametrize(
    "alive, released, listed, want",
    [
        (False, set(), set(), "release"),  # the kernel is gone: give back what it listed
        (False, {3}, {3}, "release"),
        (True, set(), {3}, "wait"),  # nothing ended
        (True, {3}, set(), "wait"),  # ended, but the kernel unlisted it first: its own release
        (True, {3}, {3}, "stop"),  # the hub ended it and the kernel did not act: stop the pool
        (True, {3, 4}, {4}, "stop"),
    ],
)
def test_decide(alive, released, listed, want):
    assert guard.decide(alive, released, listed) == want


@pytest.mark.parametrize(
    "content, want",
    [
        (None, set()),  # no file
        ("", set()),
        ("not json", set()),
        ('{"allocations": [1, 2]}', {1, 2}),
        ('{"allocations": [1, "2", true, 2.5]}', {1}),  # only whole numbers
        ('{"allocations": 3}', set()),
        ("[1, 2]", set()),
    ],
)
def test_read_takes_only_what_it_can_trust(tmp_path, content, want):
    path = tmp_path / "held.json"
    if content is not None:
        path.write_text(content)
    assert guard.read(path) == want


def test_the_guard_file_lists_what_is_held_and_is_private(tmp_path):
    g = guard.Guard(tmp_path)
    g.add(7)
    g.add(9)
    assert json.loads(g.path.read_text()) == {"allocations": [7, 9]}
    g.remove(7)
    g.remove(12)  # not held: nothing happens
    assert guard.read(g.path) == {9} == g.ids
    made = guard.kernel_guard()
    assert made is guard.kernel_guard() and guard.current_path() == str(made.path)
    assert (made.directory.stat().st_mode & 0o777) == 0o700


class Broker:
    """The broker as the reaper sees it: allocation states, and what it was told."""

    def __init__(self, states: dict[int, str]):
        self.states = states
        self.released: list[tuple[int, str | None]] = []

    def get(self, allocation_id: int) -> dict:
        return {"id": allocation_id, "state": self.states[allocation_id]}

    def release(self, allocation_id: int, why: str | None = None) -> None:
        self.released.append((allocation_id, why))
        self.states[allocation_id] = "released"


def sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_reaper_gives_back_what_a_dead_kernel_held(tmp_path):
    g = guard.Guard(tmp_path)
    g.add(5)
    g.add(6)
    broker, engine = Broker({5: "running", 6: "running"}), sleeper()
    assert reaper.watch(dead_pid(), [engine.pid], interval=0.1, guard_path=str(g.path), client=broker)
    assert engine.wait(10) is not None  # the engine was ended first
    assert broker.released == [(5, "kernel_gone"), (6, "kernel_gone")]


def test_the_reaper_stops_a_pool_whose_allocation_the_hub_ended(tmp_path, monkeypatch):
    monkeypatch.setattr(reaper, "GRACE_SECONDS", 0.5)
    monkeypatch.setattr(reaper, "CHECK_SECONDS", 0.1)
    g = guard.Guard(tmp_path)
    g.add(5)
    broker, engine = Broker({5: "released"}), sleeper()
    started = time.monotonic()
    assert reaper.watch(
        subprocess.os.getpid(), [engine.pid], interval=0.1, guard_path=str(g.path), client=broker
    )
    assert engine.wait(10) is not None and time.monotonic() - started >= 0.5  # after the grace
    assert broker.released == []  # the kernel lives: it is not the reaper's to release


def test_the_reaper_leaves_a_pool_whose_kernel_acted_on_the_end(tmp_path, monkeypatch):
    monkeypatch.setattr(reaper, "GRACE_SECONDS", 0.3)
    monkeypatch.setattr(reaper, "CHECK_SECONDS", 0.1)
    g = guard.Guard(tmp_path)
    g.add(5)
    g.remove(5)  # the kernel unlisted it (it acts on the notice) before the hub ended it
    broker, engine = Broker({5: "released"}), sleeper()
    try:
        found = {}

        def run():
            found["stopped"] = reaper.watch(
                subprocess.os.getpid(), [engine.pid], interval=0.1, guard_path=str(g.path), client=broker
            )

        import threading

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(2.0)  # many grace periods
        assert t.is_alive() and engine.poll() is None  # still watching; the engine runs
    finally:
        engine.kill()
        engine.wait()
    t.join(5)
    assert found == {"stopped": False}  # it ended on its own: nothing for the reaper to do


T = datetime(2026, 12, 4, 9, 0)
INV = [Gpu("n1", i, "A100") for i in range(4)]


@pytest.fixture
def led(db_url):
    ledger = Ledger(
        db_url,
        config_rules=LimitRules(default=Limit(max_gpus=5)),
        clock=Clock(T),
        queue=QueueSettings(keepalive_seconds=3600),
    )
    ledger.sync_inventory(INV)
    yield ledger
    ledger.close()


def test_a_stopped_server_gives_back_its_gpus_and_its_kernels_bursts(led):
    own = led.allocate("alice", [], 1, server_name="lab")
    burst = led.allocate(
        "alice", [], 1, purpose="distributed", lease_seconds=300, server_name="lab", of_server=True
    )
    other_server = led.allocate(
        "alice", [], 1, purpose="distributed", lease_seconds=300, server_name="", of_server=True
    )
    not_a_servers = led.allocate("alice", [], 1, purpose="distributed", lease_seconds=300)  # a script's
    assert burst.of_server and not not_a_servers.of_server
    waits = led.request(
        "alice", [], 1, purpose="distributed", lease_seconds=300, server_name="lab", of_server=True
    )
    assert waits.entry is not None and waits.allocation is None  # every GPU is taken
    assert led.release_server("alice", "lab", own.id, "server stopped") == [own.id, burst.id]
    assert led.get(burst.id).end_reason == "server stopped"
    assert {a.id for a in led.active(user="alice")} == {other_server.id, not_a_servers.id}
    assert led.queue_entry(waits.entry.id).state == "left"
    assert led.release_server("alice", "lab", own.id, "server stopped") == []  # once
    assert led.release_server("bob", "", 0, "server stopped") == []  # nothing of bob's: no write


def test_a_burst_that_waited_keeps_its_server_when_granted(led):
    held = led.allocate("bob", [], 4)
    waits = led.request(
        "alice", [], 2, purpose="distributed", lease_seconds=300, server_name="lab", of_server=True
    )
    led.release(held.id, "done")
    got = led.wait_turn(waits.entry.id)
    assert got.allocation is not None and got.allocation.of_server and got.allocation.server_name == "lab"
    assert led.release_server("alice", "lab", 0, "server exited") == [got.allocation.id]


def _ended_pool(pids):
    """An ``EnginePool``'s parts that the end checks read: its ranks' pids here, watched by
    their pidfds as the pool watches them (``ExitWatch``)."""
    from types import SimpleNamespace

    from gpu_magics.common.ranks import Slot, make_rank_specs
    from gpu_magics.kernel.pool import EnginePool

    pool = SimpleNamespace(
        _remote=False,
        _exits=None,
        infos=[{"pid": p} for p in pids],
        specs=make_rank_specs([Slot("vm", i) for i in range(len(pids))], "127.0.0.1", 1),
        client=None,  # a shrink that asked the engines would fail on it
    )
    pool._ended = lambda: EnginePool._ended(pool)  # the pool's own pidfd watch (ExitWatch)
    pool.ended_for_sure = lambda: EnginePool.ended_for_sure(pool)
    return pool


# a killed engine's main thread ends first; its pidfd is readable only once its last thread has
# (a torch process's teardown, under load, takes a while): this one's main thread ends and a
# thread of it runs on, as such an engine's does for that while
LEADER_GONE = (
    "import ctypes, threading, time\n"
    "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
    "ctypes.CDLL(None).syscall(60, 0)  # SYS_exit: this thread only\n"
)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="SYS_exit is syscall 60 on x86_64 only")
def test_an_engine_whose_main_thread_ended_counts_as_ended_before_its_pidfd_says_so():
    """The check a preemption notice makes when the kernel resumes (``engines_gone``) and a
    shrink's check of the ranks that stay see an engine ended once its main thread has,
    where the pidfd watch alone would wait on it (a shrink then waited 60 s on a dead rank 0)."""
    from types import SimpleNamespace

    from gpu_magics.common.procs import alive
    from gpu_magics.kernel import resize
    from gpu_magics.kernel.preemption import Notice, Preemption

    from .hubtools import wait_for

    dying = subprocess.Popen([sys.executable, "-c", LEADER_GONE])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_for(lambda: not alive(dying.pid), 30, "the main thread to end (a zombie)")
        pool = _ended_pool([dying.pid, live.pid])
        assert pool._ended() == set()  # the pidfd: not yet
        assert pool.ended_for_sure() == {0}
        # a shrink that would keep the dead rank 0 says so at once, asking no engine
        with pytest.raises(resize.ShrinkFailed, match="the engine of rank 0, which would stay, has ended"):
            resize.shrink(pool, [1])
        # with every engine gone, a notice finds nothing to keep or save: it is done with, and
        # the cell's own check says what was lost (not a shrink that waits on dead engines)
        for pids, gone in (([dying.pid, live.pid], False), ([dying.pid, dying.pid], True)):
            notice = Notice(part=None, reason="preempted", due=time.time())
            preemption = Preemption(SimpleNamespace(pool=_ended_pool(pids)), None, None)
            assert preemption.engines_gone(notice) is gone and notice.acted is gone
    finally:
        for p in (dying, live):
            p.kill()
            p.wait()
