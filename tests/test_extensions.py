"""Extending a session's time limit, the parts without a hub: the settings and a magic's
length (pure, table tests) and the ledger's decision and record (SQLite and PostgreSQL):
granted within the cap, refused past it, refused when someone waiting would start later,
an admin's extension past both, a backend's refusal taken back."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest

from spawner.ledger import Ledger, QueueSettings
from spawner.policy import extensions, values
from spawner.policy.extensions import ExtendSettings
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu
from spawner.policy.timelimits import TimeRules
from spawner.settings import GpuHub

from .ledgertools import Clock

T = datetime(2026, 12, 7, 9, 0)
INV = [Gpu("n1", i, "A100") for i in range(4)]


@pytest.mark.parametrize(
    "raw, hours",
    [("2h", 2.0), ("2 hours", 2.0), ("1 hour", 1.0), ("90min", 1.5), ("30m", 0.5), ("1.5", 1.5), ("1H", 1.0)],
)
def test_a_length_from_the_magic(raw, hours):
    assert extensions.parse_duration(raw) == pytest.approx(hours)


@pytest.mark.parametrize("raw", ["", "two hours", "-1h", "0h", "0.5min", "9000h", "2d", "1e3", "2h30"])
def test_a_bad_length_says_what_it_takes(raw):
    with pytest.raises(values.BadValue) as e:
        extensions.parse_duration(raw)
    assert str(e.value).startswith("--extend takes a length such as 2h, 90min or 1.5 (hours), from 1/60")


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), 0.001, 10_000, "4", True])
def test_a_bad_cap_is_refused_naming_the_setting(bad):
    hub = GpuHub()
    if isinstance(bad, str | bool):  # the trait itself refuses these
        with pytest.raises(ValueError):
            extensions.read_max_hours(bad, "c.GpuHub.extension_max_hours")
        return
    hub.extension_max_hours = bad
    with pytest.raises(ValueError) as e:
        hub.extend_settings()
    assert str(e.value).startswith(
        "c.GpuHub.extension_max_hours must be 0 (no extensions), a number of hours"
    )


def test_the_settings_default_to_no_extensions():
    hub = GpuHub()
    assert hub.extend_settings() == ExtendSettings(0.0, False)
    hub.extension_max_hours, hub.extension_delays_waiters = None, True
    assert hub.extend_settings() == ExtendSettings(None, True)


@pytest.mark.parametrize(
    "before, after, want",
    [
        ({1: T, 2: T}, {1: T, 2: T}, []),
        ({1: T, 2: T}, {1: T + timedelta(hours=1), 2: T}, [1]),
        ({1: T}, {1: None}, [1]),  # no expected start any more: delayed
        ({1: None}, {1: None}, []),  # nothing expected to keep
        ({1: T}, {1: T + timedelta(milliseconds=500)}, []),  # rounding, not a delay
    ],
)
def test_delayed(before, after, want):
    assert extensions.delayed(before, after) == want


@pytest.mark.parametrize(
    "asked, done, cap, late, allowed, want",
    [
        (2, 0, 4, 0, False, None),
        (4, 0, 4, 0, False, None),
        (1, 3 * 3600, 4, 0, False, None),
        (
            2,
            3 * 3600,
            4,
            0,
            False,
            "An extension of 2 h is more than a session may be extended by for you: 4 h in all (cap), "
            "and it was extended by 3 h already; ask for 1 h or less.",
        ),
        (
            1,
            4 * 3600,
            4,
            0,
            False,
            "An extension of 1 h is more than a session may be extended by for you: 4 h in all (cap), "
            "and it was extended by 4 h already; it cannot be extended further.",
        ),
        (
            1,
            0,
            0,
            0,
            False,
            "Sessions here cannot be extended (c.GpuHub.extension_max_hours is 0); save your work "
            "before the end, or ask an admin of this hub to extend it.",
        ),
        (100, 0, None, 0, False, None),  # no cap
        (
            1,
            0,
            None,
            2,
            False,
            "Not extended: 2 requests wait for these GPUs and would start later than expected. "
            "Save your work before the end; the GPUs go to the queue then.",
        ),
        (1, 0, None, 2, True, None),  # the admin's setting allows delaying them
    ],
)
def test_extension_refusal(asked, done, cap, late, allowed, want):
    got = extensions.extension_refusal(asked, done, cap, "cap", late, allowed)
    assert (got.message if got else None) == want
    if got:
        assert (got.reason, got.status_code) == ("extension_refused", 403)


def ledger(db_url, cap=4.0, delays=False) -> Ledger:
    led = Ledger(
        db_url,
        config_rules=LimitRules(default=Limit(max_gpus=4)),
        clock=Clock(T),
        queue=QueueSettings(keepalive_seconds=3600),
        time_rules=TimeRules(default=2.0),
        extend=ExtendSettings(cap, delays),
    )
    led.sync_inventory(INV)
    return led


def test_an_extension_is_granted_recorded_and_moves_the_end(db_url):
    led = ledger(db_url)
    try:
        a = led.allocate("bob", [], 2)
        assert a.time_ends == T + timedelta(hours=2)
        led.clock.advance(minutes=90)
        got, ext = led.extend(a.id, 1.5, "bob")
        assert got.time_ends == T + timedelta(hours=3, minutes=30) == led.get(a.id).time_ends
        assert (ext.user, ext.by, ext.at, ext.seconds) == ("bob", "bob", T + timedelta(minutes=90), 5400.0)
        assert (ext.before_seconds, ext.after_seconds) == (7200.0, 12600.0)
        # the rest of the cap (4 h in all): 2.5 h more, not 3
        with pytest.raises(
            Refusal, match=r"and it was extended by 1 h 30 min already; ask for 2 h 30 min or less"
        ):
            led.extend(a.id, 3, "bob")
        led.extend(a.id, 2.5, "bob")
        assert [e.seconds for e in led.extensions(user="bob")] == [9000.0, 5400.0]  # newest first
        # the time-limit pass keeps it until the new end
        led.clock.advance(hours=4)
        assert led.settle_time_limits().servers == [] and led.get(a.id).state != "released"
        led.clock.advance(hours=2, minutes=1)
        assert [s.id for s in led.settle_time_limits().servers] == [a.id]
    finally:
        led.close()


def test_an_extension_that_would_make_a_waiter_start_later_is_refused_unless_allowed(db_url):
    led = ledger(db_url)
    try:
        a = led.allocate("bob", [], 4)  # every GPU, for 2 h
        carol = led.request("carol", [], 2).entry
        assert (carol.expected, carol.sure) == (a.time_ends, "limit")
        with pytest.raises(Refusal) as e:
            led.extend(a.id, 1, "bob")
        assert e.value.message.startswith(
            "Not extended: 1 request waits for these GPUs and would start later"
        )
        assert led.get(a.id).time_ends == T + timedelta(hours=2) and led.extensions() == []
        # an admin may: their explicit act, recorded as theirs
        got, ext = led.extend(a.id, 1, "admin", admin=True)
        assert got.time_ends == T + timedelta(hours=3) and ext.by == "admin"
        [waiting] = [q for q in led.queue() if q.id == carol.id]
        assert waiting.expected == got.time_ends  # the queue now expects the new end
    finally:
        led.close()
    led = ledger(db_url, cap=None, delays=True)  # the admin's setting: waiters may be delayed
    try:
        [live] = led.active(user="bob")
        assert led.extend(live.id, 1, "bob")[0].time_ends == T + timedelta(hours=4)
    finally:
        led.close()


def test_what_cannot_be_extended_says_why(db_url):
    led = ledger(db_url, cap=0.0)
    try:
        a = led.allocate("bob", [], 1)
        with pytest.raises(Refusal, match="Sessions here cannot be extended"):
            led.extend(a.id, 1, "bob")
        unlimited = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=4)), clock=led.clock)
        try:
            b = unlimited.allocate("carol", [], 1)
            with pytest.raises(Refusal, match=f"Allocation {b.id} has no time limit; it needs no extension"):
                unlimited.extend(b.id, 1, "carol")
        finally:
            unlimited.close()
        led.release(a.id)
        with pytest.raises(Refusal) as e:
            led.extend(a.id, 1, "bob", admin=True)
        assert (e.value.reason, e.value.status_code) == ("not_found", 404)
    finally:
        led.close()


def test_an_extension_the_backend_refused_is_taken_back(db_url):
    led = ledger(db_url)
    try:
        a = led.allocate("bob", [], 1)
        _, ext = led.extend(a.id, 1, "bob")
        led.undo_extension(ext.id)
        assert led.get(a.id).time_limit_seconds == 7200.0 and led.extensions() == []
        led.extend(a.id, 4, "bob")  # the cap counts only what stands
    finally:
        led.close()
