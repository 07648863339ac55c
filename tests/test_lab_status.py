"""JupyterLab's GPU status document and its events (gpu_magics.lab.status), and the simulated
GPUs whose use follows their processes (gpu_magics.report.simload): pure, table-tested."""

import os
import subprocess
from datetime import datetime, timedelta

import pytest

from gpu_magics.common import poolstatus
from gpu_magics.lab import status
from gpu_magics.report import simload

NOW = datetime(2026, 12, 7, 12, 0, 0)


def iso(t):
    return t.isoformat() + "Z"


def alloc(aid, purpose="server", server="", gpus=((("n1", 0)),), **kw):
    return {
        "id": aid,
        "purpose": purpose,
        "server_name": server,
        "state": "running",
        "gpu_count": len(gpus),
        "nodes": sorted({n for n, _ in gpus}),
        "gpus": [{"node": n, "index": i, "model": "Simulated A100"} for n, i in gpus],
        "borrowed": 0,
        "idle": None,
        "time_limit": None,
        **kw,
    }


def me(*allocations, **kw):
    return {"user": "alice", "allocations": list(allocations), "preempted": [], "reclaimed": [], **kw}


UTIL = {
    "gpus": [
        {
            "node": "n1",
            "index": 0,
            "utilization": 40.0,
            "memory_used_mib": 1024,
            "memory_mib": 40960,
            "history": [[-3, 35.0]],
        },
        {
            "node": "n1",
            "index": 1,
            "utilization": 80.0,
            "memory_used_mib": 2048,
            "memory_mib": 40960,
            "history": [],
        },
        {
            "node": "n1",
            "index": 2,
            "utilization": None,
            "memory_used_mib": None,
            "memory_mib": 40960,
            "history": [],
        },
    ],
    "history_seconds": 600,
}


def test_the_document_holds_this_servers_gpus_its_pools_and_its_waits_only():
    doc = status.document(
        me(
            alloc(1, gpus=(("n1", 0), ("n1", 1))),
            alloc(2, "distributed", gpus=(("n1", 2),)),
            alloc(3, server="other"),  # another named server of alice's: not this one's
        ),
        UTIL,
        [
            {
                "id": 7,
                "gpus": 2,
                "purpose": "distributed",
                "server_name": "",
                "state": "waiting",
                "position": 2,
                "waiting": 3,
            },
            {
                "id": 8,
                "gpus": 1,
                "purpose": "server",
                "server_name": "other",
                "state": "waiting",
                "position": 1,
                "waiting": 3,
            },
        ],
        [],
        "",
        NOW,
    )
    assert doc["server"]["id"] == 1 and [g["label"] for g in doc["server"]["gpus"]] == ["n1:0", "n1:1"]
    assert doc["server"]["gpus"][0] | {} == {
        "label": "n1:0",
        "node": "n1",
        "index": 0,
        "model": "Simulated A100",
        "utilization": 40.0,
        "memory_used_mib": 1024,
        "memory_total_mib": 40960,
        "history": [[-3, 35.0]],
    }
    assert [p["id"] for p in doc["pools"]] == [2] and doc["pools"][0]["gpus"][0]["utilization"] is None
    assert [q["id"] for q in doc["queue"]] == [7]
    assert (
        doc["summary"]["text"] == "2 GPUs Simulated A100 · 60 % · 3.0 GiB · pool: 1 GPU more · queue: 2 of 3"
    )


# GET me's figures: a server's (PUE 1.5, EUR, no carbon intensity) and a burst not measured yet
FIGURES = {
    "gpu_kwh": 2.0,
    "idle_kwh": 0.5,
    "idle_share": 0.25,
    "meter_kwh": 3.0,
    "cost": 0.6,
    "currency": "EUR",
    "co2e_kg": None,
    "measured_gpu_hours": 4.0,
    "unknown_gpu_hours": 0.5,
    "unknown_share": 0.1111,
}
COSTING = {"pue": 1.5, "price_per_kwh": 0.2, "currency": "EUR", "carbon_g_per_kwh": None, "source": "gpuhub"}


