"""Energy per allocation (spawner.policy.energy), the broker's meter over it, the facility's
settings, and the ledger's energy rows (SQLite and PostgreSQL)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, date, datetime, timedelta

import pytest

from spawner.broker.energy_meter import EnergyMeter
from spawner.broker.utilization import Sample
from spawner.ledger import Ledger
from spawner.policy import Gpu, budgets
from spawner.policy.energy import (
    Costing,
    Energy,
    Interval,
    Point,
    Share,
    Span,
    attribute,
    describe,
    figures,
    interval,
    reclaim_saving,
)
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.records import AllocationInfo
from spawner.settings import GpuHub

T0 = datetime(2026, 12, 7, 10, 0, tzinfo=UTC).timestamp()
DAY = date(2026, 12, 7)


def p(t, watts=None, mj=None, idle=False):
    return Point(T0 + t, watts, mj, idle)


@pytest.mark.parametrize(
    "prev, cur, joules, how",
    [
        (p(0, 100, 1_000_000), p(10, 300, 3_000_000), 2000.0, "counter"),  # the counter, not the power
        (p(0, 100, None), p(10, 300, None), 2000.0, "power"),  # trapezoid: (100+300)/2 * 10
        (p(0, 100, 5_000_000), p(10, 100, 1_000), 1000.0, "power"),  # counter went back: a reset
        (p(0, 100, 0), p(10, 100, 10**12), 1000.0, "power"),  # a jump past any GPU's draw
        (p(0, None, 5_000_000), p(10, None, 1_000), None, "unknown"),  # reset, and no power
        (p(0, 100, 0), p(10, None, None), None, "unknown"),  # nothing to go by
        (p(0, 100, 0), p(1000, 100, 100_000_000), None, "unknown"),  # a gap: never zero
    ],
)
def test_an_interval_uses_the_counter_then_power_and_says_unknown(prev, cur, joules, how):
    iv = interval(prev, cur, max_gap=180, max_watts=2000)
    assert iv.how == how
    assert iv.joules == joules
    assert iv.seconds == cur.t - prev.t


def test_idle_needs_both_ends_under_the_threshold():
    assert interval(p(0, 60, idle=True), p(10, 60, idle=True), 180, 2000).idle
    assert not interval(p(0, 60, idle=True), p(10, 300, idle=False), 180, 2000).idle


def test_an_interval_is_shared_by_the_time_each_holder_held_the_gpu():
    iv = Interval(T0, T0 + 10, 1000.0, idle=False, how="counter")  # 100 W for 10 s
    # allocation 1 ended at 4 s, allocation 2 began at 6 s: 2 s held by nobody
    shares = {s.allocation_id: s for s in attribute(iv, [Span(1, T0 - 50, T0 + 4), Span(2, T0 + 6)])}
    assert shares[1].joules == pytest.approx(400.0) and shares[1].measured_seconds == pytest.approx(4)
    assert shares[2].joules == pytest.approx(400.0) and shares[2].measured_seconds == pytest.approx(6 - 2)
    assert shares[1].idle_joules == 0.0


def test_a_slice_gets_its_fraction_and_idle_energy_is_marked():
    iv = Interval(T0, T0 + 10, 600.0, idle=True, how="power")
    (s,) = attribute(iv, [Span(7, T0 - 1, None, share=0.25)])
    assert s.joules == pytest.approx(150.0) and s.idle_joules == pytest.approx(150.0)
    assert s.measured_seconds == pytest.approx(2.5)


def test_an_interval_across_midnight_goes_to_both_days():
    midnight = datetime(2026, 12, 8, tzinfo=UTC).timestamp()
    iv = Interval(midnight - 30, midnight + 10, 4000.0, idle=False, how="counter")
    shares = sorted(attribute(iv, [Span(1, midnight - 100)]), key=lambda s: s.day)
    assert [s.day for s in shares] == [date(2026, 12, 7), date(2026, 12, 8)]
    assert [round(s.joules) for s in shares] == [3000, 1000]


def test_unknown_time_is_counted_as_unknown_never_as_zero():
    iv = Interval(T0, T0 + 600, None, idle=False, how="unknown")
    (s,) = attribute(iv, [Span(3, T0 - 1)])
    assert s.joules == 0.0 and s.unknown_seconds == 600 and s.measured_seconds == 0


def test_figures_derive_the_meter_money_and_carbon():
    e = Energy(joules=3.6e6 * 2, idle_joules=3.6e6 * 0.5, measured_seconds=3600, unknown_seconds=1200)
    f = figures(e, Costing(pue=1.5, price_per_kwh=0.2, currency="EUR", carbon_g_per_kwh=400))
    assert f["gpu_kwh"] == 2.0 and f["idle_kwh"] == 0.5 and f["idle_share"] == 0.25
    assert f["meter_kwh"] == 3.0 and f["cost"] == pytest.approx(0.6) and f["currency"] == "EUR"
    assert f["co2e_kg"] == pytest.approx(1.2)
    assert f["unknown_share"] == 0.25
    bare = figures(e, Costing())
    assert bare["cost"] is None and bare["co2e_kg"] is None and bare["meter_kwh"] == 2.0
    text = describe(e, Costing(pue=1.5, price_per_kwh=0.2, currency="EUR"))
    assert text.startswith("2.000 kWh at the GPUs (3.000 kWh at the meter, 0.60 EUR); 25 % of it idle")
    assert "0.33 GPU-hours not measured" in text


@pytest.mark.parametrize(
    "setting, value, words",
    [
        ("pue", 0.9, "c.GpuHub.pue must be from 1 to 5"),
        ("pue", float("nan"), "c.GpuHub.pue must be from 1 to 5"),
        ("energy_price", -0.1, "c.GpuHub.energy_price must be 0 or more"),
        ("energy_price", float("inf"), "c.GpuHub.energy_price must be 0 or more"),
        ("energy_currency", "EURO", "c.GpuHub.energy_currency must be an ISO 4217 code"),
        ("carbon_intensity", -1.0, "c.GpuHub.carbon_intensity must be from 0 to 2000"),
        ("carbon_intensity", float("inf"), "c.GpuHub.carbon_intensity must be from 0 to 2000"),
    ],
)
def test_bad_facility_settings_are_refused_with_the_setting_and_its_range(setting, value, words):
    hub = GpuHub()
    setattr(hub, setting, value)
    if setting == "energy_price":
        hub.energy_currency = "EUR"
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        hub.costing()


def test_a_price_without_a_currency_is_refused():
    hub = GpuHub(energy_price=0.3)
    with pytest.raises(ValueError, match=r"set c\.GpuHub\.energy_currency too"):
        hub.costing()
    costing = GpuHub(energy_price=0.3, energy_currency="CHF", pue=1.4).costing()
    assert costing == Costing(1.4, 0.3, "CHF", None)


def info(id_, created, gpus=()):
    c = datetime.fromtimestamp(created, UTC).replace(tzinfo=None)
    return AllocationInfo(id_, "alice", "server", "", "running", c, c, None, "local", None, None, tuple(gpus))


def s(util=50.0, watts=None, mj=None):
    return Sample("n1", 0, util, 0, None, watts, mj)


def test_the_meter_shares_a_reading_between_the_holder_that_left_and_the_next():
    meter = EnergyMeter()
    key = ("n1", 0)
    a, b = info(1, T0 - 100), info(2, T0 + 7)
    assert meter.observe([s(watts=100)], {key: a}, {}, 5, 180, now=T0) == []  # first reading
    got = meter.observe([s(watts=100)], {key: a}, {}, 5, 180, now=T0 + 5)
    assert [(x.allocation_id, round(x.joules)) for x in got] == [(1, 500)]
    # a ended at +6, b began at +7: the 10 s to +15 are 1 s a's, 1 s nobody's, 8 s b's
    assert meter.left_holders([s()], {key: b}) == {1}
    ended = {1: datetime.fromtimestamp(T0 + 6, UTC).replace(tzinfo=None)}
    got = {x.allocation_id: x for x in meter.observe([s(watts=100)], {key: b}, ended, 5, 180, now=T0 + 15)}
    assert round(got[1].joules) == 100 and round(got[2].joules) == 800
    # an idle reading (under the threshold at both ends) marks the energy idle
    got = meter.observe([s(util=1, watts=60)], {key: b}, {}, 5, 180, now=T0 + 25)
    assert got[0].idle_joules == 0  # one end busy
    got = meter.observe([s(util=1, watts=60)], {key: b}, {}, 5, 180, now=T0 + 35)
    assert got[0].idle_joules == pytest.approx(600) and meter.watts(key, 60, now=T0 + 40) == 60


def test_the_holders_of_a_gpus_slices_each_get_their_share_of_its_energy():
    meter = EnergyMeter()
    key = ("n1", 0)
    a, b = replace(info(1, T0 - 100), slice_parts=4), replace(info(2, T0 - 100), slice_parts=4)
    meter.observe([s(watts=200)], {key: (a, b)}, {}, 5, 180, now=T0)
    got = {x.allocation_id: x for x in meter.observe([s(watts=200)], {key: (a, b)}, {}, 5, 180, now=T0 + 10)}
    # 2000 J in 10 s: a quarter each, the half nobody holds goes to nobody
    assert {i: round(x.joules) for i, x in got.items()} == {1: 500, 2: 500}
    assert got[1].measured_seconds == pytest.approx(2.5)  # a quarter GPU for 10 s
    assert meter.holder_user(key) == "alice"
    ended = {1: datetime.fromtimestamp(T0 + 15, UTC).replace(tzinfo=None)}
    got = {x.allocation_id: x for x in meter.observe([s(watts=200)], {key: (b,)}, ended, 5, 180, now=T0 + 20)}
    assert {i: round(x.joules) for i, x in got.items()} == {1: 250, 2: 500}  # a left at +15


@pytest.fixture
def ledger(db_url):
    led = Ledger(db_url)
    led.sync_inventory([Gpu("n1", i, "A100") for i in range(2)])
    yield led
    led.close()


def test_the_ledger_adds_energy_per_allocation_and_day_and_reads_it_back(ledger):
    a = ledger.allocate("alice", [], 1)
    b = ledger.allocate("bob", [], 1)
    d1, d2 = DAY, DAY + timedelta(days=1)
    ledger.add_energy([Share(a.id, d1, 1000.0, 400.0, 10.0, 0.0), Share(b.id, d1, 50.0, 0.0, 1.0, 5.0)])
    ledger.add_energy([Share(a.id, d1, 500.0, 0.0, 5.0, 0.0), Share(a.id, d2, 300.0, 300.0, 3.0, 0.0)])
    assert ledger.add_energy([Share(9999, d1, 1.0)]) == 0  # an allocation the ledger never had
    since, until = datetime(2026, 12, 7), datetime(2026, 12, 9)
    totals = ledger.energy_totals(since, until)
    assert totals["alice"] == Energy(1800.0, 700.0, 18.0, 0.0)
    assert totals["bob"] == Energy(50.0, 0.0, 1.0, 5.0)
    assert ledger.energy_totals(since, datetime(2026, 12, 8))["alice"].joules == 1500.0  # one day
    assert ledger.energy_days(since, until, user="alice") == {
        "alice": {d1: Energy(1500.0, 400.0), d2: Energy(300.0, 300.0)}  # what the chart draws
    }
    assert ledger.energy_of([a.id]).joules == 1800.0
    assert ledger.energy_by_purpose()[("alice", "server")].idle_joules == 700.0
    ledger.release(a.id, "done")
    assert ledger.ended_times([a.id, b.id])[b.id] is None
    assert ledger.ended_times([a.id])[a.id] is not None


# -- energy budgets ------------------------------------------------------------------------------

EUR = Costing(pue=1.5, price_per_kwh=0.25, currency="EUR")


@pytest.mark.parametrize(
    "raw, words",
    [
        ({"joules": 5}, "unknown keys ['joules']"),
        ({"kwh": 5, "cost": 2}, "give one of kwh or cost"),
        ({"window_hours": 24}, "give one of kwh or cost"),
        ({"kwh": -1}, "['kwh'] must be a number from 0"),
        ({"kwh": float("nan")}, "['kwh'] must be a number from 0"),
        ({"kwh": "5"}, "['kwh'] must be a number from 0"),
        ({"kwh": 5, "window_hours": 0}, "['window_hours'] must be a number from 0.01"),
        (5, "an energy budget is a dict or None"),
    ],
)
def test_a_bad_budget_is_refused_naming_the_setting(raw, words):
    with pytest.raises(ValueError) as e:
        budgets.parse_budget(raw, "c.GpuHub.user_energy_budgets['bob']", EUR)
    assert str(e.value).startswith("c.GpuHub.user_energy_budgets['bob']") and words in str(e.value)


def test_a_money_budget_needs_a_currency_and_a_price():
    with pytest.raises(ValueError, match=r"a money budget needs c\.GpuHub\.energy_currency"):
        budgets.parse_budget({"cost": 5}, "c.GpuHub.default_energy_budget", Costing())
    assert budgets.parse_budget({"cost": 5}, "x", EUR) == budgets.EnergyBudget(5.0, "cost")
    assert budgets.parse_budget(None, "x", EUR) is None and budgets.parse_budget({}, "x", EUR) is None
    with pytest.raises(ValueError, match="a money budget needs"):
        GpuHub(default_energy_budget={"cost": 5}).budget_rules()  # refused at start


def test_several_groups_give_the_most_generous_budget_money_as_the_kwh_it_buys():
    rules = budgets.BudgetRules(
        groups={
            "lab": budgets.EnergyBudget(10.0, "kwh"),
            "rich": budgets.EnergyBudget(5.0, "cost"),  # 5 EUR at 0.25 EUR/kWh: 20 kWh
            "free": None,
        }
    )
    assert budgets.effective_budget("u", ["lab", "rich"], rules, EUR) == (
        budgets.EnergyBudget(5.0, "cost"),
        "group rich",
    )
    assert budgets.effective_budget("u", ["lab", "free"], rules, EUR) == (None, "group free")
    assert budgets.effective_budget("u", [], rules, EUR) == (None, "default")


def test_a_budget_is_spent_at_its_amount_in_its_unit():
    kwh = budgets.EnergyBudget(3.0, "kwh", 24)
    almost = Energy(joules=1.99 * 3.6e6)  # 2.985 kWh at the meter (PUE 1.5)
    assert budgets.spent_message(kwh, "user bob", almost, EUR) is None
    text = budgets.spent_message(kwh, "user bob", Energy(joules=2 * 3.6e6), EUR)
    assert text.startswith("You have used 3.000 kWh at the meter of your energy budget, 3 kWh of energy")
    assert "over 24 hours (user bob)" in text and "Start a server without GPUs (0)" in text
    money = budgets.EnergyBudget(1.0, "cost")
    text = budgets.spent_message(money, "default", Energy(joules=3.6e6 * 3), EUR)  # 4.5 kWh: 1.125 EUR
    assert text.startswith("You have used 1.12 EUR of your energy budget, 1 EUR of energy over 168 hours")


def test_a_spent_budget_refuses_a_request_and_ends_a_wait_at_its_turn(db_url):
    rules = budgets.BudgetRules(default=budgets.EnergyBudget(1.0, "kwh", 48))
    led = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=2)), costing=EUR, budgets=rules)
    try:
        led.sync_inventory([Gpu("n1", i, "A100") for i in range(2)])
        today = led.clock().date()
        bob = led.allocate("bob", [], 1)  # nothing used yet: within the budget
        led.add_energy([Share(bob.id, today, 0.7 * 3.6e6)])  # 1.05 kWh at the meter (PUE 1.5)
        led.release(bob.id, "done")
        with pytest.raises(Refusal) as e:
            led.allocate("bob", [], 1)
        assert e.value.reason == "energy_budget_spent" and "1.050 kWh at the meter" in e.value.message
        assert e.value.status_code == 403

        # carol waits within her budget; her other allocation spends it while she waits
        carol = led.allocate("carol", [], 1)
        alice = led.allocate("alice", [], 1)
        entry = led.request("carol", [], 1).entry
        assert entry is not None and entry.state == "waiting"
        led.add_energy([Share(carol.id, today, 0.7 * 3.6e6)])
        led.release(alice.id, "done")  # her turn comes, with the budget spent
        got = led.wait_turn(entry.id)
        assert got.allocation is None and got.entry.state == "left"
        assert got.entry.end_reason.startswith("you have used 1.050 kWh at the meter of your energy budget")
        assert [a.id for a in led.active(user="carol")] == [carol.id]
    finally:
        led.close()


def test_idle_seconds_are_counted_so_an_idle_draw_is_known():
    iv = Interval(T0, T0 + 10, 600.0, idle=True, how="power")
    (s,) = attribute(iv, [Span(1, T0 - 5)])
    assert s.idle_seconds == 10 and s.measured_seconds == 10
    e = Energy(joules=900.0, idle_joules=600.0, measured_seconds=15, idle_seconds=10)
    assert e.idle_watts == 60.0 and Energy(joules=5.0, measured_seconds=1).idle_watts is None


@pytest.mark.parametrize(
    "limit_end, now, saved",
    [
        (None, T0 + 1000, 60.0 * 2 * 300),  # as long again as it had been idle (300 s)
        (None, T0 + 100, 60.0 * 2 * 100),  # never past now
        (T0 + 50, T0 + 1000, 60.0 * 2 * 50),  # its time limit would have ended it sooner
        (T0 - 50, T0 + 1000, 0.0),  # already past its limit
    ],
)
def test_a_reclaims_saving_is_the_idle_draw_for_as_long_as_it_would_have_run(limit_end, now, saved):
    assert reclaim_saving(60.0, 2, 300.0, T0, limit_end, now) == pytest.approx(saved)
    assert reclaim_saving(None, 2, 300.0, T0, limit_end, now) is None  # never measured idle


def test_the_meters_counters_add_what_was_written_and_forget_allocations_that_left():
    meter = EnergyMeter()
    meter.seed({("alice", "server"): Energy(joules=100.0)})
    key = ("n1", 0)
    a = info(1, T0 - 100)
    meter.observe([s(watts=100)], {key: a}, {}, 5, 180, now=T0)
    shares = meter.observe([s(watts=100)], {key: a}, {}, 5, 180, now=T0 + 10)
    meter.count(shares)
    assert meter.totals[("alice", "server")].joules == pytest.approx(1100.0)
    ended = {1: datetime.fromtimestamp(T0 + 15, UTC).replace(tzinfo=None)}
    shares = meter.observe([s(watts=100)], {}, ended, 5, 180, now=T0 + 20)  # released at +15
    meter.count(shares)
    assert meter.totals[("alice", "server")].joules == pytest.approx(1600.0)
    assert meter.owners == {}  # its last share counted: nothing kept for it
