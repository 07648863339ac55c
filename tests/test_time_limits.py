"""Time limits, the parts without a hub: the settings and a request's own ask (pure, table
tests), the job's ``--time``, and the ledger's grant and end of a limited allocation (SQLite
and PostgreSQL)."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

import pytest

from gpu_magics.kernel.status import time_limit_text
from gpu_magics.kernel.timeleft import End, due_warnings, end_of, warning_text
from spawner.broker.requests import BadRequest, parse_burst_request
from spawner.ledger import Ledger, QueueSettings
from spawner.policy import timelimits, values
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu
from spawner.policy.timelimits import TimeRules
from spawner.settings import GpuHub
from spawner.slurm.commands import job_time
from spawner.spawners import form

from .ledgertools import Clock

BAD_HOURS = [0, -1, float("nan"), float("inf"), -float("inf"), 10_000, "8", "eight", True, [8], {"h": 8}]


@pytest.mark.parametrize("value", BAD_HOURS)
@pytest.mark.parametrize("trait", ["default_max_hours", "group_max_hours", "user_max_hours"])
def test_a_bad_longest_session_is_refused_naming_the_setting_and_its_range(trait, value):
    hub = GpuHub()
    if trait == "default_max_hours":
        if not isinstance(value, int | float) or isinstance(value, bool):
            pytest.skip("the trait itself refuses what is not a number (and reads True as 1.0)")
        hub.default_max_hours = value
        where = "c.GpuHub.default_max_hours"
    else:
        setattr(hub, trait, {"students": value})
        where = f"c.GpuHub.{trait}['students']"
    with pytest.raises(ValueError) as e:
        hub.time_rules()
    assert str(e.value).startswith(f"{where} must be a number of hours from 1/60 (a minute) to 8784 (a year)")


def test_the_longest_session_settings_are_read_into_rules():
    hub = GpuHub()
    assert hub.time_rules() == TimeRules()  # no limit by default
    hub.default_max_hours, hub.group_max_hours, hub.user_max_hours = 8, {"staff": None}, {"alice": 48}
    assert hub.time_rules() == TimeRules(default=8.0, groups={"staff": None}, users={"alice": 48.0})


RULES = TimeRules(default=8.0, groups={"students": 2.0, "lab": 12.0, "staff": None}, users={"alice": 0.5})


@pytest.mark.parametrize(
    "user, groups, want",
    [
        ("alice", ["staff"], (0.5, "user alice")),  # the user's own entry wins
        ("bob", [], (8.0, "default")),
        ("bob", ["students"], (2.0, "group students")),  # a group's may be shorter than the default
        ("bob", ["students", "lab"], (12.0, "group lab")),  # the most generous group
        ("bob", ["lab", "staff"], (None, "group staff")),  # no limit beats any number
        ("bob", ["nobody-knows"], (8.0, "default")),
    ],
)
def test_max_hours(user, groups, want):
    assert timelimits.max_hours(user, groups, RULES) == want


@pytest.mark.parametrize(
    "asked, longest, want",
    [
        (None, 8.0, 8 * 3600.0),  # nothing asked: the longest
        (2.0, 8.0, 2 * 3600.0),  # less, as asked
        (8.0, 8.0, 8 * 3600.0),
        (None, None, None),  # no limit
        (3.0, None, 3 * 3600.0),  # a limit the user chose
    ],
)
def test_session_seconds(asked, longest, want):
    assert timelimits.session_seconds(asked, longest, "default") == want


def test_a_session_longer_than_the_longest_is_refused_at_once_with_the_longest():
    with pytest.raises(Refusal) as e:
        timelimits.session_seconds(10.0, 8.0, "group students")
    assert e.value.reason == "over_time_limit" and e.value.status_code == 403 and e.value.fits is None
    assert e.value.message == (
        "A session of 10 h is longer than the 8 h a session may run for you (group students); "
        "ask for 8 h or less."
    )


@pytest.mark.parametrize(
    "raw, want", [(None, None), ("", None), ("  ", None), ("2", 2.0), (" 1.5 ", 1.5), (3, 3.0)]
)
def test_an_asked_length_from_the_form(raw, want):
    assert timelimits.parse_asked_hours(raw) == want


@pytest.mark.parametrize("raw", [0, -2, "0", "nan", "inf", "1e400", 9000, "two hours", "2h", True, [2]])
def test_a_bad_asked_length_is_refused_with_the_range(raw):
    with pytest.raises(values.BadValue) as e:
        timelimits.parse_asked_hours(raw, "hours")
    assert str(e.value).startswith(
        "hours must be a number of hours from 1/60 (a minute) to 8784 (a year); got "
    )


def test_the_spawn_options_take_hours_and_refuse_bad_ones():
    assert form.parse_gpu_options({"gpus": "1", "hours": "2.5"}, default_gpus=0).hours == 2.5
    assert form.parse_gpu_options({"gpus": 1}, default_gpus=0).hours is None
    with pytest.raises(Refusal) as e:
        form.parse_gpu_options({"gpus": 1, "hours": "forever"}, default_gpus=0)
    assert "hours must be a number of hours" in e.value.message and e.value.reason == "bad_request"


def test_a_bursts_hours_must_be_a_json_number_in_range():
    assert parse_burst_request({"gpus": 1, "hours": 2}, max_lease_seconds=3600).hours == 2.0
    assert parse_burst_request({"gpus": 1}, max_lease_seconds=3600).hours is None
    for bad in ("2", 0, -1, 1e9, True):
        with pytest.raises(BadRequest) as e:
            parse_burst_request({"gpus": 1, "hours": bad}, max_lease_seconds=3600)
        assert "'hours' must be a number of hours from 1/60 (a minute) to 8784 (a year)" in str(e.value)


def test_the_spawn_form_says_the_longest_session_and_where_it_comes_from():
    limited = "\n".join(form.hours_field(8.0, "group students"))
    assert 'name="hours"' in limited and 'max="8"' in limited
    assert "Your session may run for up to 8 h (group students)" in limited
    unlimited = "\n".join(form.hours_field(None, "default"))
    assert "max=" not in unlimited and "No time limit applies to your sessions" in unlimited


@pytest.mark.parametrize(
    "seconds, runtime, want",
    [
        (None, "", ""),  # neither: Slurm's partition default
        (None, "12:00:00", "12:00:00"),  # the admin's req_runtime as written
        (8 * 3600, "12:00:00", "480"),  # gpuhub's limit is the job's end
        (90, "", "2"),  # whole minutes, rounded up: never before gpuhub's own end
        (60, "", "1"),
        (1, "", "1"),
    ],
)
def test_job_time(seconds, runtime, want):
    assert job_time(seconds, runtime) == want


def test_pct_gpus_says_when_an_allocation_ends():
    text = time_limit_text(3, {"seconds": 8 * 3600, "ends": "2026-12-04T23:00:00Z"})
    assert text == "allocation #3 ends at 2026-12-04 23:00:00 UTC (its time limit, 8 h)."


# the ledger -------------------------------------------------------------------------------

T = datetime(2026, 12, 4, 9, 0)
INV = [Gpu("n1", i, "A100") for i in range(4)]


@pytest.fixture
def led(db_url):
    ledger = Ledger(
        db_url,
        config_rules=LimitRules(default=Limit(max_gpus=4)),
        clock=Clock(T),
        queue=QueueSettings(keepalive_seconds=3600),
        time_rules=TimeRules(default=8.0, groups={"students": 2.0}),
    )
    ledger.sync_inventory(INV)
    yield ledger
    ledger.close()


def test_every_allocation_gets_the_users_longest_session_or_less_as_asked(led):
    server = led.allocate("alice", ["students"], 1)
    assert server.time_limit_seconds == 2 * 3600 and server.time_ends == T + timedelta(hours=2)
    burst = led.allocate("bob", [], 1, purpose="distributed", lease_seconds=300, hours=0.5)
    assert burst.time_limit_seconds == 1800 and led.get(burst.id).time_limit_seconds == 1800
    with pytest.raises(Refusal) as e:  # beyond the longest: refused, nothing written
        led.allocate("alice", ["students"], 1, purpose="distributed", lease_seconds=300, hours=3)
    assert e.value.reason == "over_time_limit" and "(group students)" in e.value.message
    assert len(led.active(user="alice")) == 1


def test_a_waiting_request_keeps_its_length_and_counts_it_from_its_grant(led):
    held = led.allocate("bob", [], 4)
    waits = led.request("alice", [], 2, purpose="distributed", lease_seconds=300, hours=1)
    assert waits.entry is not None
    led.clock.advance(minutes=30)
    led.release(held.id, "done")
    got = led.wait_turn(waits.entry.id).allocation
    assert got.time_limit_seconds == 3600 and got.time_ends == T + timedelta(minutes=90)


def test_a_server_counts_from_its_start():
    a = led_info(created=T, started=T + timedelta(minutes=5), seconds=3600)
    assert a.time_ends == T + timedelta(minutes=65)
    assert led_info(created=T, started=None, seconds=None).time_ends is None


def led_info(created, started, seconds):
    from spawner.policy.records import AllocationInfo

    return AllocationInfo(
        1,
        "a",
        "server",
        "",
        "running",
        created,
        started,
        None,
        "local",
        None,
        None,
        (),
        time_limit_seconds=seconds,
    )


def test_what_runs_out_ends_a_burst_there_and_asks_for_the_servers_stop(led):
    server = led.allocate("alice", ["students"], 1)
    led.mark_running(server.id, None)
    month = 30 * 86400  # a lease that outlives every limit here: the time limit ends them
    burst = led.allocate("alice", ["students"], 1, purpose="distributed", lease_seconds=month, hours=1)
    forever = led.allocate("carol", ["staff"], 1, purpose="distributed", lease_seconds=month)
    assert led.settle_time_limits().ended == []  # nothing ran out
    led.clock.advance(minutes=61)
    up = led.settle_time_limits()
    assert [a.id for a in up.ended] == [burst.id] and up.servers == []
    ended = led.get(burst.id)
    assert ended.state == "released" and ended.end_reason == "its time limit (1 h) ran out at 10:00:00 UTC"
    led.clock.advance(hours=1)
    up = led.settle_time_limits()
    assert [a.id for a in up.servers] == [server.id]  # the broker stops it through the hub
    assert led.get(server.id).state == "running"  # its GPUs stay held until it has stopped
    led.release_server("alice", "", server.id, "server stopped")  # the stop it asked for
    assert led.get(server.id).end_reason == "its time limit (2 h) ran out at 11:00:00 UTC"
    assert led.get(forever.id).state == "running"  # carol's 8 h have not run out
    led.clock.advance(hours=6)
    assert [a.id for a in led.settle_time_limits().ended] == [forever.id]


def test_no_time_limit_at_all_leaves_everything_running(db_url):
    ledger = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=4)), clock=Clock(T))
    ledger.sync_inventory(INV)
    try:
        a = ledger.allocate("alice", [], 1, purpose="distributed", lease_seconds=1000 * 86400)
        assert a.time_limit_seconds is None and a.time_ends is None
        ledger.clock.advance(days=400)
        assert ledger.settle_time_limits().ended == [] and ledger.get(a.id).state == "running"
    finally:
        ledger.close()


def test_hours_text_is_short():
    assert [timelimits.hours_text(h) for h in (8, 1.5, 1 / 60, 0.001)] == [
        "8 h",
        "1 h 30 min",
        "1 min",
        "under a minute",
    ]
    assert math.isclose(timelimits.MIN_HOURS * 60, 1)


# warnings -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, want",
    [([30, 5], (30.0, 5.0)), ([5, 30, 5], (30.0, 5.0)), ([], ()), ((0.5,), (0.5,))],
)
def test_the_warning_times_are_read_latest_first_once_each(raw, want):
    assert timelimits.read_warnings(raw, "c.GpuHub.time_warning_minutes") == want


@pytest.mark.parametrize(
    "bad", [[0], [-5], [float("nan")], [float("inf")], [20000], ["5"], [True], 5, "30,5"]
)
def test_a_bad_warning_time_is_refused_naming_the_setting(bad):
    hub = GpuHub()
    if isinstance(bad, list) and not any(isinstance(m, str | bool) for m in bad):
        hub.time_warning_minutes = bad
    if not isinstance(bad, list):
        with pytest.raises(ValueError, match=r"c.GpuHub.time_warning_minutes must be a list of minutes"):
            timelimits.read_warnings(bad, "c.GpuHub.time_warning_minutes")
        return
    with pytest.raises(ValueError) as e:
        if any(isinstance(m, str | bool) for m in bad):  # the trait itself refuses or casts these
            timelimits.read_warnings(bad, "c.GpuHub.time_warning_minutes")
        else:
            hub.time_warnings()
    assert str(e.value).startswith(
        "c.GpuHub.time_warning_minutes must hold numbers of minutes from 0.1 to 10080 (a week)"
    )


END = End(7, "the burst's", 8 * 3600.0, 10_000.0, (30.0, 5.0))


@pytest.mark.parametrize(
    "now, said, want",
    [
        (10_000 - 31 * 60, [], []),  # before the first
        (10_000 - 30 * 60, [], [30.0]),
        (10_000 - 20 * 60, [30.0], []),  # said already
        (10_000 - 4 * 60, [30.0], [5.0]),
        (10_000 - 4 * 60, [], [30.0, 5.0]),  # a kernel that slept through the first: both due, latest first
        (10_000 + 60, [30.0, 5.0], []),
    ],
)
def test_due_warnings(now, said, want):
    assert due_warnings(END, now, said) == want


def test_the_warning_says_when_and_what_happens_to_the_work():
    with_autosave = warning_text(END, 10_000 - 30 * 60, ["model", "opt"], "/ckpt", 30.0)
    assert with_autosave.startswith(
        "gpuhub: TIME: the burst's time limit (8 h, allocation #7) runs out at 02:46:40 UTC (in 30 min)."
    )
    assert "At 02:46:10 UTC a running cell is interrupted, model, opt autosaved to /ckpt" in with_autosave
    bare = warning_text(END, 10_000 - 60, [], "/ckpt", 30.0)
    assert "their variables are lost (this pool has no --autosave): run %distributed save NAME" in bare


def test_an_allocations_end_from_the_brokers_json():
    a = {"id": 4, "time_limit": {"seconds": 60.0, "ends": "1970-01-01T02:46:40Z", "warnings": [5, "x"]}}
    assert end_of(a, "the server's") == End(4, "the server's", 60.0, 10_000.0, (5.0,))
    assert end_of({"id": 4, "time_limit": None}, "the server's") is None


def test_my_gpus_says_when_the_first_warning_time_has_come():
    from spawner.broker.responses import warned

    a = led_info(created=T, started=T, seconds=3600)
    assert warned(a, (30.0, 5.0), T + timedelta(minutes=29))["time_limit"]["warned"] is False
    got = warned(a, (30.0, 5.0), T + timedelta(minutes=30))["time_limit"]
    assert got == {"seconds": 3600, "ends": "2026-12-04T10:00:00Z", "warnings": [30.0, 5.0], "warned": True}
    assert warned(a, (), T + timedelta(minutes=59))["time_limit"]["warned"] is False  # no warnings set
    assert warned(led_info(created=T, started=T, seconds=None), (30.0,), T) == {}


# expected starts from what is known ------------------------------------------------------------


def test_a_wait_behind_a_time_limit_expects_its_end_firmly(led):
    bob = led.allocate("bob", [], 4, hours=1)  # bob's session ends in an hour, whatever he does
    led.clock.advance(minutes=10)
    carol = led.request("carol", [], 2).entry
    assert (carol.expected, carol.sure) == (bob.time_ends, "limit")
    assert "(in 50 min; when a time limit ends, not a promise)" in carol.line(led.clock())


def test_a_wait_with_no_history_and_no_limit_cannot_tell_yet(db_url):
    ledger = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=4)), clock=Clock(T))
    ledger.sync_inventory(INV)
    try:
        ledger.allocate("bob", [], 4)
        carol = ledger.request("carol", [], 2).entry
        assert carol.sure == "default"
        assert carol.line(ledger.clock()).endswith(
            "cannot tell yet when it starts (no run here has ended yet to go by)"
        )
    finally:
        ledger.close()


def test_a_known_end_beats_a_guess_and_the_earliest_known_wins():
    from spawner.ledger.queue import known_end

    class A:  # the columns known_end reads
        started, created, idle_deadline = T, T, None
        time_limit_seconds = 2 * 3600.0

    now = T + timedelta(minutes=30)
    assert known_end(A, now, False, None) == (T + timedelta(hours=2), "limit")
    assert known_end(A, now, False, T + timedelta(minutes=40)) == (
        T + timedelta(minutes=40),
        "firm",
    )  # a notice
    assert known_end(A, now, True, None) == (now + timedelta(minutes=1), "firm")  # reclaimed: any moment
    A.time_limit_seconds = None
    assert known_end(A, now, False, None) == (None, None)  # nothing known: the caller guesses
