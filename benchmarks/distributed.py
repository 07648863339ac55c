"""%%distributed against the real alternatives, measured side by side in one run.

    .venv/bin/python benchmarks/distributed.py [ranks] [repeats] [rounds] [pairs]

1. A trivial cell on warm engines through %%distributed vs raw ipyparallel ``execute`` on the
   same engines (the magic's own overhead), ``repeats`` times interleaved; each cell's ratio
   to the raw ``execute`` run beside it gives a 95% interval for the ratio. Also shown: raw
   ``execute(silent=False)``, which is what a cell that shows its result has to ask for, and
   all three again with the engines' output streams as ipykernel makes them (every flush a
   round trip to the IOPub thread; ``engine.gate_flushes`` off), in blocks taking turns.
2. DDP steps/s inside %%distributed vs the same training script under ``torchrun``, ``rounds``
   rounds interleaved, each going first in turn (this machine is shared, so one of each says
   little): the medians, the rounds' paired ratios with a 95% interval (their logs' mean, t),
   the ratio by who went first, and how many rounds each won. Every rank also says what its
   threads did during the timed loop (``/proc/self/task``: CPU and run-queue wait from
   ``schedstat``, switches), summed over the ranks, per step. Then warm against warm, in
   ``pairs`` pairs (default ``4 * rounds``): torchrun's workers stay up (rank 0 reads "go" from their standard
   input) and run the same timed loop in turns with the engines, each pair seconds apart
   instead of a torchrun launch (8-10 s of four processes importing torch) apart.
3. The same step without DDP on rank 0 alone (the other ranks idle), in the engine vs a fresh
   ``python`` process, rounds interleaved: whether an engine's process does the same work in
   the same time, apart from the ranks' communication.
4. Time to the first training step: re-running the cell on warm engines vs a torchrun launch.

Runs in an IPython shell in this process, on the CPU (gloo), with simulated server GPUs
(no hub needed). Prints medians and ratios.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from notebook_shell import magic_shell

SETUP = """
import gc, json, os, threading, time, torch, torch.distributed as dist, torch.nn as nn
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
def threads():  # per thread kind: [CPU ns, run-queue wait ns, switches, involuntary]
    me, out = threading.get_native_id(), {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                name = f.read().split(" (", 1)[1].rsplit(")", 1)[0]
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = map(int, f.read().split()[:2])
            with open(f"/proc/self/task/{tid}/status") as f:
                st = dict(x.split(":\t", 1) for x in f.read().splitlines() if ":\t" in x)
        except OSError:
            continue
        kind = "gloo-tcp" if "gloo_tcp" in name else "gloo-work" if "gloo" in name else "other"
        key = "training" if int(tid) == me else kind
        vol, invol = int(st["voluntary_ctxt_switches"]), int(st["nonvoluntary_ctxt_switches"])
        out[key] = [a + b for a, b in zip(out.get(key, [0] * 4), (run, wait, vol + invol, invol))]
    return out
def timed(steps):  # the timed loop; rank 0 prints its steps/s and every rank's threads
    before, collections = threads(), sum(s["collections"] for s in gc.get_stats())
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    rate = steps / (time.perf_counter() - t)
    after, gcs = threads(), sum(s["collections"] for s in gc.get_stats()) - collections
    mine = {k: [(a - b) / steps for a, b in zip(v, before.get(k, [0] * 4))] for k, v in after.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, [mine, gcs, len(os.listdir("/proc/self/task"))])
    if rank == 0:
        print("steps/s", rate, flush=True)
        print("threads-json", json.dumps(every), flush=True)
step()  # the first step
if rank == 0:
    print("first-step", time.time(), flush=True)
"""
TRAIN = SETUP + "timed(STEPS)\n"
# torchrun's workers kept warm: rank 0 reads "go" (another loop) or anything else (the end)
# from the standard input the workers share, and tells the others
SERVE = (
    SETUP
    + """
import sys
while True:
    command = [sys.stdin.readline().strip() if rank == 0 else None]
    dist.broadcast_object_list(command)
    if command[0] != "go":
        break
    timed(STEPS)
"""
)
# a script's own end under torchrun (the engines' group lives on): without it a rank's exit
# sometimes aborts in gloo's threads ("terminate called without an active exception"), and
# even with it (seen with the readings' all_gather_object): so it leaves without destructors
END = "dist.barrier()\ndist.destroy_process_group()\nos._exit(0)\n"

COMPUTE = """
import os, time, torch, torch.nn as nn
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, y = torch.randn(128, 64), torch.randn(128, 1)
def step():
    opt.zero_grad(); loss = ((model(X) - y) ** 2).mean(); loss.backward(); opt.step()
for _ in range(50):
    step()
t, c = time.perf_counter(), time.thread_time()
for _ in range(STEPS):
    step()
print("compute", STEPS / (time.perf_counter() - t), (time.thread_time() - c) / STEPS * 1e6, flush=True)
"""

UNGATE = """
import sys
for s in (sys.stdout, sys.stderr):
    if "_gpuhub_gate" in s.__dict__:
        del s._gpuhub_gate, s.flush, s._flush
"""
GATE = "import sys; from gpu_magics.engine.rank import gate_flushes; gate_flushes(sys.stdout, sys.stderr)"


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    n_pairs = int(sys.argv[4]) if len(sys.argv) > 4 else 4 * rounds
    steps = 200
    shell, magic = magic_shell(ranks)
    assert shell.run_cell(magic + "1").success  # start the pool
    magics = shell.magics_manager.registry["DistributedMagics"]
    view = magics.pool.view
    load = [os.getloadavg()[0]]

    # 1. trivial cell: the magic vs raw ipyparallel on the same engines, with the engines'
    # flushes gated (as gpuhub starts them) and as ipykernel makes them, in blocks taking turns
    runs = {
        "magic": lambda: shell.run_cell(magic + "1", silent=True),
        "raw": lambda: view.execute("1", block=True),
        "raw, silent=False": lambda: view.execute("1", silent=False, block=True),
        # the same raw execute as a cell of its own: IPython's run_cell on both sides
        "raw, in a cell": lambda: shell.run_cell("_bench_view.execute('1', block=True)", silent=True),
    }
    shell.user_ns["_bench_view"] = view
    times = {(gated, name): [] for gated in (True, False) for name in runs}
    blocks = 4
    for b in range(blocks):
        for gated in (True, False) if b % 2 == 0 else (False, True):
            view.execute(GATE if gated else UNGATE, block=True)
            for i in range(max(1, repeats // blocks)):  # forwards, then backwards
                for name, run in list(runs.items())[:: 1 if i % 2 else -1]:
                    t = time.perf_counter()
                    got = run()
                    times[gated, name].append(time.perf_counter() - t)
                    if hasattr(got, "wait_for_output"):  # untimed: its last messages (output, idle)
                        got.wait_for_output(5)  # must not land in the next one's time
    view.execute(GATE, block=True)
    load.append(os.getloadavg()[0])

    # 2 and 4: the training script, warm in the engines vs torchrun, rounds interleaved
    code = TRAIN.replace("STEPS", str(steps))
    _capture(shell, magic + code)  # warm-up: imports, first optimizer
    script = Path(tempfile.mkdtemp(prefix="gpuhub-bench-")) / "train.py"
    script.write_text(code + END)
    torchrun = Path(sys.executable).with_name("torchrun")

    def in_engines() -> tuple[float, float, list]:
        t = time.time()
        return _reading(_capture(shell, magic + code), t)

    def under_torchrun() -> tuple[float, float, list]:
        t = time.time()
        proc = subprocess.run(
            [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", str(script)],
            capture_output=True,
            text=True,
        )
        if proc.returncode:
            raise RuntimeError(f"torchrun failed:\n{proc.stdout}\n{proc.stderr[-3000:]}")
        return _reading(proc.stdout, t)

    warm, cold, first = [], [], []
    order = [(warm, in_engines), (cold, under_torchrun)]
    for i in range(rounds):  # who goes first alternates: neither always has the same place
        first.append("engines" if i % 2 == 0 else "torchrun")
        for readings, run in order if i % 2 == 0 else order[::-1]:
            readings.append(run())
    load.append(os.getloadavg()[0])

    # 2b. warm against warm: torchrun's workers stay up and run the timed loop when told, in
    # turns with the engines, so that each pair is seconds apart, not a torchrun launch apart
    serve = Path(script).with_name("serve.py")
    serve.write_text(SERVE.replace("STEPS", str(steps)) + END)
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", str(serve)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )

    def served() -> tuple[float, float, list]:
        proc.stdin.write("go\n")
        proc.stdin.flush()
        lines = []
        while not lines or not lines[-1].startswith("threads-json"):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError("torchrun's workers ended:\n" + "".join(lines))
            lines.append(line)
        return _reading("first-step 0\n" + "".join(lines), 0)

    def engines_again() -> tuple[float, float, list]:
        return _reading("first-step 0\n" + _capture(shell, magic + f"timed({steps})"), 0)

    try:
        served()  # the first loop of each: warm-up
        engines_again()
        pairs = {"engines": [], "torchrun": []}
        for i in range(n_pairs):
            for who in ("engines", "torchrun") if i % 2 == 0 else ("torchrun", "engines"):
                pairs[who].append(engines_again() if who == "engines" else served())
    finally:
        proc.stdin.write("stop\n")
        proc.stdin.close()
        proc.wait(60)
    load.append(os.getloadavg()[0])

    # 3. the same step without DDP, rank 0 alone: in its engine vs a fresh process
    compute = COMPUTE.replace("STEPS", str(steps * 5))
    head0 = magic.replace("--output rank0", "--targets 0 --output rank0")
    alone = {"engine": [], "process": []}
    for i in range(rounds):
        for where in ("engine", "process") if i % 2 == 0 else ("process", "engine"):
            if where == "engine":
                text = _capture(shell, head0 + compute)
            else:
                env = dict(os.environ, OMP_NUM_THREADS="1")
                text = subprocess.run(
                    [sys.executable, "-c", compute], capture_output=True, text=True, env=env, check=True
                ).stdout
            line = text.split("compute", 1)[1].split()
            alone[where].append((float(line[0]), float(line[1])))
    shell.run_line_magic("distributed", "shutdown")
    load.append(os.getloadavg()[0])

    print(f"\n{ranks} ranks, gloo on CPU, {os.cpu_count()} cores; load average (1 min) at each part's end:")
    print("  " + ", ".join(f"{x:.1f}" for x in load))
    per = max(1, repeats // blocks) * blocks
    for gated in (True, False):
        m, r, loud, cell = (statistics.median(times[gated, k]) for k in runs)
        label = "engines' flushes gated (gpuhub)" if gated else "engines' flushes as ipykernel's"
        print(
            f"trivial cell, {label}, median of {per}: %%distributed {m * 1e3:.2f} ms, "
            f"raw execute {r * 1e3:.2f} ms, ratio {m / r:.2f}x "
            f"(raw execute(silent=False) {loud * 1e3:.2f} ms, {loud / r:.2f}x; magic/that {m / loud:.2f}x)"
        )
        beside = zip(times[gated, "magic"], times[gated, "raw"], strict=True)
        lo, mid, hi = _interval([a / b for a, b in beside])
        print(f"  each cell / the raw execute beside it: geometric mean {mid:.3f}x, 95% {lo:.3f}..{hi:.3f}")
        beside = zip(times[gated, "magic"], times[gated, "raw, in a cell"], strict=True)
        lo, mid, hi = _interval([a / b for a, b in beside])
        print(
            f"  raw execute typed in a cell {cell * 1e3:.2f} ms: %%distributed / that {m / cell:.2f}x; "
            f"each cell / the one beside it: geometric mean {mid:.3f}x, 95% {lo:.3f}..{hi:.3f}"
        )
    mg, mu = (statistics.median(times[g, "magic"]) for g in (True, False))
    rg, ru = (statistics.median(times[g, "raw"]) for g in (True, False))
    print(f"  gated / ungated: %%distributed {mg / mu:.3f}x, raw execute {rg / ru:.3f}x")
    print(f"  %%distributed gated / raw execute on ungated engines (stock ipykernel): {mg / ru:.2f}x")

    w_rate, c_rate = (statistics.median(x[1] for x in runs_) for runs_ in (warm, cold))
    ratios = [a[1] / b[1] for a, b in zip(warm, cold, strict=True)]
    lo, mid, hi = _interval(ratios)
    print(
        f"DDP steps/s, median of {rounds} rounds of {steps} steps: %%distributed {w_rate:.1f}, "
        f"torchrun {c_rate:.1f}, ratio of medians {w_rate / c_rate:.2f}x"
    )
    print(
        f"  paired rounds: geometric mean {mid:.3f}x, 95% interval {lo:.3f}..{hi:.3f}; "
        f"range {min(ratios):.2f}..{max(ratios):.2f}; engines faster in "
        f"{sum(x > 1 for x in ratios)} of {rounds}"
    )
    for who in ("engines", "torchrun"):
        mine = [x for x, f in zip(ratios, first, strict=True) if f == who]
        if mine:
            listed = " ".join(f"{x:.2f}" for x in mine)
            print(f"  {who} first: {listed} (median {statistics.median(mine):.2f})")
    for name, runs_ in (("%%distributed", warm), ("torchrun", cold)):
        rates = sorted(x[1] for x in runs_)
        print(f"  {name}: rounds {rates[0]:.1f}..{rates[-1]:.1f} steps/s; per step, ranks summed, medians:")
        print("    " + _threads_line(runs_))
    w_rate, c_rate = (statistics.median(x[1] for x in pairs[k]) for k in ("engines", "torchrun"))
    ratios = [a[1] / b[1] for a, b in zip(pairs["engines"], pairs["torchrun"], strict=True)]
    lo, mid, hi = _interval(ratios)
    print(
        f"DDP steps/s, both warm (torchrun's workers kept up), {len(ratios)} pairs taking turns: "
        f"%%distributed {w_rate:.1f}, torchrun {c_rate:.1f}, ratio of medians {w_rate / c_rate:.3f}x"
    )
    print(
        f"  paired: geometric mean {mid:.3f}x, 95% interval {lo:.3f}..{hi:.3f}; median "
        f"{statistics.median(ratios):.3f}; range {min(ratios):.2f}..{max(ratios):.2f}; engines faster "
        f"in {sum(x > 1 for x in ratios)} of {len(ratios)}"
    )
    for j, who in enumerate(("engines", "torchrun")):
        mine = ratios[j::2]
        lo, mid, hi = _interval(mine)
        print(f"  {who} first: geometric mean {mid:.3f}x (95% {lo:.3f}..{hi:.3f}), {len(mine)} pairs")
    for name, key in (("%%distributed", "engines"), ("torchrun", "torchrun")):
        print(f"  {name}, per step, ranks summed, medians:")
        print("    " + _threads_line(pairs[key]))
    w_first, c_first = (statistics.median(x[0] for x in runs_) for runs_ in (warm, cold))
    e_rate, p_rate = (statistics.median(x[0] for x in alone[k]) for k in ("engine", "process"))
    e_cpu, p_cpu = (statistics.median(x[1] for x in alone[k]) for k in ("engine", "process"))
    lo, mid, hi = _interval([a[0] / b[0] for a, b in zip(alone["engine"], alone["process"], strict=True)])
    print(
        f"one rank, no DDP ({steps * 5} steps, the others idle), median of {rounds}: engine {e_rate:.0f} "
        f"steps/s ({e_cpu:.0f} us CPU/step), fresh process {p_rate:.0f} ({p_cpu:.0f} us), "
        f"paired {mid:.3f}x (95% {lo:.3f}..{hi:.3f})"
    )
    print(
        f"time to first step: warm engines {w_first:.2f} s, torchrun launch {c_first:.2f} s, "
        f"ratio {c_first / w_first:.1f}x faster warm"
    )


def _interval(ratios: list[float]) -> tuple[float, float, float]:
    """(low, geometric mean, high): a 95% t interval on the ratios' logs (paired rounds)."""
    import math

    logs = [math.log(x) for x in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), math.exp(mean), math.exp(mean)
    # two-sided 97.5% quantiles of Student's t for 1..30 degrees of freedom, then ~1.96
    t = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13]
    t += [2.12, 2.11, 2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04]
    q = t[len(logs) - 2] if len(logs) - 2 < len(t) else 1.96
    half = q * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean - half), math.exp(mean), math.exp(mean + half)


