"""Power and energy readings (issue 33): what NvmlSource and SimulatedSource read, what the
node sampler and the reporters post, and what the broker refuses. No hub, no GPU: NVML is faked."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gpu_magics.report.gpustats import SIM_IDLE_WATTS, SIM_MAX_WATTS, NvmlSource, SimulatedSource
from spawner.broker.requests import BadRequest, parse_samples
from spawner.cli.sampler import make_report

NOT_SUPPORTED = 3  # pynvml.NVML_ERROR_NOT_SUPPORTED


class FakeNvml:
    """pynvml as NvmlSource uses it: counters per call, power in milliwatts, energy in mJ.
    ``fail`` maps a call's name to the NVML error code it raises."""

    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = 13

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

    def __init__(self, milliwatts=(250_500,), energy_mj=(1_000_000,), fail=None):
        self.milliwatts, self.energy = list(milliwatts), list(energy_mj)
        self.fail = fail or {}
        self.calls: dict[str, int] = {}

    def _call(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1
        if name in self.fail:
            raise self.NVMLError(self.fail[name])

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("handle", i)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=40, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h):
        self._call("power")
        return self.milliwatts[min(self.calls["power"], len(self.milliwatts)) - 1]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self._call("energy")
        return self.energy[min(self.calls["energy"], len(self.energy)) - 1]


def test_nvml_reads_power_in_watts_and_the_energy_counter_in_millijoules():
    nvml = FakeNvml(milliwatts=[250_500, 301_000], energy_mj=[1_000_000, 1_030_100])
    src = NvmlSource(nvml, by_minor=False)
    (s,) = src.sample("n", [1])
    assert (s.utilization, s.memory_used_mib, s.memory_total_mib) == (40.0, 3072, 81920)
    assert s.power_watts == 250.5 and isinstance(s.power_watts, float)
    assert s.energy_mj == 1_000_000 and isinstance(s.energy_mj, int)
    (s,) = src.sample("n", [1])
    assert (s.power_watts, s.energy_mj) == (301.0, 1_030_100)  # read afresh each sample
    assert s.to_json()["power_watts"] == 301.0 and s.to_json()["energy_mj"] == 1_030_100


def test_an_energy_counter_nvml_does_not_support_is_none_and_not_asked_again():
    nvml = FakeNvml(fail={"energy": NOT_SUPPORTED})
    src = NvmlSource(nvml, by_minor=False)
    first = src.sample("n", [0])[0]
    assert first.energy_mj is None and first.power_watts == 250.5  # power still read
    assert "energy_mj" not in first.to_json()  # left out, not sent as null
    for _ in range(4):
        s = src.sample("n", [0])[0]
        assert s.energy_mj is None and s.power_watts == 250.5
    assert nvml.calls == {"energy": 1, "power": 5}  # asked once, power every time
    src.sample("n", [1])  # another GPU is asked for itself
    assert nvml.calls["energy"] == 2


def test_unsupported_power_is_remembered_as_well():
    nvml = FakeNvml(fail={"power": NOT_SUPPORTED})
    src = NvmlSource(nvml, by_minor=False)
    for _ in range(3):
        s = src.sample("n", [0])[0]
        assert (s.power_watts, s.energy_mj) == (None, 1_000_000)
    assert nvml.calls == {"power": 1, "energy": 3}


def test_another_nvml_error_gives_none_this_time_and_is_asked_again():
    gpu_is_lost = 15
    nvml = FakeNvml(fail={"power": gpu_is_lost})
    src = NvmlSource(nvml, by_minor=False)
    assert src.sample("n", [0])[0].power_watts is None
    del nvml.fail["power"]
    assert src.sample("n", [0])[0].power_watts == 250.5  # it came back
    assert nvml.calls["power"] == 2


def test_an_nvml_without_the_calls_samples_as_before():
    nvml = FakeNvml()
    nvml.nvmlDeviceGetPowerUsage = None  # an nvidia-ml-py without them
    nvml.nvmlDeviceGetTotalEnergyConsumption = None
    src = NvmlSource(nvml, by_minor=False)
    s = src.sample("n", [0])[0]
    assert (s.utilization, s.power_watts, s.energy_mj) == (40.0, None, None)
    assert src.unsupported == {0: {"nvmlDeviceGetPowerUsage", "nvmlDeviceGetTotalEnergyConsumption"}}
    assert set(s.to_json()) == {"node", "index", "utilization", "memory_used_mib", "memory_total_mib"}


def test_the_simulated_power_model():
    assert (SIM_IDLE_WATTS, SIM_MAX_WATTS) == (60.0, 300.0)


@pytest.mark.parametrize("utilization, watts", [(0, 60.0), (50, 180.0), (100, 300.0), (130, 300.0)])
def test_a_simulated_gpu_draws_by_its_utilization(tmp_path, utilization, watts):
    f = tmp_path / "stats.json"
    f.write_text(json.dumps({"n:0": {"utilization": utilization}}))
    (s,) = SimulatedSource(f).sample("n", [0])
    assert s.power_watts == pytest.approx(watts)
    assert s.energy_mj is None  # no counter unless the file keeps one: the broker integrates power


