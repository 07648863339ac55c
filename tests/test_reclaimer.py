"""The broker's idle pass (spawner/broker/reclaimer.py) against a real ledger, with the
hub's REST API and the clock replaced: which allocations it warns, reclaims, or leaves
alone, and that one allocation's trouble does not stop the pass. And NVML device lookup by
minor number, with a fake NVML (the real one is checked by benchmarks/gpu_check.py)."""

from __future__ import annotations

import asyncio
import itertools
import types
from collections import deque
from datetime import datetime
from types import SimpleNamespace

import pytest

from gpu_magics.report.gpustats import NvmlSource
from spawner.broker.metrics import Metrics
from spawner.broker.reclaimer import Reclaimer, server_url
from spawner.broker.utilization import Sample, Utilization, epoch, rate_wait
from spawner.ledger import Ledger
from spawner.policy.idle import IdleRules
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu

RULES = IdleRules(threshold=5, warn_after=60, reclaim_after=120, stale_after=30)


class FakeBroker:
    def __init__(self, ledger, clock):
        self.ledger = ledger
        self.utilization = Utilization(clock=clock)
        self.metrics = Metrics(ledger)
        self.api_url = "http://hub.invalid/hub/api"
        self.api_token = "t"
        self.groups = {}

    async def run(self, fn, *args, **kw):
        return fn(*args, **kw)

    async def groups_of(self, user):
        return self.groups.get(user, [])


@pytest.fixture
def setup(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path}/l.sqlite", config_rules=LimitRules(default=Limit(None)))
    ledger.sync_inventory([Gpu("n1", i, "A100") for i in range(4)])
    now = [0.0]
    broker = FakeBroker(ledger, lambda: now[0])
    yield ledger, broker, now
    ledger.close()


def report(broker, a, util, now, t):
    now[0] = t
    samples = [Sample(g.node, g.index, util, 0, None) for g in a.gpus]
    broker.utilization.add_samples(a, samples, RULES.threshold, RULES.stale_after)


def test_a_burst_is_warned_then_reclaimed_and_keeps_its_gpus_until_released(setup):
    ledger, broker, now = setup
    a = ledger.allocate("alice", [], 2, purpose="distributed", lease_seconds=600)
    t0 = epoch(a.started or a.created)
    r = Reclaimer(broker, RULES)
    for dt in range(0, 200, 10):
        report(broker, a, 0.0, now, t0 + dt)
        acted = asyncio.run(r.check())
        state = broker.utilization.verdicts[a.id].state
        if dt < 60:
            assert state == "active" and acted == []
        elif dt < 120:
            assert state == "warned" and acted == []
        else:
            assert state == "reclaim" and acted == [a.id]
            break
    [rec] = ledger.reclaims()
    assert rec.allocation_id == a.id and rec.idle_seconds == 120
    assert ledger.get(a.id).state == "running"  # held until the kernel stops the engines
    asyncio.run(r.check())  # a second pass: recorded once, counted once
    assert len(ledger.reclaims()) == 1
    assert broker.metrics.reclaims.labels(purpose="distributed")._value.get() == 1


def test_a_gpu_that_never_reported_makes_the_allocation_unknown(setup):
    ledger, broker, now = setup
    a = ledger.allocate("alice", [], 2, purpose="distributed", lease_seconds=600)
    t0 = epoch(a.started or a.created)
    only_one = types.SimpleNamespace(**{**a.__dict__, "gpus": a.gpus[:1]})
    r = Reclaimer(broker, RULES)
    for dt in range(0, 400, 10):  # one engine reports, the other never does
        report(broker, only_one, 0.0, now, t0 + dt)
        assert asyncio.run(r.check()) == []
    assert broker.utilization.verdicts[a.id].state == "unknown"
    assert ledger.reclaims() == []


def test_the_last_holders_readings_do_not_count_for_the_next(setup):
    ledger, broker, now = setup
    old = ledger.allocate("bob", [], 1, purpose="distributed", lease_seconds=600)
    report(broker, old, 90.0, now, epoch(old.created) - 1)
    ledger.release(old.id)
    new = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=600)
    assert new.gpus == old.gpus
    now[0] = epoch(new.created) + 1
    assert broker.utilization.latest("n1", new.gpus[0].index, 30, since=epoch(new.created)) is None
    asyncio.run(Reclaimer(broker, RULES).check())
    assert broker.utilization.verdicts[new.id].state == "unknown"


