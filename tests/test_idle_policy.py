"""The idle-reclaim rule as tables, with the clock passed in (spawner/policy/idle.py), and the
pure pieces around it: sample parsing, reclaim records, notices, the reporter's view of
kernel activity, simulated NVML, CPU masks, and %gpus' text."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from gpu_magics.kernel.status import describe_use
from gpu_magics.report.gpustats import SimulatedSource, cpus_from_mask, parse_label
from gpu_magics.report.reporter import kernel_idle_seconds
from spawner.broker import requests as schemas
from spawner.ledger import Ledger
from spawner.policy.idle import IdleRules, Watch, after_activity, after_samples, judge
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu
from spawner.spawners.notices import render_notices

RULES = IdleRules(threshold=5, warn_after=900, reclaim_after=3600, stale_after=180)
T0 = 1_000_000.0


def watch(**kw) -> Watch:
    base = dict(allocation_id=1, user="alice", purpose="server", gpus=2, started=T0)
    return Watch(**{**base, **kw})


def reporting(since=T0, last=None, **kw) -> Watch:
    """Reports arriving steadily since ``since``, the last at ``last``."""
    return watch(reporting_since=since, last_report=last, **kw)


@pytest.mark.parametrize(
    "w, now, groups, state",
    [
        # no report ever, or none recently: unknown, never reclaimed
        (watch(), T0 + 99999, [], "unknown"),
        (reporting(last=T0 + 5000), T0 + 5000 + 181, [], "unknown"),
        # idle for less than warn_after: active
        (reporting(last=T0 + 899), T0 + 899, [], "active"),
        # idle for warn_after and more, not yet warned: warned (never straight to reclaim)
        (reporting(last=T0 + 900), T0 + 900, [], "warned"),
        (reporting(last=T0 + 4000), T0 + 4000, [], "warned"),
        # warned in this idle period, and idle for reclaim_after: reclaim
        (reporting(last=T0 + 3600, warned_at=T0 + 900), T0 + 3600, [], "reclaim"),
        # warned late (at 3000 s): the owner still gets the full notice (2700 s)
        (reporting(last=T0 + 3600, warned_at=T0 + 3000), T0 + 3600, [], "warned"),
        (reporting(last=T0 + 5700, warned_at=T0 + 3000), T0 + 5700, [], "reclaim"),
        # a busy GPU sample 10 s ago: active, and an old warning no longer counts
        (reporting(last=T0 + 3600, last_busy=T0 + 3590, warned_at=T0 + 900), T0 + 3600, [], "active"),
        # kernel activity 100 s ago resets the clock as well
        (reporting(last=T0 + 3600, last_active=T0 + 3500, warned_at=T0 + 900), T0 + 3600, [], "active"),
        # activity 1000 s ago, warned after it: warned, not reclaimed (only 2600 s idle)
        (reporting(last=T0 + 3600, last_active=T0 + 1000, warned_at=T0 + 1900), T0 + 3600, [], "warned"),
        # reports began late (a broker restart): idle counts from the first report
        (reporting(since=T0 + 3000, last=T0 + 3600), T0 + 3600, [], "active"),
        # exemptions, by user and by group; no GPUs; a server under servers="warn"
        (reporting(last=T0 + 3600, warned_at=T0 + 900, user="carol"), T0 + 3600, [], "exempt"),
        (reporting(last=T0 + 3600, warned_at=T0 + 900), T0 + 3600, ["benchmarks"], "exempt"),
        (reporting(last=T0 + 3600, warned_at=T0 + 900, gpus=0), T0 + 3600, [], "off"),
    ],
)
def test_judge(w, now, groups, state):
    rules = IdleRules(
        **{**RULES.__dict__, "exempt_users": frozenset({"carol"}), "exempt_groups": frozenset({"benchmarks"})}
    )
    assert judge(w, rules, groups, now).state == state


def test_servers_only_warned_under_the_warn_policy_bursts_still_reclaimed():
    rules = IdleRules(**{**RULES.__dict__, "servers": "warn"})
    server = reporting(last=T0 + 9000, warned_at=T0 + 900)
    v = judge(server, rules, [], T0 + 9000)
    assert (v.state, v.reclaim_at) == ("warned", None)
    burst = reporting(last=T0 + 9000, warned_at=T0 + 900, purpose="distributed")
    assert judge(burst, rules, [], T0 + 9000).state == "reclaim"


def test_a_disabled_policy_judges_nothing():
    rules = IdleRules(**{**RULES.__dict__, "enabled": False})
    assert judge(reporting(last=T0 + 9000, warned_at=T0), rules, [], T0 + 9000).state == "off"


def test_verdict_times_and_reason():
    v = judge(reporting(last=T0 + 1000), RULES, [], T0 + 1000)
    assert (v.state, v.idle_seconds, v.since) == ("warned", 1000, T0)
    assert judge(reporting(last=T0 + 1030), RULES, [], T0 + 1030).since == T0  # the same spell
    assert v.reclaim_at == T0 + 1000 + RULES.notice  # warned now: full notice from now
    assert v.reason == "its 2 GPUs stayed below 5% utilization with no kernel activity for 17 min"
    v = judge(reporting(last=T0 + 100), RULES, [], T0 + 100)
    assert (v.state, v.reclaim_at) == ("active", T0 + 3600)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"threshold": 101}, "percentage"),
        ({"warn_after": 3600, "reclaim_after": 3600}, "warned first"),
        ({"warn_after": 0}, "more than 0"),
        ({"stale_after": 0}, "stale_after"),
        ({"servers": "kill"}, "'stop' or 'warn'"),
    ],
)
def test_bad_rules_are_refused_with_what_to_do(kw, message):
    with pytest.raises(ValueError, match=message):
        IdleRules(**kw)


def test_reports_and_gaps():
    w = watch()
    w = after_samples(w, busy_gpu=False, now=T0 + 10, stale_after=180)
    assert (w.reporting_since, w.last_report, w.last_busy) == (T0 + 10, T0 + 10, None)
    w = after_samples(w, busy_gpu=True, now=T0 + 40, stale_after=180)
    assert (w.reporting_since, w.last_busy) == (T0 + 10, T0 + 40)
    # a gap longer than stale_after starts a new run: the gap is not counted as idle
    w = after_samples(w, busy_gpu=False, now=T0 + 400, stale_after=180)
    assert w.reporting_since == T0 + 400
    w = after_activity(w, 30, now=T0 + 500)
    assert w.last_active == T0 + 470
    w = after_activity(w, 300, now=T0 + 510)  # older news never moves the clock back
    assert w.last_active == T0 + 470


NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    "kernels, idle",
    [
        ([], None),
        ([{"execution_state": "idle", "last_activity": "2026-11-29T11:59:00Z"}], 60.0),
        (
            [
                {"execution_state": "idle", "last_activity": "2026-11-29T11:00:00Z"},
                {"execution_state": "idle", "last_activity": "2026-11-29T11:58:00.000000+00:00"},
            ],
            120.0,
        ),
        ([{"execution_state": "busy", "last_activity": "2026-11-29T10:00:00Z"}], 0.0),
        ([{"execution_state": "starting", "last_activity": None}], 0.0),
        ([{"execution_state": "idle", "last_activity": "garbage"}], None),
    ],
)
def test_kernel_activity(kernels, idle):
    assert kernel_idle_seconds(kernels, NOW) == idle


@pytest.mark.parametrize(
    "words, cpus",
    [([0b1011], [0, 1, 3]), ([0, 1], [64]), ([2**63, 1], [63, 64]), ([], [])],
)
def test_cpu_affinity_masks(words, cpus):
    assert cpus_from_mask(words) == cpus


def test_labels():
    assert parse_label("gpu1:3") == ("gpu1", 3)
    assert parse_label("a:b:12") == ("a:b", 12)
    for bad in ("gpu1", ":3", "gpu1:x"):
        with pytest.raises(ValueError, match="node:index"):
            parse_label(bad)


def test_simulated_source_reads_the_file_and_treats_missing_as_idle(tmp_path):
    f = tmp_path / "u.json"
    src = SimulatedSource(f)
    assert [s.utilization for s in src.sample("n", [0])] == [0.0]  # no file yet
    f.write_text('{"n:1": {"utilization": 130, "memory_used_mib": 7, "memory_total_mib": 80}}')
    a, b = src.sample("n", [0, 1])
    assert (a.utilization, a.memory_used_mib) == (0.0, 0)
    assert (b.label, b.utilization, b.memory_used_mib, b.memory_total_mib) == ("n:1", 100.0, 7, 80)
    f.write_text("{half")
    assert src.sample("n", [1])[0].utilization == 0.0


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "'gpus' must be a list"),
        ({"gpus": [{"node": "n", "index": 0}]}, r"\['utilization'\] is required"),
        ({"gpus": [{"node": "n", "index": 0, "utilization": 101}]}, "from 0 to 100"),
        ({"gpus": [{"node": "n", "index": -1, "utilization": 1}]}, "'index'"),
        ({"gpus": [{"node": "", "index": 0, "utilization": 1}]}, "node name"),
        ({"gpus": [{"node": "n", "index": 0, "utilization": True}]}, "number"),
        ({"gpus": [], "idle_seconds": -1}, "idle_seconds"),
        ({"gpus": [], "pid": 1}, "Unknown field"),
        ({"gpus": ["x"]}, "must be an object"),
    ],
)
def test_bad_sample_reports_are_refused(body, message):
    with pytest.raises(schemas.BadRequest, match=message):
        schemas.parse_samples(body)


def test_a_sample_report():
    r = schemas.parse_samples(
        {"gpus": [{"node": "n", "index": 2, "utilization": 55.5, "memory_used_mib": 9}], "idle_seconds": 3}
    )
    assert (r.samples[0].index, r.samples[0].utilization, r.samples[0].memory_total_mib, r.idle_seconds) == (
        2,
        55.5,
        None,
        3.0,
    )


@pytest.fixture
def ledger(tmp_path):
    clock = [datetime(2026, 11, 29, 12, 0)]
    led = Ledger(
        f"sqlite:///{tmp_path}/ledger.sqlite",
        config_rules=LimitRules(default=Limit(None)),
        clock=lambda: clock[0],
    )
    led.sync_inventory([Gpu("n1", i, "A100") for i in range(4)])
    led.tick = lambda minutes: clock.__setitem__(0, clock[0] + timedelta(minutes=minutes))
    yield led
    led.close()


def test_a_reclaim_is_recorded_once_and_ends_each_allocation_with_its_reason(ledger):
    server = ledger.allocate("alice", [], 2, purpose="server")
    burst = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=300)
    r = ledger.record_reclaim(server.id, 3600, "idle")
    assert (r.gpus, r.gpu_hours, r.purpose) == (2, 2.0, "server")
    assert ledger.get(server.id).state != "released"  # its spawner releases it as it stops
    assert ledger.record_reclaim(server.id, 7200, "again") == r  # once
    b = ledger.record_reclaim(burst.id, 1800, "idle burst")
    assert b.gpu_hours == 0.5
    # the burst keeps its GPUs until its kernel stops the engines: its renewal is refused
    assert ledger.get(burst.id).state == "running"
    with pytest.raises(LookupError, match="reclaimed"):
        ledger.renew(burst.id, 300)
    assert ledger.release(burst.id, "released through the API by owner")
    assert ledger.get(burst.id).end_reason == "reclaimed: idle burst"
    unrenewed = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=60)
    ledger.record_reclaim(unrenewed.id, 60, "idle, kernel gone")
    ledger.tick(2)
    ledger.expire_leases()  # or its lease runs out
    assert ledger.get(unrenewed.id).end_reason == "reclaimed: idle, kernel gone"
    assert ledger.record_reclaim(burst.id + 100, 1, "x") is None
    ledger.release(server.id, "server stopped")
    late = ledger.allocate("bob", [], 1, purpose="distributed", lease_seconds=300)
    ledger.release(late.id)
    assert ledger.record_reclaim(late.id, 10, "too late") is None  # released meanwhile: nothing
    assert [x.allocation_id for x in ledger.reclaims()] == [unrenewed.id, burst.id, server.id]
    assert [x.allocation_id for x in ledger.reclaims(user="bob")] == []


def test_home_page_notices_last_until_the_server_starts_again(ledger):
    first = ledger.allocate("alice", [], 1, purpose="server", server_name="")
    named = ledger.allocate("alice", [], 1, purpose="server", server_name="big")
    ledger.record_reclaim(first.id, 3600, "idle <b>")
    ledger.record_reclaim(named.id, 3600, "idle too")
    ledger.release(first.id)
    ledger.release(named.id)
    assert {n.server_name for n in ledger.reclaim_notices("alice")} == {"", "big"}
    html = render_notices(ledger.reclaim_notices("alice"))
    assert "idle &lt;b&gt;" in html and "<b>big</b>" in html and "notebooks and files are saved" in html
    ledger.tick(1)
    ledger.allocate("alice", [], 1, purpose="server", server_name="")
    assert [n.server_name for n in ledger.reclaim_notices("alice")] == ["big"]
    ledger.tick(60 * 24 * 8)  # a week later: forgotten
    assert ledger.reclaim_notices("alice") == []
    assert ledger.reclaim_notices("bob") == []


def test_gpus_magic_text():
    me = {
        "allocations": [
            {
                "id": 3,
                "purpose": "server",
                "gpus": [{"node": "n1", "index": 0}, {"node": "n1", "index": 1}],
                "idle": {"state": "warned", "reason": "its 2 GPUs stayed idle", "reclaim_in_seconds": 1800},
            }
        ],
        "reclaimed": [{"server_name": "big", "created": "2026-11-29T10:00:00Z", "reason": "idle"}],
    }
    grid = {
        "gpus": [
            {"node": "n1", "index": 0, "utilization": 3.2, "memory_used_mib": 10, "memory_total_mib": 80}
        ]
    }
    text = describe_use(me, grid)
    assert "n1:0    3% busy, 10/80 MiB" in text
    assert "n1:1    no recent report" in text
    assert "WARNING: allocation #3: its 2 GPUs stayed idle; it will be reclaimed in 30 min" in text
    assert "Your server 'big' was reclaimed at 2026-11-29 10:00:00 UTC: idle." in text
    assert describe_use({"allocations": [], "reclaimed": []}, {"gpus": []}) == ""
