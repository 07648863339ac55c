"""%%distributed against the real alternatives, measured side by side in one run.

    .venv/bin/python benchmarks/distributed.py [ranks] [repeats] [rounds]

1. A trivial cell on warm engines through %%distributed vs raw ipyparallel ``execute`` on the
   same engines (the magic's own overhead), ``repeats`` times interleaved. Also shown: raw
   ``execute(silent=False)``, which is what a cell that shows its result has to ask for.
2. DDP steps/s inside %%distributed vs the same training script under ``torchrun``, ``rounds``
   rounds interleaved, each going first in turn (this machine is shared, so one of each says
   little): the medians, and the spread of the rounds' ratios. Rank 0 of each also says what
   else its process did during the timed loop: CPU ticks of threads other than the training
   thread and gloo's, and GC runs.
3. Time to the first training step: re-running the cell on warm engines vs a torchrun launch.

Runs in an IPython shell in this process, on the CPU (gloo), with simulated server GPUs
(no hub needed). Prints medians and ratios.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from notebook_shell import magic_shell

TRAIN = """
import gc, os, resource, threading, time, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
if not dist.is_initialized():
    dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, y = torch.randn(128, 64), torch.randn(128, 1)
def step():
    opt.zero_grad(); loss = ((model(X) - y) ** 2).mean(); loss.backward(); opt.step()
def ticks():  # CPU ticks of this process's threads, by name (the training thread's own apart)
    me, out = threading.get_native_id(), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name, rest = f.read().split(" (", 1)[1].rsplit(")", 1)
        except OSError:
            continue
        key = "training" if int(tid) == me else name
        out[key] = out.get(key, 0) + sum(map(int, rest.split()[11:13]))
    return out
step()  # the first step
if rank == 0:
    print("first-step", time.time(), flush=True)
before, collections = ticks(), sum(s["collections"] for s in gc.get_stats())
use = resource.getrusage(resource.RUSAGE_SELF)
dist.barrier()
t = time.perf_counter()
for _ in range(STEPS):
    step()
dist.barrier()
rate = STEPS / (time.perf_counter() - t)
after, used = ticks(), resource.getrusage(resource.RUSAGE_SELF)
others = sum(v - before.get(k, 0) for k, v in after.items() if k != "training" and "gloo" not in k)
if rank == 0:
    print("steps/s", rate, flush=True)
    gcs = sum(s["collections"] for s in gc.get_stats()) - collections
    cpu = (used.ru_utime + used.ru_stime - use.ru_utime - use.ru_stime) / STEPS * 1e3
    switches = (used.ru_nivcsw - use.ru_nivcsw) / STEPS
    print(
        f"threads {len(os.listdir('/proc/self/task'))} other-ticks {others} gc {gcs} "
        f"cpu-ms/step {cpu:.2f} preempted/step {switches:.2f}",
        flush=True,
    )
