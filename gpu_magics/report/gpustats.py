"""GPU utilization, memory and power, sampled where the GPU is.

The processes gpuhub already runs next to each GPU (the single-user server, the
``%%distributed`` engines, a node's ``gpuhub sampler``) sample their own GPUs with one of two
sources:

- :class:`NvmlSource`: NVML through ``nvidia-ml-py`` (``pynvml``). A GPU is found by its
  index on its machine: NVML's PCI bus order (the order the spawner gives CUDA), or on Slurm
  its minor number (``NvmlSource.handle``).
- :class:`SimulatedSource`: for machines without GPUs (the demo, the tests). It reads a JSON
  file that whoever drives it writes, ``{"node:index": {"utilization": 80,
  "memory_used_mib": 1024}}``; a GPU not in the file is idle. The samples then travel
  exactly the way NVML's do.

What a :class:`GpuSample` holds besides utilization and memory:

- ``power_watts``: the board's draw at the time of the sample, in watts. From NVML's
  ``nvmlDeviceGetPowerUsage`` (milliwatts); None where NVML cannot read it (some older GPUs
  and vGPUs). A simulated GPU draws 60 W idle and up to 300 W at 100 % utilization:
  ``SIM_IDLE_WATTS + utilization / 100 * (SIM_MAX_WATTS - SIM_IDLE_WATTS)``, unless its row of
  the file says ``"power_watts"`` itself (a row whose power is not a number gets the model's).
- ``energy_mj``: NVML's total-energy counter (``nvmlDeviceGetTotalEnergyConsumption``), the
  millijoules the GPU used since the driver loaded; Volta and later, None elsewhere. A
  simulated GPU has one only where its row says ``"energy_mj"`` (a whole number, so a test
  can drive the counter, resets included). Where there is no counter, the broker integrates
  the power readings over time instead.

NVML calls a GPU cannot answer (``NVML_ERROR_NOT_SUPPORTED``) are remembered per GPU and not
made again, so a sample costs the same on a GPU without power readings.

``make_source`` picks one from the variables the spawner sets: ``GPUHUB_GPU_SOURCE``
(``nvml`` or ``simulated``), ``GPUHUB_SIMULATED_GPU_STATS`` (the file) and
``GPUHUB_SIMULATED_GPU_LOAD`` (``processes``: a GPU the file does not name reads the use of
the processes bound to it, :mod:`gpu_magics.report.simload`).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_magics.common.session import backend
from gpu_magics.common.words import count
from gpu_magics.report import simload

# the simulated power model: a simulated GPU draws 60 W idle and up to 300 W at 100 % utilization
SIM_IDLE_WATTS = 60.0
SIM_MAX_WATTS = 300.0

# the readings a sample may lack: left out of its JSON when None (what an older broker accepts)
POWER_FIELDS = ("power_watts", "energy_mj")


@dataclass(frozen=True)
class GpuSample:
    node: str
    index: int
    utilization: float  # percent of the last sample period a kernel ran, 0-100
    memory_used_mib: int
    memory_total_mib: int | None
    power_watts: float | None = None  # the board's draw now (None: not read)
    energy_mj: int | None = None  # NVML's total-energy counter, millijoules since the driver loaded

    @property
    def label(self) -> str:
        return f"{self.node}:{self.index}"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for key in POWER_FIELDS:
            if out[key] is None:
                del out[key]
        return out


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here; the message says why."""


def parse_label(label: str) -> tuple[str, int]:
    """``"gpu1:3"`` to ``("gpu1", 3)``; a node name may itself hold colons."""
    node, sep, index = label.rpartition(":")
    if not sep or not node or not index.isdigit():
        raise ValueError(f"a GPU is named node:index, e.g. gpu1:0; got {label!r}")
    return node, int(index)


def cpus_from_mask(words: Sequence[int], word_bits: int = 64) -> list[int]:
    """NVML's CPU affinity bitmask (least significant word first) to CPU numbers."""
    return [w * word_bits + b for w, word in enumerate(words) for b in range(word_bits) if word >> b & 1]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def simulated_power(utilization: float) -> float:
    """A simulated GPU's draw in watts at ``utilization`` percent (0-100): linear from
    ``SIM_IDLE_WATTS`` idle to ``SIM_MAX_WATTS`` at 100 %."""
    return SIM_IDLE_WATTS + utilization / 100 * (SIM_MAX_WATTS - SIM_IDLE_WATTS)


