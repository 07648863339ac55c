"""gpuhub's GPU paths on a machine with a real NVIDIA GPU, as one table.

    bash benchmarks/gpu_check.sh                  # on the GPU machine (installs carried wheels)
    python benchmarks/gpu_check.py                # anywhere: without NVML every check is skipped
    python benchmarks/gpu_check.py --cpu-dry-run  # no GPU: check 3 (and 4b) on CPU with gloo

Runs from the checkout (no install of gpuhub needed: the repository is put first on the path).

0. Environment: versions, and whether every carried wheel's requirements are met.
1. NVML inventory: ``spawner.spawners.inventory.nvml_gpus()`` against ``nvidia-smi`` and torch.
2. NVML sampling through ``gpu_magics.report.gpustats.NvmlSource``: idle, then while a bf16 matmul
   loop runs in another process (utilization and memory must rise); 2b: NVML's CPU affinity
   for GPU 0 against this process's and dask-cuda's; 2c: power and the energy counter
   (``NvmlSource.sample``'s ``power_watts`` and ``energy_mj``, issue 33) every 0.1 s for 5 s
   under the same load: the counter's rise against the trapezoid integral of the power.
3. ``%%distributed --gpus 1 --backend nccl`` in a real ipykernel (jupyter_client) with the
   environment of a gpuhub server holding GPU 0, against the same DDP script under torchrun:
   same parameters (bitwise), step times, a second cell on the warm engine (same pid), the
   engine's CPUs, and ``%distributed shutdown`` ending the engine.
4. ``%dask_cuda --gpus 1`` in the same kernel (4a) and ``dask_cuda.LocalCUDACluster`` in a
   subprocess (4b): a task reports the worker's GPU, CUDA_VISIBLE_DEVICES and CPU affinity.
5. Slices through CUDA MPS (``spawner.policy.mps``, issue 34): two control daemons on GPU 0,
   each with a 1/4-GPU client: memory refused past the slice, both running at once.

Each check has its own time limit and failure handling, so one failure hides no other. The
table goes to stdout and, when ``$OUT`` is set, to ``$OUT/gpu_check.txt`` (and everything
measured to ``$OUT/gpu_check.json``), rewritten after each check. Exit status 1 when a check
failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MARK = re.compile(r"GPUCHECK (\{.*\})\s*$", re.M)
START = time.monotonic()
STATE: dict = {}  # shared between checks: the kernel, NVML's affinity, the GPU's model
ROWS: list[dict] = []
ENV: dict = {}
KNOWN_UNNEEDED = {"bokeh"}  # rapids-dask-dependency names it; only the dashboard would use it


class CheckTimeout(BaseException):
    """Raised in the main thread by SIGALRM when a check runs past its limit."""


class Skip(Exception):
    """The check cannot run here; the message says why."""


def log(msg: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------
# helpers run in subprocesses (the checker itself never initialises CUDA)


def helper_main(argv: list[str]) -> None:
    import torch

    if argv[0] == "facts":
        p = torch.cuda.get_device_properties(0)
        print(
            json.dumps(
                {
                    "count": torch.cuda.device_count(),
                    "name": torch.cuda.get_device_name(0),
                    "total_mib": p.total_memory // 2**20,
                    "uuid": str(getattr(p, "uuid", "")),
                    "pci_bus_id": getattr(p, "pci_bus_id", None),
                    "capability": list(torch.cuda.get_device_capability(0)),
                    "sms": p.multi_processor_count,
                    "torch": torch.__version__,
                    "cuda": torch.version.cuda,
                    "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                }
            ),
            flush=True,
        )
    elif argv[0] == "mps_client":
        mps_client(int(argv[1]), float(argv[2]))
    elif argv[0] == "load":
        seconds, ballast_gib = float(argv[1]), int(argv[2])
        dev = torch.device("cuda", 0)
        ballast = torch.ones(ballast_gib * 2**30, dtype=torch.uint8, device=dev)
        n = 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        c = a @ b
        torch.cuda.synchronize()
        print("LOADING", flush=True)
        t0 = time.perf_counter()
        count = 0
        while time.perf_counter() - t0 < seconds:
            for _ in range(20):
                c = a @ b
            torch.cuda.synchronize()
            count += 20
        dt = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "matmuls": count,
                    "seconds": round(dt, 3),
                    "tflops": round(count * 2 * n**3 / dt / 1e12, 1),
                    "allocated_mib": torch.cuda.memory_allocated() // 2**20,
                    "checksum": float(c[0, 0]) + float(ballast[0]),
                }
            ),
            flush=True,
        )


def mps_client(limit_mib: int, seconds: float) -> None:
    """A slice's client under MPS (``--helper mps_client LIMIT SECONDS``): how much it could
    allocate, in 256 MiB steps up to twice its limit, then matmuls for ``seconds``, with the
    wall-clock span it ran them in (so two clients' spans show whether they ran at once)."""
    import torch

    dev = torch.device("cuda", 0)
    held, got, refused = [], 0, None
    while got < 2 * limit_mib:
        try:
            held.append(torch.empty(256 * 2**20, dtype=torch.uint8, device=dev))
            got += 256
        except torch.OutOfMemoryError as e:
            refused = str(e).splitlines()[0][:200]
            break
    held.clear()
    torch.cuda.empty_cache()
    n = 4096
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    t0, count = time.time(), 0
    while time.time() - t0 < seconds:
        a @ a
        count += 1
        if count % 20 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    print(json.dumps({"allocated_mib": got, "refused": refused, "matmuls": count, "span": [t0, time.time()]}))


def run_helper(args: list[str], timeout: float, env: dict | None = None) -> dict:
    e = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID", **(env or {}))
    p = subprocess.run(
        [sys.executable, __file__, "--helper", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )
    if p.returncode:
        raise RuntimeError(f"helper {args[0]} exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# imports of gpuhub's own code


def gpustats():
    """gpu_magics.report.gpustats; loaded from its file when the package cannot be imported
    (gpu_magics/__init__ needs IPython, which only the carried wheels bring)."""
    try:
        from gpu_magics.report import gpustats as mod

        return mod
    except ImportError as e:
        spec = importlib.util.spec_from_file_location(
            "gpuhub_gpustats", REPO / "gpu_magics" / "report" / "gpustats.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        STATE.setdefault("notes", []).append(f"gpu_magics not importable ({e}); gpustats.py loaded directly")
        return mod


def nvml_problem() -> str | None:
    try:
        return gpustats().nvml_problem()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def require_nvml() -> None:
    if STATE["nvml_problem"]:
        raise Skip(f"no NVML: {STATE['nvml_problem']}")


def nvidia_smi(query: str) -> list[list[str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        raise FileNotFoundError("nvidia-smi not on PATH")
    out = subprocess.run(
        [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines()]


def hexid(uuid: str) -> str:
    """'GPU-5b0f7a2a-...' (NVML) and '5b0f7a2a-...' (torch) to the same 32 hex digits."""
    return re.sub("[^0-9a-f]", "", uuid.lower().removeprefix("gpu-"))[-32:]


def cpulist(cpus) -> str:
    """[0,1,2,3,8] -> '0-3,8'"""
    cpus = sorted(set(cpus or []))
    if not cpus:
        return "none"
    parts, lo = [], cpus[0]
    for a, b in zip(cpus, [*cpus[1:], None], strict=True):
        if b != a + 1:
            parts.append(f"{lo}-{a}" if a != lo else str(a))
            lo = b
    return ",".join(parts)


# ---------------------------------------------------------------------------------------
# 0. environment

DISTS = [
    "torch", "numpy", "nvidia-ml-py", "cuda-core", "cuda-bindings", "psutil", "pandas", "click",
    "cloudpickle", "msgpack", "toolz", "packaging", "pygments", "python-dateutil", "tqdm",
    "ipython", "ipykernel", "jupyter_client", "ipyparallel", "pyzmq", "tornado", "traitlets",
    "dask", "distributed", "dask-cuda", "rapids-dask-dependency",
]  # fmt: skip


def check_env(site: Path) -> tuple[str, str, dict]:
    from importlib import metadata

    versions = {}
    for d in DISTS:
        try:
            versions[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            versions[d] = None
    details = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "sched_affinity": cpulist(os.sched_getaffinity(0)),
        "versions": versions,
        "site": str(site),
    }
    missing = [
        d for d in ("ipykernel", "jupyter_client", "ipyparallel", "dask", "distributed") if not versions[d]
    ]
    if not site.is_dir():
        note = f"no carried wheels here ({site} absent)"
        result = "ok"
        unmet, shadowed = [], []
    else:
        unmet, shadowed, carried = carried_requirements(site)
        details.update(carried=carried, unmet=unmet, shadowed=shadowed)
        note = f"{len(carried)} carried dists in {site}"
        result = "FAIL" if unmet or shadowed else "ok"
        if unmet:
            note += "; UNMET: " + "; ".join(unmet)
        if shadowed:
            note += "; SHADOWING the machine's: " + ", ".join(shadowed)
    key = [
        "torch",
        "nvidia-ml-py",
        "cuda-core",
        "ipyparallel",
        "ipykernel",
        "dask",
        "distributed",
        "dask-cuda",
    ]
    measured = (
        f"python {details['python']}, "
        + ", ".join(f"{k} {versions[k] or '-'}" for k in key)
        + f"; {note}"
        + (f"; missing here: {', '.join(missing)}" if missing else "")
    )
    return result, measured, details


def carried_requirements(site: Path) -> tuple[list[str], list[str], dict]:
    """Every requirement (no extras) of each distribution in ``site``, checked against what
    this interpreter would import; and carried names that also exist outside ``site``."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    carried = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}
    unmet = []
    for name, dist in sorted(carried.items()):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            rn = canonicalize_name(req.name)
            if rn in KNOWN_UNNEEDED:
                continue
            try:
                have = carried[rn].version if rn in carried else metadata.version(req.name)
            except metadata.PackageNotFoundError:
                unmet.append(f"{name} needs {req} (absent)")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{name} needs {req} (have {have})")
    others = [p for p in sys.path if p and Path(p).resolve() != site.resolve()]
    shadowed = sorted(
        canonicalize_name(d.metadata["Name"]) for d in metadata.distributions(path=others)
        if canonicalize_name(d.metadata["Name"]) in carried
    )  # fmt: skip
    return unmet, sorted(set(shadowed)), {n: d.version for n, d in sorted(carried.items())}


# ---------------------------------------------------------------------------------------
# 1. NVML inventory


def check_inventory() -> tuple[str, str, dict]:
    require_nvml()
    from spawner.spawners.inventory import nvml_gpus

    gpus = nvml_gpus()
    inv = [
        {"node": g.node, "index": g.index, "model": g.model, "memory_mib": g.memory_mib, "uuid": g.uuid}
        for g in gpus
    ]
    details: dict = {"nvml_gpus": inv}
    problems = []
    if not gpus:
        problems.append("nvml_gpus() listed no GPU")
    else:
        STATE["model"] = gpus[0].model
    try:
        smi = nvidia_smi("index,name,memory.total,uuid,pci.bus_id,driver_version")
        details["nvidia_smi"] = smi
        if len(smi) != len(gpus):
            problems.append(f"nvidia-smi lists {len(smi)} GPUs, NVML {len(gpus)}")
        for g, row in zip(gpus, smi, strict=False):
            same_mem = row[2].isdigit() and abs(int(row[2]) - (g.memory_mib or 0)) <= 1
            if (str(g.index), g.model, g.uuid) != (row[0], row[1], row[3]) or not same_mem:
                problems.append(
                    f"GPU {g.index}: NVML {g.model}/{g.memory_mib}/{g.uuid} vs nvidia-smi {row[:4]}"
                )
    except Exception as e:
        problems.append(f"nvidia-smi: {e}")
    try:
        facts = run_helper(["facts"], timeout=90)
        details["torch"] = facts
        STATE["torch_facts"] = facts
        if facts["count"] != len(gpus):
            problems.append(f"torch sees {facts['count']} GPUs, NVML {len(gpus)}")
        if gpus:
            g = gpus[0]
            if facts["name"] != g.model:
                problems.append(f"torch name {facts['name']!r} != NVML {g.model!r}")
            if facts["uuid"] and g.uuid and hexid(facts["uuid"]) != hexid(g.uuid):
                problems.append(f"torch uuid {facts['uuid']} != NVML {g.uuid}")
            if abs(facts["total_mib"] - (g.memory_mib or 0)) > 0.03 * (g.memory_mib or 1):
                problems.append(f"torch memory {facts['total_mib']} MiB vs NVML {g.memory_mib} MiB")
    except Exception as e:
        problems.append(f"torch facts: {e}")
    gl = "; ".join(f"{g.label} {g.model}, {g.memory_mib} MiB, {g.uuid}" for g in gpus)
    t = details.get("torch", {})
    measured = (
        f"{len(gpus)} GPU(s): {gl}"
        + (f"; torch {t['torch']} (CUDA {t['cuda']}, NCCL {t['nccl']}): {t['name']}, {t['total_mib']} MiB, "
           f"cc {'.'.join(map(str, t['capability']))}, {t['sms']} SMs" if t else "")
        + (f"; driver {details['nvidia_smi'][0][5]}" if details.get("nvidia_smi") else "")
        + ("; MISMATCH: " + "; ".join(problems) if problems else "; NVML = nvidia-smi = torch")
    )  # fmt: skip
    return ("FAIL" if problems else "ok"), measured, details


# ---------------------------------------------------------------------------------------
# 2. NVML sampling and affinity


def check_sampling(load_s: float = 4.0, ballast_gib: int = 4) -> tuple[str, str, dict]:
    require_nvml()
    gs = gpustats()
    src = gs.NvmlSource()
    node = socket.gethostname()
    try:
        idle = []
        for _ in range(5):
            idle.append(src.sample(node, [0])[0])
            time.sleep(0.2)
        idle_util = max(s.utilization for s in idle)
        idle_mem = max(s.memory_used_mib for s in idle)
        proc = subprocess.Popen(
            [sys.executable, __file__, "--helper", "load", str(load_s), str(ballast_gib)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID"),
        )
        STATE.setdefault("procs", []).append(proc)
        first = proc.stdout.readline()  # blocks until the load starts (or the helper dies)
        if first.strip() != "LOADING":
            proc.wait(30)
            raise RuntimeError(f"load helper did not start: {first!r} {proc.stderr.read()[-2000:]}")
        samples = []
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < load_s + 30:
            s = src.sample(node, [0])[0]
            samples.append((round(time.monotonic() - t0, 2), s.utilization, s.memory_used_mib))
            time.sleep(0.2)
        out, err = proc.communicate(timeout=30)
        if proc.returncode:
            raise RuntimeError(f"load helper exited {proc.returncode}: {err[-2000:]}")
        load = json.loads(out.strip().splitlines()[-1])
        after = src.sample(node, [0])[0]
        busy = [u for _, u, _ in samples]
        peak_util = max(busy) if busy else 0.0
        peak_mem = max(m for _, _, m in samples) if samples else 0
        mean_util = sum(busy) / len(busy) if busy else 0.0
        details = {
            "idle": [s.to_json() for s in idle],
            "load_samples_t_util_mem": samples,
            "after": after.to_json(),
            "load": load,
        }
        ok = (
            peak_util >= 50
            and peak_util > idle_util + 20
            and peak_mem - idle_mem >= ballast_gib * 1024 * 0.75
        )
        measured = (
            f"idle util {idle_util:.0f}%, mem {idle_mem} MiB; under bf16 matmul load "
            f"({load['tflops']} TFLOP/s, {load['seconds']} s, {ballast_gib} GiB ballast): "
            f"peak util {peak_util:.0f}% (mean {mean_util:.0f}% over {len(samples)} samples), "
            f"peak mem {peak_mem} MiB (+{peak_mem - idle_mem}); after: {after.utilization:.0f}%, "
            f"{after.memory_used_mib} MiB; total {idle[0].memory_total_mib} MiB"
        )
        return ("ok" if ok else "FAIL"), measured, details
    finally:
        src.close()


def check_energy(seconds: float = 5.0, interval: float = 0.1) -> tuple[str, str, dict]:
    """GPU 0's power and energy counter through NvmlSource every ``interval`` s for ``seconds``
    while a bf16 matmul loop runs in another process (when torch can start one): the counter's
    rise against the trapezoid integral of the power readings over the same samples."""
    require_nvml()
    gs = gpustats()
    src = gs.NvmlSource()
    node = socket.gethostname()
    proc, load, why = None, None, ""
    try:
        first = src.sample(node, [0])[0]
        if first.power_watts is None and first.energy_mj is None:
            raise Skip("NVML reads neither the power nor the energy counter of GPU 0 here (not supported)")
        if importlib.util.find_spec("torch") is None:
            why = "torch is not installed"
        else:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--helper", "load", str(seconds + 3), "0"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID"),
            )
            STATE.setdefault("procs", []).append(proc)
            if proc.stdout.readline().strip() != "LOADING":
                proc.wait(30)
                last = (proc.stderr.read().strip().splitlines() or ["?"])[-1]
                why = f"the load did not start: {last[:200]}"
                proc = None
            else:
                time.sleep(1.0)  # NVML's power is an average over about the last second
        readings, costs = [], []
        t0 = time.monotonic()
        while True:
            a = time.monotonic()
            s = src.sample(node, [0])[0]
            b = time.monotonic()
            costs.append(b - a)
            readings.append((round((a + b) / 2 - t0, 4), s.power_watts, s.energy_mj))
            if b - t0 >= seconds:
                break
            time.sleep(max(0.0, t0 + len(readings) * interval - time.monotonic()))
        if proc is not None:
            out, err = proc.communicate(timeout=30)
            if proc.returncode:
                raise RuntimeError(f"load helper exited {proc.returncode}: {err[-2000:]}")
            load = json.loads(out.strip().splitlines()[-1])
    finally:
        src.close()
    both = [(t, p, e) for t, p, e in readings if p is not None and e is not None]
    powered = both or [(t, p, e) for t, p, e in readings if p is not None]
    pairs = itertools.pairwise(powered)
    integral_kj = sum((pa + pb) / 2 * (tb - ta) for (ta, pa, _), (tb, pb, _) in pairs) / 1e3
    counted = both or [(t, p, e) for t, p, e in readings if e is not None]
    counter_kj = (counted[-1][2] - counted[0][2]) / 1e6 if len(counted) > 1 else None
    watts = [p for _, p, _ in powered]
    details = {
        "t_power_energy": readings,
        "first": first.to_json(),
        "load": load,
        "sample_ms_median": round(sorted(costs)[len(costs) // 2] * 1e3, 3),
        "unsupported": {k: sorted(v) for k, v in src.unsupported.items()},
    }
    problems = []
    if any(e1 < e0 for (_, _, e0), (_, _, e1) in itertools.pairwise(counted)):
        problems.append("the energy counter went back")
    if watts and not 0 <= min(watts) <= max(watts) <= 2000:
        problems.append(f"power {min(watts):.0f}-{max(watts):.0f} W: outside the broker's 0-2000 W")
    ratio = integral_kj / counter_kj if counter_kj and len(powered) > 1 else None
    if ratio is not None and not 0.8 <= ratio <= 1.2:
        problems.append(f"the integral is {ratio:.2f}x the counter's rise")
    span = powered[-1][0] - powered[0][0] if len(powered) > 1 else 0.0
    row = (
        f"counter {'n/a' if counter_kj is None else f'{counter_kj:.3f}'} kJ, "
        f"integrated {integral_kj:.3f} kJ, ratio {'n/a' if ratio is None else f'{ratio:.3f}'}"
    )
    log(f"energy: {row}")
    partial = len(readings) - len(both) if both else 0
    measured = (
        f"{row} over {span:.2f} s ({len(readings)} samples every {interval:g} s"
        + (f", {partial} without both readings" if partial else "")
        + ")"
        + (f"; power mean {sum(watts) / len(watts):.0f}, peak {max(watts):.0f} W" if watts else "; no power")
        + f" (idle before: {first.power_watts} W)"
        + (f"; no energy counter ({'; '.join(f'{k}: {v}' for k, v in details['unsupported'].items())})"
           if counter_kj is None else "")
        + (f"; under bf16 matmul load ({load['tflops']} TFLOP/s)" if load else f"; no load ({why})")
        + f"; one sample() {details['sample_ms_median']} ms (median)"
    )  # fmt: skip
    return verdict(problems, measured, details)


def check_affinity() -> tuple[str, str, dict]:
    require_nvml()
    gs = gpustats()
    src = gs.NvmlSource()
    try:
        nvml_aff = src.cpu_affinity(0)
    finally:
        src.close()
    STATE["nvml_affinity"] = nvml_aff
    mine = sorted(os.sched_getaffinity(0))
    details = {"nvml": nvml_aff, "sched_getaffinity": mine, "cpu_count": os.cpu_count()}
    dc = None
    try:
        import warnings

        from dask_cuda.utils import get_cpu_affinity

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            dc = get_cpu_affinity(0)
        details["dask_cuda"] = dc
        details["dask_cuda_warnings"] = [str(x.message) for x in w]
    except Exception as e:
        details["dask_cuda"] = f"{type(e).__name__}: {e}"
    # an empty mask (NVML without topology, as in some VMs) is a finding, not a failure: gpuhub
    # then leaves the engines unpinned
    ok = set(nvml_aff) <= set(range(os.cpu_count() or 0))
    rel = "equal" if set(nvml_aff) == set(mine) else ("subset" if set(nvml_aff) <= set(mine) else "differs")
    if not nvml_aff:
        rel += " (NVML reports no CPU affinity here: nothing to pin to)"
    measured = (
        f"NvmlSource.cpu_affinity(0) = {cpulist(nvml_aff)} ({len(nvml_aff)} CPUs); "
        f"os.sched_getaffinity(0) = {cpulist(mine)} -> {rel}"
        + (f"; dask_cuda.get_cpu_affinity(0) = {cpulist(dc)}" if isinstance(dc, list) else "")
        + (" (same)" if isinstance(dc, list) and set(dc) == set(nvml_aff) else "")
    )
    if isinstance(dc, list) and set(dc) != set(nvml_aff):
        ok = False
        measured += " MISMATCH with gpuhub's"
    return ("ok" if ok else "FAIL"), measured, details


# ---------------------------------------------------------------------------------------
# 3 and 4: a real kernel


class Kernel:
    """An ipykernel started by jupyter_client, with the environment of a gpuhub server."""

    def __init__(self, env: dict, tmp: Path, timeout: float = 60):
        kdir = tmp / "jupyter" / "kernels" / "gpucheck"
        kdir.mkdir(parents=True, exist_ok=True)
        (kdir / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "gpucheck",
                    "language": "python",
                }
            )
        )
        os.environ["JUPYTER_PATH"] = str(tmp / "jupyter")
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="gpucheck")
        t = time.perf_counter()
        self.km.start_kernel(env=env, cwd=str(REPO))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=timeout)
        self.pid = int(self.run("import os; print(os.getpid())", 30)["stdout"].strip())
        self.start_s = time.perf_counter() - t
        self.pids: set[int] = {self.pid}
        self.left: list[str] = []  # processes still running after the kernel shut down

    def run(self, code: str, timeout: float) -> dict:
        out = {"stdout": "", "stderr": "", "error": None, "results": []}

        def hook(msg):
            kind, c = msg["msg_type"], msg["content"]
            if kind == "stream":
                out[c["name"]] += c["text"]
            elif kind == "error":
                out["error"] = f"{c['ename']}: {c['evalue']}\n" + ANSI.sub("", "\n".join(c["traceback"]))
            elif kind == "execute_result":
                out["results"].append(c["data"].get("text/plain", ""))

        t = time.perf_counter()
        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
        out["wall_s"] = round(time.perf_counter() - t, 3)
        out["status"] = reply["content"]["status"]
        if out["status"] != "ok" and not out["error"]:
            c = reply["content"]
            out["error"] = f"{c.get('ename')}: {c.get('evalue')}"
        return out

    def remember_children(self) -> None:
        """The kernel's process tree now (the engines and the reaper run in sessions of their
        own and outlive a killed kernel, so their pids are kept for the cleanup)."""
        import psutil

        try:
            self.pids |= {p.pid for p in psutil.Process(self.pid).children(recursive=True)}
        except psutil.Error:
            pass

    def close(self) -> None:
        import psutil

        self.remember_children()
        try:
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=False)  # the magics' atexit stops engines and clusters
        except Exception as e:
            log(f"kernel shutdown: {e}")
        procs, names = [], {}
        for pid in self.pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    procs.append(p)
                    names[pid] = " ".join(p.cmdline())[:160]
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=3)  # give them time to end by themselves
        procs = [p for p in procs if _running(p)]
        self.left = [f"{p.pid} {names[p.pid]}" for p in procs]
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _, left = psutil.wait_procs(procs, timeout=3)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        if procs:
            log(f"ended {len(procs)} process(es) left 3 s after the kernel: {'; '.join(self.left)}")


def _running(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def kernel_env(tmp: Path) -> dict:
    host = socket.gethostname()
    env = dict(os.environ)
    for k in ("GPUHUB_BROKER_URL", "GPUHUB_BACKEND", "JUPYTERHUB_API_TOKEN", "GPUHUB_KERNEL_PID"):
        env.pop(k, None)
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        GPUHUB_ALLOCATION_ID="1",
        GPUHUB_GPUS=f"{host}:0",
        GPUHUB_NODE=host,
        GPUHUB_GPU_MODEL=STATE.get("model", ""),
        CUDA_VISIBLE_DEVICES="0",
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        PYTHONPATH=os.pathsep.join([str(REPO), *[p for p in path if p != str(REPO)]]),
        IPYTHONDIR=str(tmp / "ipython"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        JUPYTER_PATH=str(tmp / "jupyter"),
        PYDEVD_DISABLE_FILE_VALIDATION="1",
    )
    return env


def get_kernel(tmp: Path) -> Kernel:
    k = STATE.pop("kernel", None)
    if k is not None:
        return k
    log("starting a kernel (jupyter_client + ipykernel)")
    k = Kernel(kernel_env(tmp), tmp)
    log(f"kernel pid {k.pid} ready in {k.start_s:.1f} s")
    return k


TRAIN = """\
import hashlib, json, os, time
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
_backend = {backend!r}
if not dist.is_initialized():
    dist.init_process_group(_backend)
_cuda = _backend == "nccl"
_dev = torch.device("cuda", 0) if _cuda else torch.device("cpu")
if _cuda:
    torch.cuda.set_device(_dev)
torch.manual_seed(0)
_model = DDP(nn.Linear({h}, {h}).to(_dev), device_ids=[0] if _cuda else None)
_opt = torch.optim.SGD(_model.parameters(), lr=1e-3)
_g = torch.Generator(device=_dev).manual_seed(1234 + dist.get_rank())
_X = torch.randn({b}, {h}, device=_dev, generator=_g)
_Y = torch.randn({b}, {h}, device=_dev, generator=_g)
def _step():
    _opt.zero_grad(set_to_none=True)
    _loss = ((_model(_X) - _Y) ** 2).mean()
    _loss.backward()
    _opt.step()
    return _loss
def _sync():
    if _cuda:
        torch.cuda.synchronize()
for _ in range({warm}):
    _step()
_sync()
_t = time.perf_counter()
for _ in range({steps}):
    _loss = _step()
_sync()
_dt = (time.perf_counter() - _t) / {steps}
_params = [p.detach().cpu().contiguous() for p in _model.parameters()]
print("GPUCHECK " + json.dumps({{
    "backend": getattr(dist.group.WORLD, "kind", dist.get_backend()),  # gpuhub groups wrap gloo/nccl
    "world_size": dist.get_world_size(),
    "device": str(_dev),
    "device_name": torch.cuda.get_device_name(0) if _cuda else "cpu",
    "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "step_ms": _dt * 1e3,
    "loss": float(_loss),
    "checksum": sum(float(p.double().sum()) for p in _params),
    "sha256": hashlib.sha256(b"".join(p.numpy().tobytes() for p in _params)).hexdigest()[:16],
    "pid": os.getpid(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"),
    "tf32": torch.backends.cuda.matmul.allow_tf32,
}}), flush=True)
"""


def parse_mark(text: str) -> dict:
    found = MARK.findall(text)
    if not found:
        raise ValueError(f"no GPUCHECK line in output: {text[-1500:]!r}")
    return json.loads(found[-1])


def check_distributed(tmp: Path, dry: bool) -> tuple[str, str, dict]:
    if not dry:
        require_nvml()
    backend = "gloo" if dry else "nccl"
    h, b, steps, warm = (256, 256, 20, 3) if dry else (4096, 4096, 50, 5)
    script = TRAIN.format(backend=backend, h=h, b=b, steps=steps, warm=warm)
    magic = f"%%distributed --gpus 1 --backend {backend} --timeout 120\n"
    details: dict = {"model": f"Linear({h},{h}), batch {b}, {warm} warm-up + {steps} timed steps, fp32, SGD"}
    problems: list[str] = []

    k = get_kernel(tmp)
    try:
        details["kernel_start_s"] = round(k.start_s, 2)
        r = k.run("%load_ext gpu_magics\n%gpus", 60)
        details["gpus_magic"] = r["stdout"]
        if r["error"]:
            raise RuntimeError(f"%load_ext gpu_magics: {r['error']}")
        log("cell 1: %%distributed (engine start + DDP)")
        c1 = k.run(magic + script, 150)
        k.remember_children()
        details["cell1"] = {"wall_s": c1["wall_s"], "stderr": c1["stderr"][-3000:], "error": c1["error"]}
        if c1["error"]:
            raise RuntimeError(f"first %%distributed cell: {c1['error'][-3000:]}")
        m1 = parse_mark(c1["stdout"])
        details["cell1"]["rank0"] = m1
        log(f"cell 1: {c1['wall_s']:.1f} s wall, {m1['step_ms']:.2f} ms/step")
        c2 = k.run(magic + script, 120)
        details["cell2"] = {"wall_s": c2["wall_s"], "stderr": c2["stderr"][-3000:], "error": c2["error"]}
        if c2["error"]:
            raise RuntimeError(f"second %%distributed cell: {c2['error'][-3000:]}")
        m2 = parse_mark(c2["stdout"])
        details["cell2"]["rank0"] = m2
        log(f"cell 2: {c2['wall_s']:.1f} s wall, {m2['step_ms']:.2f} ms/step")
        info = k.run(
            "import json as _j\n"
            "_m = get_ipython().magics_manager.registry['DistributedMagics']\n"
            "print('GPUCHECK ' + _j.dumps({'infos': _m.pool.infos, 'controller': _m.pool.controller_pid},"
            " default=str))",
            30,
        )
        infos = parse_mark(info["stdout"]) if not info["error"] else {"error": info["error"]}
        details["pool"] = infos
        engine = (infos.get("infos") or [{}])[0]
        k.remember_children()

        # torchrun, same script, same GPU
        path = tmp / "ddp_train.py"
        path.write_text(script)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="0", CUDA_DEVICE_ORDER="PCI_BUS_ID")
        log("torchrun --nproc_per_node 1 (same script)")
        t = time.perf_counter()
        tr = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "1",
                str(path),
            ],
            capture_output=True,
            text=True,
            timeout=150,
            env=env,
            cwd=tmp,
        )
        tr_wall = time.perf_counter() - t
        details["torchrun"] = {"wall_s": round(tr_wall, 2), "rc": tr.returncode, "stderr": tr.stderr[-3000:]}
        if tr.returncode:
            raise RuntimeError(f"torchrun exited {tr.returncode}: {tr.stderr[-3000:]}")
        mt = parse_mark(tr.stdout)
        details["torchrun"]["rank0"] = mt
        log(f"torchrun: {tr_wall:.1f} s wall, {mt['step_ms']:.2f} ms/step")

        # the engine goes when asked
        sd = k.run("%distributed shutdown", 60)
        details["shutdown"] = sd["stdout"] + (sd["error"] or "")
        gone = wait_gone(m1["pid"], 15)

        # verdicts
        want_dev = "cpu" if dry else "cuda:0"
        for name, m in (("cell 1", m1), ("cell 2", m2), ("torchrun", mt)):
            if m["backend"] != backend or m["device"] != want_dev or m["world_size"] != 1:
                problems.append(
                    f"{name}: backend {m['backend']}, device {m['device']}, world {m['world_size']}"
                )
        if m2["pid"] != m1["pid"]:
            problems.append(f"cell 2 ran in engine pid {m2['pid']}, cell 1 in {m1['pid']} (not warm)")
        if engine.get("pid") not in (None, m1["pid"]):
            problems.append(f"pool.infos pid {engine.get('pid')} != engine pid {m1['pid']}")
        bitwise = m1["sha256"] == mt["sha256"]
        close = abs(m1["checksum"] - mt["checksum"]) <= 1e-6 * max(1.0, abs(mt["checksum"]))
        if not close:
            problems.append(f"parameters differ: {m1['checksum']!r} vs torchrun {mt['checksum']!r}")
        if m2["sha256"] != m1["sha256"]:
            problems.append("cell 2 (same seed, fresh model) gave other parameters than cell 1")
        ratio = m1["step_ms"] / mt["step_ms"]
        ratio2 = m2["step_ms"] / mt["step_ms"]
        if not dry and min(ratio, ratio2) > 1.5:
            problems.append(f"steps {min(ratio, ratio2):.2f}x slower than torchrun")
        if not gone:
            problems.append(f"engine pid {m1['pid']} still runs after %distributed shutdown")
        nvml_aff = STATE.get("nvml_affinity")
        if nvml_aff is None and not dry:
            try:
                src = gpustats().NvmlSource()
                nvml_aff = src.cpu_affinity(0)
                src.close()
            except Exception as e:
                nvml_aff = f"{e}"
        cpus = engine.get("cpus")
        details["affinity"] = {
            "engine_reported": cpus,
            "engine_pinned": engine.get("pinned"),
            "engine_sched": m1["affinity"],
            "nvml_gpu0": nvml_aff,
        }
        aff = (
            f"engine CPUs: reported {cpulist(cpus) if cpus is not None else 'not reported'} "
            f"(pinned {engine.get('pinned', 'not reported')}), "
            f"sched_getaffinity {cpulist(m1['affinity'])}; NVML GPU 0: "
            + (cpulist(nvml_aff) if isinstance(nvml_aff, list) else str(nvml_aff or "n/a"))
        )
        want = set(nvml_aff) & os.sched_getaffinity(0) if isinstance(nvml_aff, list) else set()
        if want and set(m1["affinity"]) != want:
            aff += " (engine NOT pinned to the GPU's CPUs)"
            if not dry:
                problems.append(f"engine runs on CPUs {cpulist(m1['affinity'])}, GPU 0's are {cpulist(want)}")
        elif want:
            aff += " (engine = GPU's CPUs)"
        measured = (
            f"{backend} on {m1['device']} ({m1['device_name']}), CVD={m1['cuda_visible_devices']}: "
            f"%%distributed {m1['step_ms']:.2f} ms/step "
            f"(cell 1, {c1['wall_s']:.1f} s wall incl. engine start), {m2['step_ms']:.2f} ms/step "
            f"(cell 2 warm, same pid {m2['pid'] == m1['pid']}, {c2['wall_s']:.1f} s wall); "
            f"torchrun {mt['step_ms']:.2f} ms/step ({tr_wall:.1f} s wall); ratio {ratio:.3f} / {ratio2:.3f}; "
            f"params {'bitwise equal' if bitwise else ('allclose' if close else 'DIFFERENT')} "
            f"(checksum {m1['checksum']:.6f}, sha {m1['sha256']}); kernel start {k.start_s:.1f} s; "
            f"shutdown ended engine: {gone}; {aff}"
        )
        STATE["kernel"] = k  # healthy: check 4 goes on in it
        return verdict(problems, measured, details)
    except BaseException:
        STATE["last_details"] = details
        k.close()
        raise


def check_mps(tmp: Path, seconds: float = 4.0) -> tuple[str, str, dict]:
    """Slices through CUDA MPS as ``spawner.policy.mps`` builds them (issue 34): two control
    daemons on GPU 0 (gpuhub's plan: one per user and GPU; here both of this account, so
    what differs between Unix users stays unchecked), each with one 1/4-GPU client. Each client
    must be refused memory past its slice (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and both must
    run their matmuls at the same time; the daemons are quit as gpuhub would quit them."""
    require_nvml()
    from spawner.policy import mps
    from spawner.policy.slices import Offer

    if not shutil.which(mps.CONTROL):
        raise Skip(f"{mps.CONTROL} is not on PATH")
    [[uuid, total, mode]] = nvidia_smi("uuid,memory.total,compute_mode")[:1]
    if mode.replace("_", " ").lower() != "default":
        raise Skip(
            f"GPU 0's compute mode is {mode}: gpuhub's slices need Default, and this check changes no setting"
        )
    offer = Offer("GPU 0", 4, int(float(total)))
    dirs = [tmp / f"mps-user{i}" for i in (1, 2)]
    started, clients, details = [], [], {"offer_mib": offer.memory_mib, "threads": offer.thread_percent}
    try:
        for d in dirs:
            d.mkdir(mode=0o700)
            argv, env = mps.control_start(str(d), uuid)
            for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
                Path(env[k]).mkdir(parents=True, mode=0o700)
            subprocess.run(argv, env=dict(os.environ, **env), check=True, timeout=30)
            started.append(d)
        for d in dirs:
            env = dict(os.environ, **mps.client_env(str(d), uuid, offer))
            clients.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--helper", "mps_client", str(offer.memory_mib), str(seconds)],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                )
            )  # fmt: skip
            STATE.setdefault("procs", []).append(clients[-1])  # killed by cleanup() if the check times out
        results = []
        for c in clients:
            out, err = c.communicate(timeout=120)
            if c.returncode:
                raise RuntimeError(f"an MPS client exited {c.returncode}: {err[-1500:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        details["clients"] = results
    finally:
        for d in started:
            argv, env, stdin = mps.control_quit(str(d), uuid)
            subprocess.run(argv, env=dict(os.environ, **env), input=stdin, text=True, timeout=30, check=False)
    problems = []
    for i, r in enumerate(results, 1):
        if r["allocated_mib"] > offer.memory_mib:
            problems.append(
                f"client {i} allocated {r['allocated_mib']} MiB past its {offer.memory_mib} MiB slice"
            )
        if r["refused"] is None:
            problems.append(f"client {i} was never refused memory")
    (a0, a1), (b0, b1) = results[0]["span"], results[1]["span"]
    overlap = max(0.0, min(a1, b1) - max(a0, b0))
    if overlap <= 0:
        problems.append("the two clients never ran at the same time")
    measured = (
        f"1/4 slices of {total} MiB: clients allocated {results[0]['allocated_mib']} and "
        f"{results[1]['allocated_mib']} MiB of {offer.memory_mib} (refused past it: "
        f"{results[0]['refused'] is not None}, {results[1]['refused'] is not None}); ran at once for "
        f"{overlap:.1f} s; {results[0]['matmuls']} and {results[1]['matmuls']} matmuls at "
        f"{offer.thread_percent} % of the SMs each; two daemons, one account (different users unchecked)"
    )
    return verdict(problems, measured, details)


def same_as_nvml(cpus: list[int], nvml_aff) -> str:
    if not isinstance(nvml_aff, list):
        return ""
    return f" ({'=' if set(cpus) == set(nvml_aff) else '!='} NVML GPU 0's {cpulist(nvml_aff)})"


def verdict(problems: list[str], measured: str, details: dict) -> tuple[str, str, dict]:
    if problems:
        return "FAIL", f"{measured}; PROBLEMS: {'; '.join(problems)}", details
    return "ok", measured, details


def wait_gone(pid: int, timeout: float) -> bool:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.2)
    return False


PROBE = """\
def _gpucheck_probe():
    import os, socket
    try:
        import torch
    except ImportError:
        torch = None
    cuda = torch is not None and torch.cuda.is_available()
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "affinity": sorted(os.sched_getaffinity(0)),
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
    }
"""


def check_dask_magic(tmp: Path, dry: bool) -> tuple[str, str, dict]:
    if not dry:
        require_nvml()
    details: dict = {}
    k = get_kernel(tmp)
    try:
        line = "%dask_cuda --cpu --workers 1" if dry else "%dask_cuda --gpus 1"
        details["line"] = line
        r = k.run(f"%load_ext gpu_magics\n{line}", 120)
        details["magic"] = {k2: r[k2] for k2 in ("stdout", "stderr", "error", "wall_s")}
        if r["error"] and "not found" in r["error"]:
            r2 = k.run(f"%load_ext gpu_magics.dask.magic\n{line}", 120)
            details["magic_via_daskmagic"] = {k2: r2[k2] for k2 in ("stdout", "stderr", "error", "wall_s")}
            if r2["error"]:
                why = r2["error"].splitlines()[0][:200]
                raise Skip(f"%dask_cuda not available in gpu_magics yet ({why})")
            r = r2
        k.remember_children()
        if r["error"]:
            raise RuntimeError(f"{line}: {r['error'][-3000:]}")
        start_s = r["wall_s"]
        p = k.run(
            PROBE
            + "import json as _j\n"
            + "_r = client.submit(_gpucheck_probe, pure=False).result(timeout=90)\n"
            + "_r['workers'] = len(client.scheduler_info()['workers'])\n"
            + "_r['client'] = type(client).__module__ + '.' + type(client).__name__\n"
            + "print('GPUCHECK ' + _j.dumps(_r))",
            120,
        )
        k.remember_children()
        if p["error"]:
            raise RuntimeError(f"client.submit: {p['error'][-3000:]}")
        res = parse_mark(p["stdout"])
        details["probe"] = res
        down = k.run("%dask_cuda shutdown", 60)
        details["shutdown"] = down["stdout"] + (down["error"] or "")
        problems = []
        if not dry:
            if not res["device_name"] or res["device_count"] != 1:
                problems.append(f"worker sees {res['device_count']} GPUs ({res['device_name']})")
            if res["cuda_visible_devices"] not in ("0",):
                problems.append(f"worker CUDA_VISIBLE_DEVICES={res['cuda_visible_devices']!r}, expected '0'")
        nvml_aff = STATE.get("nvml_affinity")
        measured = (
            f"{line}: up in {start_s:.1f} s ({(r['stdout'].strip().splitlines() or [''])[-1][:200]}); "
            f"{res['client']} with {res['workers']} worker(s); worker sees "
            f"{res['device_name']} (count {res['device_count']}), CVD={res['cuda_visible_devices']}, "
            f"affinity {cpulist(res['affinity'])}"
            + same_as_nvml(res["affinity"], nvml_aff)
            + (f"; shutdown: {details['shutdown'].strip()[:120]}" if details["shutdown"].strip() else "")
        )
        return verdict(problems, measured, details)
    finally:
        STATE["last_details"] = details
        k.close()
        details["left_after_kernel"] = k.left


CLUSTER = """\
import json, os, sys, time
{probe}
if __name__ == "__main__":
    t = time.perf_counter()
    from distributed import Client
    if sys.argv[1] == "cuda":
        from dask_cuda import LocalCUDACluster
        cluster = LocalCUDACluster(n_workers=1, CUDA_VISIBLE_DEVICES="0", dashboard_address=":0")
    else:
        from distributed import LocalCluster
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0")
    with cluster, Client(cluster) as client:
        up = time.perf_counter() - t
        r = client.submit(_gpucheck_probe, pure=False).result(timeout=90)
        r.update(startup_s=round(up, 2), workers=len(client.scheduler_info()["workers"]),
                 cluster=type(cluster).__name__)
        print("GPUCHECK " + json.dumps(r), flush=True)
"""


def check_cluster(tmp: Path, dry: bool) -> tuple[str, str, dict]:
    if not dry:
        require_nvml()
    path = tmp / "cluster_probe.py"
    path.write_text(CLUSTER.format(probe=PROBE))
    env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    t = time.perf_counter()
    p = subprocess.run(
        [sys.executable, str(path), "cpu" if dry else "cuda"],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=tmp,
    )
    wall = time.perf_counter() - t
    details = {"rc": p.returncode, "wall_s": round(wall, 2), "stderr": p.stderr[-4000:]}
    if p.returncode:
        raise RuntimeError(f"exited {p.returncode}: {p.stderr[-3000:]}")
    res = parse_mark(p.stdout)
    details["probe"] = res
    problems = []
    if not dry:
        if res["device_count"] != 1 or not res["device_name"]:
            problems.append(f"worker sees {res['device_count']} GPUs")
        if res["cuda_visible_devices"] not in ("0",) and not str(res["cuda_visible_devices"]).startswith("0"):
            problems.append(f"worker CUDA_VISIBLE_DEVICES={res['cuda_visible_devices']!r}")
    nvml_aff = STATE.get("nvml_affinity")
    measured = (
        f"{res['cluster']} up in {res['startup_s']:.1f} s ({wall:.1f} s in all), {res['workers']} worker(s); "
        f"worker sees {res['device_name']} (count {res['device_count']}), CVD={res['cuda_visible_devices']}, "
        f"affinity {cpulist(res['affinity'])}" + same_as_nvml(res["affinity"], nvml_aff)
    )
    return verdict(problems, measured, details)


# ---------------------------------------------------------------------------------------
# running and reporting


def _alarm(signum, frame):
    raise CheckTimeout()


def run_check(cid: str, name: str, fn, budget: float, deadline: float) -> dict:
    limit = min(budget, deadline - time.monotonic())
    row = {"id": cid, "check": name, "result": "FAIL", "measured": "", "seconds": 0.0, "details": {}}
    ROWS.append(row)
    if limit < 5:
        row["measured"] = "not run: the overall time limit is used up"
        write_out()
        return row
    log(f"check {cid}: {name} (limit {limit:.0f} s)")
    t = time.monotonic()
    STATE.pop("last_details", None)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, limit)
    try:
        try:
            row["result"], row["measured"], row["details"] = fn()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except CheckTimeout:
        row["measured"] = f"timed out after {limit:.0f} s"
        row["details"] = STATE.get("last_details", {})
    except Skip as s:
        row["result"], row["measured"] = "skipped", f"skipped ({s})"
    except Exception as e:
        row["measured"] = f"{type(e).__name__}: {e}"[:1500]
        row["details"] = {"traceback": traceback.format_exc()[-6000:], **STATE.get("last_details", {})}
    row["seconds"] = round(time.monotonic() - t, 1)
    log(f"check {cid}: {row['result']} in {row['seconds']} s")
    write_out()
    return row


def table() -> str:
    w = 34
    lines = [f"{'check':<{w}} {'result':<8} {'s':>6}  measured", "-" * 110]
    for r in ROWS:
        body = textwrap.wrap(r["measured"], 100) or [""]
        lines.append(f"{r['id'] + ' ' + r['check']:<{w}} {r['result']:<8} {r['seconds']:>6.1f}  {body[0]}")
        lines += [" " * (w + 18) + b for b in body[1:]]
    n = {k: sum(r["result"] == k for r in ROWS) for k in ("ok", "FAIL", "skipped")}
    lines.append("-" * 110)
    lines.append(
        f"{n['ok']} ok, {n['FAIL']} failed, {n['skipped']} skipped in {time.monotonic() - START:.0f} s"
    )
    return "\n".join(lines)


def write_out() -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gpu_check.txt").write_text(table() + "\n")
        Path(out, "gpu_check.json").write_text(
            json.dumps({"env": ENV, "rows": ROWS, "notes": STATE.get("notes", [])}, indent=1, default=str)
        )
    except OSError as e:
        log(f"could not write to $OUT: {e}")


def cleanup() -> None:
    k = STATE.pop("kernel", None)
    if k is not None:
        k.close()
    for p in STATE.get("procs", []):
        if p.poll() is None:
            p.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true", help="no GPU: check 3 and 4 on CPU with gloo")
    ap.add_argument("--only", default="", help="checks to run, e.g. 1,2,3 (0 always runs)")
    ap.add_argument("--deadline", type=float, default=300, help="seconds for all checks together")
    ap.add_argument("--site", default=os.environ.get("GPUCHECK_SITE", "/tmp/site"), help="carried wheels")
    args = ap.parse_args()
    dry = args.cpu_dry_run
    only = {c.strip() for c in args.only.split(",") if c.strip()}
    deadline = START + args.deadline

    def term(signum, frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, term)
    tmp = Path(tempfile.mkdtemp(prefix="gpucheck-"))
    STATE["nvml_problem"] = nvml_problem()
    log(f"NVML: {STATE['nvml_problem'] or 'available'}; dry run: {dry}; work dir {tmp}")

    def want(c: str) -> bool:
        return not only or c in only or c.rstrip("abc") in only

    mode = "gloo" if dry else "NCCL"
    checks = [
        ("0", "environment", lambda: check_env(Path(args.site)), 30),
        ("1", "NVML inventory", check_inventory, 90),
        ("2", "NVML sampling under load", check_sampling, 90),
        ("2b", "NVML CPU affinity", check_affinity, 30),
        ("2c", "NVML power and energy counter", check_energy, 60),
        ("3", f"%%distributed {mode} vs torchrun", lambda: check_distributed(tmp, dry), 210),
        ("4a", "%dask_cuda magic", lambda: check_dask_magic(tmp, dry), 150),
        ("4b", "LocalCluster subprocess (CPU)" if dry else "LocalCUDACluster subprocess",
         lambda: check_cluster(tmp, dry), 150),
        ("5", "MPS slices (two daemons)", lambda: check_mps(tmp), 120),
    ]  # fmt: skip
    try:
        for cid, name, fn, budget in checks:
            if cid == "0" or want(cid):
                row = run_check(cid, name, fn, budget, deadline)
                if cid == "0":
                    ENV.update(row.get("details", {}))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:
            cleanup()
        except BaseException as e:
            log(f"cleanup: {e}")
        write_out()
    print()
    print(table(), flush=True)
    if os.environ.get("OUT"):
        print(f"(written to {os.environ['OUT']}/gpu_check.txt and gpu_check.json)")
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if any(r["result"] == "FAIL" for r in ROWS) else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--helper":
        helper_main(sys.argv[2:])
        sys.exit(0)
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never hang on a thread some library left behind