def test_the_document_passes_each_allocations_energy_through_with_its_words():
    doc = status.document(
        me(
            alloc(1, energy=FIGURES),
            alloc(2, "distributed", gpus=(("n1", 2),), energy=None),
            alloc(3, server="other", energy=FIGURES),
            energy=COSTING,
        ),
        UTIL,
        [],
        [],
        "",
        NOW,
    )
    assert doc["energy"] == COSTING
    assert doc["server"]["energy"] == FIGURES
    assert doc["server"]["energy_text"] == (
        "2.000 kWh at the GPUs (3.000 kWh at the meter, 0.60 EUR); 25 % of it idle; "
        "0.50 GPU-hours not measured"
    )
    [pool] = doc["pools"]
    assert pool["energy"] is None and pool["energy_text"] == "not measured yet"
    # a broker that says nothing of energy: nothing measured, no facility numbers
    old = status.document(me(alloc(1)), UTIL, [], [], "", NOW)
    assert old["energy"] is None and old["server"]["energy"] is None
    assert old["server"]["energy_text"] == "not measured yet"


@pytest.mark.parametrize(
    "server, pools, queue, text",
    [
        (None, [], [], "0 GPUs"),
        (
            {"gpus": [{"model": "A", "utilization": None, "memory_used_mib": None}], "borrowed": 0},
            [],
            [],
            "1 GPU A · no reading yet",
        ),
        (
            {"gpus": [{"model": "A", "utilization": 10.4, "memory_used_mib": 100}], "borrowed": 1},
            [],
            [],
            "1 GPU A · 10 % · 100 MiB · 1 borrowed",
        ),
    ],
)
def test_the_status_bar_says_count_model_use_and_markers(server, pools, queue, text):
    assert status.summary(server, pools, queue)["text"] == text


def test_a_preemption_notice_is_an_event_with_its_deadline_until_it_ends_or_is_withdrawn():
    due = NOW + timedelta(seconds=60)
    notice = {
        "id": 4,
        "allocation_id": 1,
        "purpose": "server",
        "server_name": "",
        "gpus": 2,
        "borrowed": 1,
        "reason": "preempted: 1 borrowed GPU taken back",
        "created": iso(NOW),
        "due": iso(due),
        "ended": None,
        "withdrawn": None,
    }
    [e] = status.events(me(preempted=[notice]), [], "", NOW)
    assert (e["key"], e["kind"], e["deadline"]) == ("preempt:4", "preemption", iso(due))
    assert (e["title"], e["message"]) == (
        "This server stops",
        "1 borrowed GPU taken back for a waiting request. Save your work now.",
    )
    assert (
        e["past"] == "1 borrowed GPU was taken back for a waiting request" and e["detail"] == notice["reason"]
    )
    assert status.events(me(preempted=[notice | {"withdrawn": iso(NOW)}]), [], "", NOW) == []
    [ended] = status.events(me(preempted=[notice | {"ended": iso(due)}]), [], "", due)
    assert ended["key"] == "preempted:4" and ended["deadline"] is None
    # told for a while, then no more
    later = due + timedelta(seconds=status.RECENT_SECONDS + 1)
    assert status.events(me(preempted=[notice | {"ended": iso(due)}]), [], "", later) == []


def test_an_idle_warning_is_one_event_per_spell_and_a_time_warning_one_per_end():
    idle = {"state": "warned", "idle_seconds": 300.0, "reclaim_in_seconds": 120.0, "reason": "idle for 5 min"}
    a = alloc(1, idle=idle)
    [e] = status.events(me(a), [], "", NOW)
    assert e["kind"] == "idle" and e["deadline"] == iso(NOW + timedelta(seconds=120))
    # the same spell a few seconds on: the same key; used, then idle again: a new one
    [same] = status.events(
        me(alloc(1, idle=idle | {"idle_seconds": 310.0, "reclaim_in_seconds": 110.0})),
        [],
        "",
        NOW + timedelta(seconds=10),
    )
    assert same["key"] == e["key"]
    [again] = status.events(me(alloc(1, idle=idle)), [], "", NOW + timedelta(hours=1))
    assert again["key"] != e["key"]
    # the broker's idle_seconds are as of its last sweep: polls either side of a minute's edge
    # still tell one spell, by the start the broker gives
    since = {"since": iso(NOW - timedelta(seconds=299))}
    keys = {
        status.events(me(alloc(1, idle=idle | since)), [], "", NOW + timedelta(seconds=s))[0]["key"]
        for s in (0, 1, 59, 61, 119)
    }
    assert keys == {f"idle:1:{since['since']}"}
    ends = iso(NOW + timedelta(minutes=30))
    [t] = status.events(me(alloc(1, time_limit={"ends": ends, "seconds": 3600, "warned": True})), [], "", NOW)
    assert (t["key"], t["deadline"]) == (f"time:1:{ends}", ends)
    assert (
        status.events(me(alloc(1, time_limit={"ends": ends, "seconds": 3600, "warned": False})), [], "", NOW)
        == []
    )