"""


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    steps = 200
    shell, magic = magic_shell(ranks)
    assert shell.run_cell(magic + "1").success  # start the pool
    magics = shell.magics_manager.registry["DistributedMagics"]
    view = magics.pool.view

    # 1. trivial cell: the magic vs raw ipyparallel on the same engines
    runs = {
        "magic": lambda: shell.run_cell(magic + "1", silent=True),
        "raw": lambda: view.execute("1", block=True),
        "raw, silent=False": lambda: view.execute("1", silent=False, block=True),
    }
    times = {name: [] for name in runs}
    for i in range(repeats):  # forwards, then backwards: each has every place as often
        for name, run in list(runs.items())[:: 1 if i % 2 else -1]:
            t = time.perf_counter()
            got = run()
            times[name].append(time.perf_counter() - t)
            if hasattr(got, "wait_for_output"):  # untimed: its last messages (output, idle)
                got.wait_for_output(5)  # must not land in the next one's time

    # 2 and 3: the training script, warm in the engines vs torchrun, rounds interleaved
    code = TRAIN.replace("STEPS", str(steps))
    _capture(shell, magic + code)  # warm-up: imports, first optimizer
    script = Path(tempfile.mkdtemp(prefix="gpuhub-bench-")) / "train.py"
    # a script's own end under torchrun (the engines' group lives on): without it a rank's exit
    # sometimes aborts in gloo's threads ("terminate called without an active exception")
    script.write_text(code + "dist.destroy_process_group()\n")
    torchrun = Path(sys.executable).with_name("torchrun")

    def in_engines() -> tuple[float, float, str]:
        t = time.time()
        return _reading(_capture(shell, magic + code), t)

    def under_torchrun() -> tuple[float, float, str]:
        t = time.time()
        proc = subprocess.run(
            [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", str(script)],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(f"torchrun failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
        return _reading(proc.stdout, t)

    warm, cold = [], []
    order = [(warm, in_engines), (cold, under_torchrun)]
    for i in range(rounds):  # who goes first alternates: neither always has the same place
        for readings, run in order if i % 2 == 0 else order[::-1]:
            readings.append(run())
    shell.run_line_magic("distributed", "shutdown")

    m, r, loud = (statistics.median(times[k]) for k in runs)
    print(f"\n{ranks} ranks, gloo on CPU, {os.cpu_count()} cores")
    print(
        f"trivial cell, median of {repeats}: %%distributed {m * 1e3:.1f} ms, "
        f"raw ipyparallel execute {r * 1e3:.1f} ms, ratio {m / r:.2f}x "
        f"(raw execute(silent=False) {loud * 1e3:.1f} ms, {loud / r:.2f}x)"
    )
    w_rate, c_rate = (statistics.median(x[1] for x in runs_) for runs_ in (warm, cold))
    ratios = sorted(a[1] / b[1] for a, b in zip(warm, cold, strict=True))
    print(
        f"DDP steps/s, median of {rounds} rounds of {steps} steps: %%distributed {w_rate:.1f}, "
        f"torchrun {c_rate:.1f}, ratio {w_rate / c_rate:.2f}x "
        f"(rounds' ratios {ratios[0]:.2f}..{ratios[-1]:.2f}, median {statistics.median(ratios):.2f})"
    )
    for name, runs_ in (("%%distributed", warm), ("torchrun", cold)):
        rates = sorted(x[1] for x in runs_)
        seen = {k: statistics.median(x[2][k] for x in runs_) for k in runs_[0][2]}
        print(
            f"  {name}: rounds {rates[0]:.1f}..{rates[-1]:.1f} steps/s; rank 0's process during the "
            f"loop, medians: {seen['threads']:.0f} threads, CPU {seen['cpu-ms/step']:.2f} ms/step, "
            f"preempted {seen['preempted/step']:.1f} times/step, CPU ticks of its other threads "
            f"(not training, not gloo) {seen['other-ticks']:.0f}, GC runs {seen['gc']:.0f}"
        )
    w_first, c_first = (statistics.median(x[0] for x in runs_) for runs_ in (warm, cold))
    print(
        f"time to first step: warm engines {w_first:.2f} s, torchrun launch {c_first:.2f} s, "
        f"ratio {c_first / w_first:.1f}x faster warm"
    )


def _reading(text: str, started: float) -> tuple[float, float, dict[str, float]]:
    """(seconds to the first step, steps/s, what rank 0's process did during the loop) from one
    run's output."""
    line = next(x for x in text.splitlines() if "other-ticks" in x).split("] ", 1)[-1].split()
    seen = dict(zip(line[::2], map(float, line[1::2]), strict=True))
    return _value(text, "first-step") - started, _value(text, "steps/s"), seen


def _capture(shell, cell: str) -> str:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        result = shell.run_cell(cell)
    if not result.success:
        raise RuntimeError(cap.stdout + cap.stderr)
    return cap.stdout


def _value(text: str, key: str) -> float:
    for line in text.splitlines():
        if key in line:
            return float(line.split(key)[1].split()[0])
    raise ValueError(f"{key!r} not in output:\n{text}")


if __name__ == "__main__":
    main()
