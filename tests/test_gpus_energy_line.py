"""``%gpus``'s energy words (gpu_magics.kernel.energy): one allocation's figures in a line, as
spawner.policy.energy.describe says them, and this session's allocations added up. Pure."""

from datetime import UTC, datetime

import pytest

from gpu_magics.kernel import energy
from spawner.policy.energy import Costing, Energy, describe, figures


def fig(gpu=2.0, idle=0.5, pue=1.5, cost=0.6, currency="EUR", co2e=None, unknown=0.0, measured=4.0):
    return {
        "gpu_kwh": gpu,
        "idle_kwh": idle,
        "idle_share": idle / gpu if gpu else None,
        "meter_kwh": gpu * pue,
        "cost": cost,
        "currency": currency,
        "co2e_kg": co2e,
        "measured_gpu_hours": measured,
        "unknown_gpu_hours": unknown,
        "unknown_share": None,
    }


@pytest.mark.parametrize(
    "f, pue, text",
    [
        (None, 1.5, "not measured yet"),
        (
            fig(),
            1.5,
            "2.000 kWh at the GPUs (3.000 kWh at the meter, 0.60 EUR); 25 % of it idle",
        ),
        # PUE 1: the meter says what the GPUs say; no currency: no cost
        (fig(pue=1.0, cost=None, currency=None), 1.0, "2.000 kWh at the GPUs; 25 % of it idle"),
        # no PUE known: the meter's kWh where it differs
        (fig(pue=1.0, cost=None, currency=None), None, "2.000 kWh at the GPUs; 25 % of it idle"),
        (
            fig(co2e=1.05, unknown=0.25),
            1.5,
            "2.000 kWh at the GPUs (3.000 kWh at the meter, 0.60 EUR, 1.050 kg CO2e); 25 % of it idle; "
            "0.25 GPU-hours not measured",
        ),
        # nothing used (no share of it idle), but time not measured
        (
            fig(gpu=0.0, idle=0.0, pue=1.0, cost=0.0, unknown=1.0, measured=0.0),
            1.0,
            "0.000 kWh at the GPUs (0.00 EUR); 1.00 GPU-hours not measured",
        ),
    ],
)
def test_an_allocations_energy_in_one_line(f, pue, text):
    assert energy.energy_text(f, pue) == text


def test_the_line_says_what_the_brokers_describe_says():
    e = Energy(joules=7.2e6, idle_joules=1.8e6, measured_seconds=3600, unknown_seconds=1800)
    c = Costing(pue=1.3, price_per_kwh=0.25, currency="EUR", carbon_g_per_kwh=350)
    assert energy.energy_text(figures(e, c), c.pue) == describe(e, c)
    c1 = Costing()
    assert energy.energy_text(figures(e, c1), c1.pue) == describe(e, c1)


def alloc(aid, purpose="server", server="", f=None):
    return {"id": aid, "purpose": purpose, "server_name": server, "energy": f}


def test_this_session_adds_up_its_servers_allocation_and_its_kernels_bursts():
    me = {
        "energy": {"pue": 1.5, "currency": "EUR"},
        "allocations": [
            alloc(1, f=fig(gpu=2.0, idle=0.5, cost=0.6, unknown=0.25)),
            alloc(2, "distributed", f=fig(gpu=1.0, idle=0.0, cost=0.3)),
            alloc(3, "distributed", f=None),  # not measured yet: adds nothing
            alloc(4, server="other", f=fig(gpu=5.0)),  # another server of the user's
        ],
    }
    assert energy.session_line(me, "", [1]) == (
        "This session so far (what it holds now): 3.000 kWh at the GPUs (4.500 kWh at the meter, 0.90 EUR); "
        "17 % of it idle; 0.25 GPU-hours not measured"
    )
    # the named server "other": its own allocation alone
    assert energy.session_line(me, "other", [4]).startswith(
        "This session so far (what it holds now): 5.000 kWh"
    )
    # a burst asked for outside this server, but this kernel's pool: counted by its id
    assert [a["id"] for a in energy.session_allocations(me, "other", [4, 2])] == [2, 4]


def test_this_session_says_when_nothing_is_measured_yet():
    none = "This session so far (what it holds now): not measured yet"
    assert energy.session_line({"allocations": [alloc(1)]}, "", [1]) == none
    assert energy.session_line({"allocations": []}, "", []) == none
    # an older broker without energy at all
    old = {"allocations": [{"id": 1, "purpose": "server", "server_name": ""}]}
    assert energy.session_line(old, "", [1]) == none


def test_a_sum_keeps_cost_and_co2e_only_where_given():
    total = energy.add_up([fig(cost=None, currency=None, co2e=0.5), fig(cost=None, currency=None, co2e=None)])
    assert total["cost"] is None and total["co2e_kg"] == 0.5 and total["gpu_kwh"] == 4.0
    assert total["idle_share"] == pytest.approx(0.25)
    assert energy.add_up([None, None]) is None


def test_the_brokers_session_counts_ended_bursts_too_and_wins():
    me = {
        "energy": {"pue": 1.0},
        "allocations": [alloc(1, f=fig(gpu=2.0, idle=0.5, cost=None, currency=None, unknown=0.0))],
        "session": {
            "server": "",
            "since": "2026-12-07T06:00:00Z",
            "energy": fig(gpu=7.0, idle=0.0, cost=None, currency=None, unknown=0.0),
        },
    }
    assert energy.session_line(me, "", [1]) == "This session so far: 7.000 kWh at the GPUs; 0 % of it idle"
    nothing = {
        **me,
        "session": {"server": "", "since": "x", "energy": fig(gpu=0.0, idle=0.0, measured=0.0, unknown=0.0)},
    }
    assert energy.session_line(nothing, "", [1]) == "This session so far: not measured yet"


def test_a_kernels_server_start_is_its_parent_process_start():
    import os

    import psutil

    started = energy.server_started()
    expected = psutil.Process(os.getppid()).create_time()
    assert started == datetime.fromtimestamp(expected, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert energy.server_started(ppid=2**22 + 12345) is None  # no such process: unknown