def test_a_wait_that_ended_says_whether_its_turn_came_or_why_not():
    granted = {"id": 7, "gpus": 2, "state": "granted", "allocation_id": 12}
    lowered = {"id": 8, "gpus": 3, "state": "ended", "end_reason": "refused: your limit is now 2 GPUs"}
    turn, ended = status.events(me(), [granted, lowered], "", NOW)
    assert (turn["key"], turn["kind"], turn["level"]) == ("wait:7", "turn", "success")
    assert "Allocation #12" in turn["message"]
    assert (ended["key"], ended["kind"]) == ("wait:8", "wait-ended") and ended["message"] == lowered[
        "end_reason"
    ]


@pytest.mark.parametrize(
    "environ, gpus",
    [
        ({}, ()),
        ({"GPUHUB_GPUS": "n1:0,n1:1"}, ("n1:0", "n1:1")),
        ({"GPUHUB_GPUS": "n1:0,n1:1", "GPUHUB_RANK_GPU": "n1:1"}, ("n1:1",)),  # a rank: its own
        ({"GPUHUB_GPUS": ""}, ()),
    ],
)
def test_a_process_is_bound_to_its_ranks_gpu_else_its_servers(environ, gpus):
    assert simload.gpus_of(environ) == gpus


def test_a_gpus_use_is_its_processes_cpu_time_and_memory_shared_among_their_gpus():
    P = simload.ProcessReading
    before = {1: P(("n1:0", "n1:1"), 10.0, 100), 2: P(("n1:1",), 5.0, 50)}
    after = {
        1: P(("n1:0", "n1:1"), 11.0, 200),  # 1 CPU-second in 2 s on two GPUs: 25 % each
        2: P(("n1:1",), 9.0, 50),  # 4 in 2 s: 200 %, capped at 100 with the rest
        3: P(("n1:2",), 50.0, 10),  # just started: its memory, no use yet
    }
    load = simload.gpu_load(before, after, 2.0)
    assert load == {"n1:0": (25.0, 100.0), "n1:1": (100.0, 150.0), "n1:2": (0.0, 10.0)}


def test_a_kernels_pool_is_published_privately_read_back_and_gone_with_its_kernel(tmp_path):
    run = tmp_path / "runtime"
    poolstatus.publish(run, {"ranks": [{"rank": 0, "state": "idle"}], "bursts": [], "autosave": None})
    d = run / poolstatus.DIRNAME
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    [f] = d.glob("*.json")
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    assert poolstatus.read_all(run) == [
        {"ranks": [{"rank": 0, "state": "idle"}], "bursts": [], "autosave": None, "kernel_pid": os.getpid()}
    ]
    # a kernel that is gone: its file goes on the next read
    dead = _dead_pid()
    (d / f"{dead}.json").write_text('{"ranks": []}')
    assert [p["kernel_pid"] for p in poolstatus.read_all(run)] == [os.getpid()]
    assert not (d / f"{dead}.json").exists()
    poolstatus.withdraw(run)
    assert poolstatus.read_all(run) == []
    # a directory others may read is not used at all
    d.chmod(0o755)
    poolstatus.publish(run, {"ranks": []})
    assert list(d.glob("*.json")) == [] and poolstatus.read_all(run) == []


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_the_status_bar_counts_a_pools_live_ranks_and_notices_say_what_autosave_keeps():
    pools = [
        {
            "ranks": [{"state": "idle"}, {"state": "gone"}, {"state": "running a cell"}],
            "bursts": [2],
            "autosave": {"names": ["model", "opt"], "dir": "/home/a/ck"},
        }
    ]
    assert status.summary(None, [{"gpu_count": 1, "borrowed": 0}], [], pools)["markers"] == [
        "pool: 2 ranks, 1 burst"
    ]
    due = NOW + timedelta(seconds=60)
    notice = {
        "id": 4,
        "allocation_id": 2,
        "purpose": "distributed",
        "server_name": "",
        "gpus": 1,
        "borrowed": 1,
        "reason": "preempted",
        "created": iso(NOW),
        "due": iso(due),
        "ended": None,
        "withdrawn": None,
    }
    doc = status.document(me(preempted=[notice]), UTIL, [], [], "", NOW, pools)
    [e] = doc["events"]
    assert e["detail"] == "preempted --autosave saves model, opt to /home/a/ck first."


