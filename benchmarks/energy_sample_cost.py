"""What reading power and energy adds to a GPU sample (issue 33), in gpuhub's own Python.

    .venv/bin/python benchmarks/energy_sample_cost.py [gpus] [calls] [rounds]

1. ``SimulatedSource.sample`` over ``gpus`` GPUs of one node from a stats file, each row without
   a power of its own (every GPU goes through the power model), against the same rows each
   giving ``power_watts`` (the model not called): the model's share of a sample. And one
   sample's cost as a share of the sampling interval, ``c.GpuHub.report_seconds``.
2. ``NvmlSource.sample`` with a fake NVML (in-process counters, no driver): with power and the
   energy counter read, against the sample as it was before (utilization and memory only) and
   against a GPU whose NVML supports neither (the NOT_SUPPORTED remembered, not asked again).
   This is gpuhub's share only; the real driver's calls cost what they cost on the GPU
   (``benchmarks/gpu_check.py`` row 2c prints one real sample's time).

Each round times ``calls`` calls of every way, taking turns; prints the medians of the rounds'
per-call means and the ratios against the alternative measured in the same run.
"""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_magics.report.gpustats import GpuSample, NvmlSource, SimulatedSource
from spawner.settings import GpuHub


class FakeNvml:
    """pynvml's calls NvmlSource makes, answered from counters in this process."""

    NVML_ERROR_NOT_SUPPORTED = 3

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(value)
            self.value = value

    def __init__(self, power: bool):
        self.power, self.energy = power, 0
        self.util = SimpleNamespace(gpu=42, memory=10)
        self.mem = SimpleNamespace(used=3 * 2**30, total=80 * 2**30)

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetUtilizationRates(self, h):
        return self.util

    def nvmlDeviceGetMemoryInfo(self, h):
        return self.mem

    def nvmlDeviceGetPowerUsage(self, h):
        if not self.power:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return 250_000

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if not self.power:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        self.energy += 25_000
        return self.energy


def before(src: NvmlSource, node: str, indices) -> list[GpuSample]:
    """NvmlSource.sample as it was before issue 33: utilization and memory only."""
    out = []
    for i in indices:
        h = src.handle(i)
        util = src.nvml.nvmlDeviceGetUtilizationRates(h)
        mem = src.nvml.nvmlDeviceGetMemoryInfo(h)
        out.append(GpuSample(node, i, float(util.gpu), mem.used // 2**20, mem.total // 2**20))
    return out


def per_call(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def measure(ways: dict, calls: int, rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for r in range(rounds):  # taking turns, each first in some round, so all see the same load
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(per_call(ways[name], calls))
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    gpus = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    interval = GpuHub.class_traits()["report_seconds"].default_value
    idx = list(range(gpus))
    with tempfile.TemporaryDirectory() as d:
        modelled, given = Path(d, "model.json"), Path(d, "given.json")
        modelled.write_text(
            json.dumps({f"n:{i}": {"utilization": 10 * i % 100, "memory_used_mib": 9} for i in idx})
        )
        given.write_text(
            json.dumps(
                {
                    f"n:{i}": {"utilization": 10 * i % 100, "memory_used_mib": 9, "power_watts": 99.0}
                    for i in idx
                }
            )
        )
        sm, sg = SimulatedSource(modelled), SimulatedSource(given)
        assert sm.sample("n", [1])[0].power_watts == 84.0 and sg.sample("n", [1])[0].power_watts == 99.0
        sim = measure(
            {"model": lambda: sm.sample("n", idx), "given": lambda: sg.sample("n", idx)}, calls, rounds
        )

    with_power = NvmlSource(FakeNvml(power=True), by_minor=False)
    unsupported = NvmlSource(FakeNvml(power=False), by_minor=False)
    plain = NvmlSource(FakeNvml(power=True), by_minor=False)
    s = with_power.sample("n", [0])[0]
    assert s.power_watts == 250.0 and s.energy_mj is not None
    assert unsupported.sample("n", [0])[0].power_watts is None and unsupported.unsupported[0]
    assert before(plain, "n", [0])[0].power_watts is None
    nv = measure(
        {
            "before": lambda: before(plain, "n", idx),
            "power": lambda: with_power.sample("n", idx),
            "unsupported": lambda: unsupported.sample("n", idx),
        },
        calls,
        rounds,
    )

    print(f"one sample of {gpus} GPUs, median of {rounds} rounds of {calls} calls:")
    print(f"  {'':54} {'us/sample':>10} {'ratio':>7}")
    rows = [
        ("SimulatedSource, every GPU through the power model", sim["model"], sim["model"] / sim["given"]),
        ("SimulatedSource, every row giving its power", sim["given"], 1.0),
        ("NvmlSource (fake NVML), before: utilization, memory", nv["before"], 1.0),
        ("NvmlSource (fake NVML), + power and energy counter", nv["power"], nv["power"] / nv["before"]),
        (
            "NvmlSource (fake NVML), both NOT_SUPPORTED, remembered",
            nv["unsupported"],
            nv["unsupported"] / nv["before"],
        ),
    ]
    for name, t, ratio in rows:
        print(f"  {name:54} {t * 1e6:10.1f} {ratio:6.2f}x")
    print(
        f"  a simulated sample (power model) is {sim['model'] / interval:.1e} of the default "
        f"c.GpuHub.report_seconds = {interval:g} s; with the fake NVML, power and energy add "
        f"{(nv['power'] - nv['before']) * 1e6:.1f} us per sample of {gpus} GPUs"
    )


if __name__ == "__main__":
    main()