def _finite(value: Any) -> bool:
    """A JSON number that is one (not a bool, NaN or infinity)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Any) -> bool:
    return _finite(value) and value == int(value)


class NvmlSource:
    """Samples this machine's GPUs through NVML. Raises :class:`NvmlUnavailable` when it
    cannot start (no driver, no library)."""

    name = "nvml"

    def __init__(self, nvml: Any = None, by_minor: bool | None = None):
        # Slurm numbers GPUs as gres.conf lists /dev/nvidiaN (minor numbers), and NVML may
        # number only the job's GPUs; elsewhere gpuhub uses NVML's own (PCI bus) index
        self.by_minor = backend() == "slurm" if by_minor is None else by_minor
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError as e:
                raise NvmlUnavailable("nvidia-ml-py is not installed: pip install nvidia-ml-py") from e
        self.nvml = nvml
        # per GPU index, the optional calls its NVML cannot answer (NOT_SUPPORTED): not made again
        self.unsupported: dict[int, set[str]] = {}
        self._never = (
            getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3),
            getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13),  # a driver without the call
        )
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(
                f"NVML could not start ({_text(e) or type(e).__name__}): no NVIDIA driver or GPU here"
            ) from e

    def handle(self, index: int):
        """The device gpuhub calls ``index`` on this machine. On Slurm, the one whose minor
        number (``/dev/nvidiaN``, what gres.conf lists) is ``index``: inside a job NVML may
        number only the job's GPUs from 0. Elsewhere, and when no minor number matches,
        NVML's own index (PCI bus order, as the local inventory and CUDA use)."""
        nvml = self.nvml
        for i in range(nvml.nvmlDeviceGetCount() if self.by_minor else 0):
            try:
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                if nvml.nvmlDeviceGetMinorNumber(h) == index:
                    return h
            except nvml.NVMLError:
                continue  # a device this process may not open
        try:
            return nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as e:
            raise NvmlUnavailable(
                f"GPU {index} is not visible to NVML here ({_text(e)}); NVML sees "
                f"{count(nvml.nvmlDeviceGetCount(), 'GPU')}"
            ) from e

    def sample(self, node: str, indices: Iterable[int]) -> list[GpuSample]:
        out = []
        for i in indices:
            h = self.handle(i)
            util = self.nvml.nvmlDeviceGetUtilizationRates(h)
            mem = self.nvml.nvmlDeviceGetMemoryInfo(h)
            milliwatts = self._optional(i, h, "nvmlDeviceGetPowerUsage")
            energy = self._optional(i, h, "nvmlDeviceGetTotalEnergyConsumption")
            out.append(
                GpuSample(
                    node,
                    i,
                    float(util.gpu),
                    mem.used // 2**20,
                    mem.total // 2**20,
                    None if milliwatts is None else milliwatts / 1000.0,
                    None if energy is None else int(energy),
                )
            )
        return out

    def _optional(self, index: int, h: Any, call: str) -> Any:
        """``nvml.<call>(h)``, or None where this GPU cannot answer it. A call NVML does not
        support on this GPU (or does not have at all) is remembered and not made again; any
        other error (a GPU busy resetting, say) gives None this time only."""
        skip = self.unsupported.get(index)
        if skip is not None and call in skip:
            return None
        nvml = self.nvml
        fn = getattr(nvml, call, None)
        if fn is None:  # an nvidia-ml-py without it
            self.unsupported.setdefault(index, set()).add(call)
            return None
        try:
            return fn(h)
        except nvml.NVMLError as e:
            if getattr(e, "value", None) in self._never:
                self.unsupported.setdefault(index, set()).add(call)
            return None

    def cpu_affinity(self, index: int) -> list[int]:
        """The CPUs nearest GPU ``index`` (NVML's ideal affinity, as dask-cuda uses)."""
        words = ((os.cpu_count() or 64) + 63) // 64
        h = self.handle(index)
        return cpus_from_mask(self.nvml.nvmlDeviceGetCpuAffinity(h, words))

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


class SimulatedSource:
    """Samples from a JSON file the tests (or a demo) write; a GPU not in the file is idle,
    or with ``processes`` reads the use of the processes bound to it (:mod:`.simload`)."""

    name = "simulated"

    def __init__(self, path: str | os.PathLike | None, processes: bool = False, clock=time.monotonic):
        self.path = Path(path) if path else None
        self.processes, self.clock = processes, clock
        self._before: tuple[float, dict] | None = None  # the last reading of the processes
        self._load: tuple[float, dict] | None = None  # and the load it gave

    def _table(self) -> Mapping[str, Any]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # being rewritten, or not written yet: idle
        return data if isinstance(data, dict) else {}

    def _process_load(self) -> dict[str, tuple[float, float]]:
        if not self.processes:
            return {}
        now = self.clock()
        if self._load is not None and now - self._load[0] < 0.5:  # one sweep asks once per node
            return self._load[1]
        after = simload.read_processes(hub=None if self.path is None else str(self.path))
        then, before = self._before or (now, {})
        self._before = (now, after)
        self._load = (now, simload.gpu_load(before, after, now - then))
        return self._load[1]

    def sample(self, node: str, indices: Iterable[int]) -> list[GpuSample]:
        table = self._table()
        load = self._process_load()
        out = []
        for i in indices:
            row = table.get(f"{node}:{i}")
            if row is None and f"{node}:{i}" in load:
                util, mem = load[f"{node}:{i}"]
                row = {"utilization": round(util, 1), "memory_used_mib": round(mem)}
            row = row or {}
            util = min(max(float(row.get("utilization", 0)), 0.0), 100.0)
            power = row.get("power_watts")  # the file's own, as given (the broker judges it)
            energy = row.get("energy_mj")  # a simulated counter: only where the file keeps one
            out.append(
                GpuSample(
                    node,
                    i,
                    util,
                    int(row.get("memory_used_mib", 0)),
                    row.get("memory_total_mib"),
                    float(power) if _finite(power) else simulated_power(util),
                    int(energy) if _whole(energy) else None,
                )
            )
        return out

    def cpu_affinity(self, index: int) -> list[int]:
        return []  # no topology to follow

    def close(self) -> None:
        pass


def make_source(environ: Mapping[str, str] | None = None) -> NvmlSource | SimulatedSource:
    """The source the spawner chose for this server (NVML unless told otherwise)."""
    env = os.environ if environ is None else environ
    kind = env.get("GPUHUB_GPU_SOURCE", "nvml")
    if kind == "simulated":
        processes = env.get("GPUHUB_SIMULATED_GPU_LOAD") == "processes"
        return SimulatedSource(env.get("GPUHUB_SIMULATED_GPU_STATS"), processes=processes)
    if kind != "nvml":
        raise ValueError(f"GPUHUB_GPU_SOURCE is nvml or simulated; got {kind!r}")
    return NvmlSource()


def nvml_problem() -> str | None:
    """None when NVML works here; otherwise why it does not."""
    try:
        NvmlSource().close()
    except NvmlUnavailable as e:
        return str(e)
    return None