def test_one_allocations_failure_does_not_end_the_pass(setup, monkeypatch):
    ledger, broker, now = setup
    bad = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=600)
    good = ledger.allocate("dave", [], 1, purpose="distributed", lease_seconds=600)
    t0 = epoch(good.created)
    r = Reclaimer(broker, IdleRules(**{**RULES.__dict__, "exempt_groups": frozenset({"x"})}))

    async def groups_of(user):
        if user == "alice":
            raise RuntimeError("the hub answered nonsense")
        return []

    monkeypatch.setattr(broker, "groups_of", groups_of)
    for dt in range(0, 80, 10):
        report(broker, bad, 0.0, now, t0 + dt)
        report(broker, good, 0.0, now, t0 + dt)
        asyncio.run(r.check())
    assert bad.id not in broker.utilization.verdicts
    assert broker.utilization.verdicts[good.id].state == "warned"


def test_server_urls():
    assert server_url("http://h/hub/api/", "al ice", "") == "http://h/hub/api/users/al%20ice/server"
    assert server_url("http://h/hub/api", "bob", "big one") == "http://h/hub/api/users/bob/servers/big%20one"


class FakeNvml:
    class NVMLError(Exception):
        pass

    def __init__(self, minors):
        self.minors = minors  # what NVML sees, in its own order: their minor numbers

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.minors)

    def nvmlDeviceGetHandleByIndex(self, i):
        if i >= len(self.minors):
            raise self.NVMLError("Invalid Argument")
        return ("handle", i)

    def nvmlDeviceGetMinorNumber(self, h):
        return self.minors[h[1]]


@pytest.mark.parametrize(
    "by_minor, minors, index, handle",
    [
        (True, [0, 1, 2, 3], 2, ("handle", 2)),  # a whole Slurm node
        (True, [2, 3], 2, ("handle", 0)),  # a Slurm job with GPUs 2 and 3, numbered from 0 by NVML
        (True, [3], 3, ("handle", 0)),
        (True, [5, 6], 1, ("handle", 1)),  # no minor matches: NVML's own index
        (False, [1, 0, 3, 2], 2, ("handle", 2)),  # local: NVML's (PCI) index, whatever the minors
    ],
)
def test_nvml_finds_a_gpu_by_its_machine_number(by_minor, minors, index, handle):
    assert NvmlSource(FakeNvml(minors), by_minor=by_minor).handle(index) == handle


def test_the_numbering_follows_the_backend(monkeypatch):
    monkeypatch.setenv("GPUHUB_BACKEND", "slurm")
    assert NvmlSource(FakeNvml([2, 3])).handle(3) == ("handle", 1)
    monkeypatch.delenv("GPUHUB_BACKEND")
    assert NvmlSource(FakeNvml([0, 1, 3, 2])).handle(3) == ("handle", 3)


def test_a_gpu_nvml_cannot_see_is_a_clear_error():
    from gpu_magics.report.gpustats import NvmlUnavailable

    with pytest.raises(NvmlUnavailable, match=r"GPU 3 is not visible to NVML here .*NVML sees 1 GPU"):
        NvmlSource(FakeNvml([0]), by_minor=True).handle(3)


def test_an_engine_is_pinned_to_its_gpus_cpus_within_what_it_may_use(monkeypatch):
    """gpu_magics.engine.rank.pin_to_gpu with NVML's affinity faked (the real one is in gpu_check)."""
    import os

    from gpu_magics.engine import rank as engine
    from gpu_magics.report import gpustats

    allowed = sorted(os.sched_getaffinity(0))
    calls = []

    class Source:
        def __init__(self):
            pass

        def cpu_affinity(self, index):
            calls.append(index)
            return [allowed[-1], 10_000]  # one CPU we may use, one we may not

        def close(self):
            pass

    monkeypatch.setattr(gpustats, "NvmlSource", Source)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(set(cpus)))
    monkeypatch.delenv("GPUHUB_GPU_SOURCE", raising=False)
    assert engine.pin_to_gpu("n1:3") is True
    assert calls == [3, {allowed[-1]}]
    monkeypatch.setenv("GPUHUB_GPU_SOURCE", "simulated")  # no topology: left alone
    assert engine.pin_to_gpu("n1:3") is False and len(calls) == 2

    def no_nvml():
        raise gpustats.NvmlUnavailable("no driver")

    monkeypatch.setenv("GPUHUB_GPU_SOURCE", "nvml")
    monkeypatch.setattr(gpustats, "NvmlSource", no_nvml)
    assert engine.pin_to_gpu("n1:3") is False and len(calls) == 2


def test_a_reclaim_decided_on_old_news_is_undone_by_use(setup):
    """The kernel's activity reaches the broker only with its renewals: a burst reclaimed
    while a cell had just started is renewed again, and the reclaim forgotten."""
    from datetime import timedelta

    ledger, _broker, _now = setup
    a = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=600)
    rec = ledger.record_reclaim(a.id, 120, "idle")
    with pytest.raises(LookupError, match="was reclaimed: idle"):
        ledger.renew(a.id, 600)  # no news of use
    with pytest.raises(LookupError, match="was reclaimed"):  # used before the idle time began
        ledger.renew(a.id, 600, active_at=rec.created - timedelta(seconds=121))
    ledger.renew(a.id, 600, active_at=rec.created - timedelta(seconds=30))  # used during it
    assert ledger.reclaims() == [] and ledger.get(a.id).state == "running"