def test_a_simulated_gpu_not_in_the_file_draws_idle_power(tmp_path):
    (s,) = SimulatedSource(tmp_path / "absent.json").sample("n", [3])
    assert (s.utilization, s.power_watts, s.energy_mj) == (0.0, 60.0, None)


def test_the_file_may_give_power_and_an_energy_counter(tmp_path):
    f = tmp_path / "stats.json"
    src = SimulatedSource(f)
    f.write_text(json.dumps({"n:0": {"utilization": 10, "power_watts": 412.5, "energy_mj": 5_000_000}}))
    (s,) = src.sample("n", [0])
    assert (s.power_watts, s.energy_mj) == (412.5, 5_000_000)
    f.write_text(json.dumps({"n:0": {"utilization": 10, "power_watts": 90, "energy_mj": 1_000}}))
    (s,) = src.sample("n", [0])  # a counter that went back (a driver reload) travels as it is
    assert (s.power_watts, s.energy_mj) == (90.0, 1_000) and isinstance(s.power_watts, float)
    f.write_text(json.dumps({"n:0": {"utilization": 10, "power_watts": 5000}}))
    assert src.sample("n", [0])[0].power_watts == 5000.0  # not clamped: the broker refuses it


@pytest.mark.parametrize("power", ["lots", None, True, [1]])
def test_a_power_that_is_not_a_number_is_the_models(tmp_path, power):
    f = tmp_path / "stats.json"
    f.write_text(json.dumps({"n:0": {"utilization": 50, "power_watts": power}}))
    assert SimulatedSource(f).sample("n", [0])[0].power_watts == pytest.approx(180.0)


def test_the_node_sampler_posts_power_and_energy_where_read():
    read = SimpleNamespace(
        node="g1",
        index=0,
        utilization=5.0,
        memory_used_mib=1,
        memory_total_mib=80,
        power_watts=71.5,
        energy_mj=9,
    )
    unread = SimpleNamespace(
        node="g1",
        index=1,
        utilization=5.0,
        memory_used_mib=1,
        memory_total_mib=None,
        power_watts=None,
        energy_mj=None,
    )
    body = make_report([read, unread])
    assert body["gpus"][0] == {
        "node": "g1",
        "index": 0,
        "utilization": 5.0,
        "memory_used_mib": 1,
        "memory_total_mib": 80,
        "power_watts": 71.5,
        "energy_mj": 9,
    }
    assert body["gpus"][1] == {"node": "g1", "index": 1, "utilization": 5.0, "memory_used_mib": 1}
    r = parse_samples(body)  # and the broker takes it as sent
    assert [(s.power_watts, s.energy_mj) for s in r.samples] == [(71.5, 9), (None, None)]


def test_what_the_sources_read_reaches_the_broker(tmp_path):
    f = tmp_path / "stats.json"
    f.write_text(json.dumps({"n:0": {"utilization": 25, "energy_mj": 42}}))
    samples = SimulatedSource(f).sample("n", [0, 1]) + NvmlSource(FakeNvml(), by_minor=False).sample("n", [1])
    from_reporter = parse_samples({"gpus": [s.to_json() for s in samples], "source": "simulated"})
    from_sampler = parse_samples(make_report(samples))
    for r in (from_reporter, from_sampler):
        assert [(s.power_watts, s.energy_mj) for s in r.samples] == [
            (120.0, 42),
            (60.0, None),
            (250.5, 1_000_000),
        ]


def test_null_power_and_energy_are_accepted_as_not_read():
    r = parse_samples(
        {"gpus": [{"node": "n", "index": 0, "utilization": 1, "power_watts": None, "energy_mj": None}]}
    )
    assert (r.samples[0].power_watts, r.samples[0].energy_mj) == (None, None)


@pytest.mark.parametrize(
    "field, value",
    [("power_watts", -1), ("power_watts", 5000), ("power_watts", 1e308), ("energy_mj", -1)],
)
def test_an_impossible_reading_is_left_out_and_counted_the_rest_of_the_sample_stands(field, value):
    gpu = {"node": "n", "index": 0, "utilization": 10, "power_watts": 100.0, "energy_mj": 5, field: value}
    r = parse_samples({"gpus": [gpu]})
    assert r.refused == (("n:0", field, value),)
    assert getattr(r.samples[0], field) is None
    assert r.samples[0].utilization == 10
    other = "energy_mj" if field == "power_watts" else "power_watts"
    assert getattr(r.samples[0], other) == gpu[other]


@pytest.mark.parametrize(
    "field, value",
    [("power_watts", "200"), ("power_watts", True), ("energy_mj", 1.5), ("energy_mj", "7")],
)
def test_a_reading_that_is_not_a_number_refuses_the_report_naming_the_field(field, value):
    gpu = {"node": "n", "index": 0, "utilization": 10, field: value}
    with pytest.raises(BadRequest) as e:
        parse_samples({"gpus": [gpu]})
    message = str(e.value)
    assert f"'{field}'" in message
    assert ("a number from 0 to 2000" if field == "power_watts" else "a whole number from 0") in message