def _threads_line(runs_: list) -> str:
    """What every rank's threads did per step, summed over the ranks, median over the rounds."""
    kinds = ("training", "gloo-tcp", "gloo-work", "other")
    parts = []
    for kind in kinds:
        rows = [[sum(r[0].get(kind, [0] * 4)[j] for r in x[2]) for j in range(4)] for x in runs_]
        cpu, wait, switches, invol = (statistics.median(row[j] for row in rows) for j in range(4))
        parts.append(
            f"{kind} CPU {cpu / 1e3:.0f} us, waits {wait / 1e3:.0f} us, {switches:.0f} sw ({invol:.0f} inv)"
        )
    threads = statistics.median(sum(r[2] for r in x[2]) for x in runs_)
    gcs = statistics.median(sum(r[1] for r in x[2]) for x in runs_)
    return "; ".join(parts) + f"; {threads:.0f} threads, GC runs {gcs:.0f}"


def _reading(text: str, started: float) -> tuple[float, float, list]:
    """(seconds to the first step, steps/s, every rank's [threads' readings, GC runs, threads])
    from one run's output."""
    if "threads-json" not in text:
        raise ValueError(f"no readings in the output:\n{text}")
    every = json.loads(text.split("threads-json", 1)[1].split("\n", 1)[0])
    return _value(text, "first-step") - started, _value(text, "steps/s"), every


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