def test_the_idle_pass_undoes_a_reclaim_when_the_gpus_turn_busy(setup):
    ledger, broker, now = setup
    a = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=600)
    t0 = epoch(a.started or a.created)
    r = Reclaimer(broker, RULES)
    for dt in range(0, 130, 10):
        report(broker, a, 0.0, now, t0 + dt)
        asyncio.run(r.check())
    assert len(ledger.reclaims()) == 1
    report(broker, a, 80.0, now, t0 + 130)  # its engines are busy again before it ended
    asyncio.run(r.check())
    assert broker.utilization.verdicts[a.id].state == "active"
    assert ledger.reclaims() == []
    ledger.renew(a.id, 600)  # renewed again


def test_a_burst_reporter_posts_its_gpus_until_the_allocation_is_released(tmp_path):
    """gpu_magics.report.reporter.start_burst_reporter (engines, and %dask_cuda's kernel) against a
    small HTTP server standing in for the broker: the body, the token, and the stop on 409."""
    import json
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gpu_magics.report.reporter import start_burst_reporter

    posts = []

    class Broker(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append((self.path, self.headers["Authorization"], body))
            code = 409 if len(posts) >= 3 else 200
            answer = {"message": "released"} if code == 409 else {"idle": {"state": "active"}}
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Broker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stats = tmp_path / "u.json"
    stats.write_text(json.dumps({"n1:2": {"utilization": 40, "memory_used_mib": 5}}))
    env = {
        "GPUHUB_BROKER_URL": f"http://127.0.0.1:{server.server_port}/api/v1/",
        "JUPYTERHUB_API_TOKEN": "secret",
        "GPUHUB_GPU_SOURCE": "simulated",
        "GPUHUB_SIMULATED_GPU_STATS": str(stats),
        "GPUHUB_REPORT_SECONDS": "0.2",
    }
    try:
        reporter = start_burst_reporter(7, ["n1:2", "n1:3"], env)
        deadline = time.monotonic() + 20
        while not reporter.stopped and time.monotonic() < deadline:
            time.sleep(0.05)  # polling a condition with a deadline
        assert reporter.stopped  # the 409 (released) ended it
        assert len(posts) == 3
        path, auth, body = posts[0]
        assert (path, auth) == ("/api/v1/allocations/7/samples", "token secret")
        assert [(g["node"], g["index"], g["utilization"]) for g in body["gpus"]] == [
            ("n1", 2, 40.0),
            ("n1", 3, 0.0),
        ]
        assert body["source"] == "simulated" and "idle_seconds" not in body
        # no broker configured: nothing starts
        assert start_burst_reporter(7, ["n1:2"], {"GPUHUB_GPU_SOURCE": "simulated"}) is None
    finally:
        server.shutdown()


# bounded memory: the per-GPU history and the per-allocation report rate


@pytest.mark.parametrize(
    "times, now, limit, wait, kept",
    [
        ([], 100.0, 2, 0.0, [100.0]),
        ([50.0], 100.0, 2, 0.0, [50.0, 100.0]),
        ([50.0, 70.0], 100.0, 2, 10.0, [50.0, 70.0]),  # full: wait until 50 leaves the window
        ([30.0, 70.0], 100.0, 2, 0.0, [70.0, 100.0]),  # 30 is a minute old: it left
        ([40.0, 70.0], 100.0, 2, 0.0, [70.0, 100.0]),  # exactly a minute: gone
    ],
)
def test_rate_wait(times, now, limit, wait, kept):
    q = deque(times)
    assert rate_wait(q, now, limit) == pytest.approx(wait)
    assert list(q) == kept


def test_a_fast_reporter_keeps_one_reading_per_interval():
    t = [0.0]
    util = Utilization(history_seconds=10.0, clock=lambda: t[0], min_interval=1.0)
    a = SimpleNamespace(
        id=1, user="alice", purpose="server", gpu_count=1, gpus=(), started=None, created=datetime(2026, 1, 1)
    )
    for step in range(200):  # 10 reports a second for 20 s
        t[0] = step / 10
        util.add_samples(a, [Sample("n1", 0, float(step), 0, None)], 50.0, 60.0)
    history = util.history("n1", 0)
    assert util.latest("n1", 0, 60.0).utilization == 199.0  # the newest always shows
    assert len(history) <= 10 / 1.0 + 2
    assert all(b.t - a.t >= 1.0 for a, b in itertools.pairwise(history[:-1]))
