"""%%distributed against the real alternatives, measured side by side in one run.

    .venv/bin/python benchmarks/distributed.py [ranks] [repeats]

1. A trivial cell on warm engines through %%distributed vs raw ipyparallel ``execute`` on the
   same engines (the magic's own overhead).
2. DDP steps/s inside %%distributed vs the same training script under ``torchrun``.
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
import os, time, torch, torch.distributed as dist, torch.nn as nn
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
step()  # the first step
if rank == 0:
    print("first-step", time.time(), flush=True)
t = time.perf_counter()
for _ in range(STEPS):
    step()
dist.barrier()
if rank == 0:
    print("steps/s", STEPS / (time.perf_counter() - t), flush=True)
"""


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    steps = 100
    shell, magic = magic_shell(ranks)
    assert shell.run_cell(magic + "1").success  # start the pool
    magics = shell.magics_manager.registry["DistributedMagics"]
    view = magics.pool.view

    # 1. trivial cell: the magic vs raw ipyparallel on the same engines
    t_magic, t_raw = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        shell.run_cell(magic + "1", silent=True)
        t_magic.append(time.perf_counter() - t)
        t = time.perf_counter()
        view.execute("1", block=True)
        t_raw.append(time.perf_counter() - t)

    # 2 and 3: the training script, warm in the engines vs torchrun
    code = TRAIN.replace("STEPS", str(steps))
    out = _capture(shell, magic + code)  # warm-up: imports, first optimizer
    t = time.time()
    out = _capture(shell, magic + code)
    warm_first = _value(out, "first-step") - t
    warm_rate = _value(out, "steps/s")
    script = Path(tempfile.mkdtemp(prefix="gpuhub-bench-")) / "train.py"
    script.write_text(code)
    torchrun = Path(sys.executable).with_name("torchrun")
    t = time.time()
    proc = subprocess.run(
        [str(torchrun), "--standalone", f"--nproc_per_node={ranks}", str(script)],
        capture_output=True,
        text=True,
        check=True,
    )
    cold_first = _value(proc.stdout, "first-step") - t
    cold_rate = _value(proc.stdout, "steps/s")
    shell.run_line_magic("distributed", "shutdown")

    m, r = statistics.median(t_magic), statistics.median(t_raw)
    print(f"\n{ranks} ranks, gloo on CPU, {os.cpu_count()} cores")
    print(
        f"trivial cell, median of {repeats}: %%distributed {m * 1e3:.1f} ms, "
        f"raw ipyparallel execute {r * 1e3:.1f} ms, ratio {m / r:.2f}x"
    )
    print(
        f"DDP steps/s: %%distributed {warm_rate:.1f}, torchrun {cold_rate:.1f}, "
        f"ratio {warm_rate / cold_rate:.2f}x"
    )
    print(
        f"time to first step: warm engines {warm_first:.2f} s, torchrun launch {cold_first:.2f} s, "
        f"ratio {cold_first / warm_first:.1f}x faster warm"
    )


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