class _Broker:
    """The broker's answers for the cache's unit test (the real broker: tests/test_lab_hub.py)."""

    def __init__(self):
        self.calls = 0
        self.waiting = [
            {
                "id": 7,
                "gpus": 1,
                "purpose": "distributed",
                "server_name": "",
                "state": "waiting",
                "position": 1,
                "waiting": 1,
            }
        ]

    def me(self):
        self.calls += 1
        return me()

    def utilization(self):
        return {"gpus": []}

    def queue(self):
        return {"queue": self.waiting}

    def queue_entry(self, entry_id):
        return {"id": entry_id, "state": "granted", "allocation_id": 12}


def test_every_tab_shares_one_broker_fetch_per_period_and_a_wait_that_left_is_told():
    import asyncio

    from gpu_magics.lab.handlers import StatusCache

    t = [0.0]
    broker = _Broker()
    cache = StatusCache(broker, "", max_age=2.0, clock=lambda: t[0])

    async def tabs(n):
        return await asyncio.gather(*(cache.get() for _ in range(n)))

    docs = asyncio.run(tabs(5))
    assert broker.calls == 1 and all(d is docs[0] for d in docs)
    assert docs[0]["queue"][0]["id"] == 7
    t[0] = 1.9
    asyncio.run(tabs(3))
    assert broker.calls == 1
    broker.waiting = []  # its turn came: asked about once, then told
    t[0] = 2.0
    [doc] = asyncio.run(tabs(1))
    assert broker.calls == 2
    assert [(e["key"], e["kind"]) for e in doc["events"]] == [("wait:7", "turn")]


def _proc(root, pid, environ: dict, utime: int, rss_kib: int):
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in environ.items()) + b"\0")
    fields = ["S"] + ["0"] * 10 + [str(utime), "0"] + ["0"] * 30
    (d / "stat").write_text(f"{pid} (python (x)) " + " ".join(fields))
    (d / "status").write_text(f"Name:\tpython\nVmRSS:\t{rss_kib} kB\n")


def test_a_process_counts_only_on_its_own_hubs_simulated_gpus(tmp_path):
    hub = "/srv/a/gpuhub-simulated-utilization.json"
    _proc(tmp_path, 10, {"GPUHUB_GPUS": "n1:0", "GPUHUB_SIMULATED_GPU_STATS": hub}, 2 * simload.TICKS, 2048)
    _proc(tmp_path, 11, {"GPUHUB_GPUS": "n1:0", "GPUHUB_SIMULATED_GPU_STATS": "/srv/b/x.json"}, 5, 1024)
    _proc(tmp_path, 12, {"PATH": "/usr/bin"}, 5, 1024)  # bound to no GPU
    assert simload.read_processes(tmp_path, hub=hub) == {10: simload.ProcessReading(("n1:0",), 2.0, 2.0)}
    assert set(simload.read_processes(tmp_path)) == {10, 11}


def test_deadlines_are_utc_whatever_the_machines_time_zone(monkeypatch):
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        idle = {"state": "warned", "idle_seconds": 300.0, "reclaim_in_seconds": 120.0, "reason": "idle"}
        [e] = status.events(me(alloc(1, idle=idle)), [], "", NOW)
        assert e["deadline"] == iso(NOW + timedelta(seconds=120))
        r = {
            "id": 1,
            "allocation_id": 1,
            "purpose": "server",
            "server_name": "",
            "gpus": 1,
            "reason": "idle",
            "created": iso(NOW - timedelta(seconds=60)),
        }
        assert [e["kind"] for e in status.events(me(reclaimed=[r]), [], "", NOW)] == ["reclaimed"]
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
