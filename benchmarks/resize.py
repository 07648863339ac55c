"""A pool that changes size in place, against stopping it and starting another, in one run.

    .venv/bin/python benchmarks/resize.py [repeats]

On 4 simulated server GPUs (no hub: an IPython shell in this process, gloo on CPU), a DDP model
with SGD and momentum:

- **shrink 4 -> 3**, from the moment a preemption is acted on to the next training step:
  in place (``kernel.resize.shrink``, what a preemption of one borrowed GPU now does) against
  what it did before: ``--autosave`` of the model and optimizer, the pool stopped, a 3-rank
  pool started, the defining cell run again, ``%distributed restore``, the step;
- **grow 2 -> 4**, from the cell that asks for 4 GPUs to its training step: in place against
  ``%distributed save``, ``--restart`` on 4, the defining cell, ``restore``, the step.

Prints medians and their ratios.
"""

import os
import statistics
import sys
import tempfile
import time

from notebook_shell import magic_shell

DEFINE = """
import time, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
X, y = torch.randn(128, 64), torch.randn(128, 1)
def step():
    opt.zero_grad(); ((model(X) - y) ** 2).mean().backward(); opt.step()
step()
"""
STEP = "step()\n"


def cell(shell, line: str, code: str) -> None:
    from IPython.utils.capture import capture_output

    with capture_output():
        result = shell.run_cell(f"%%distributed {line}\n{code}")
    assert result.success, result.error_in_exec


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    shell, _ = magic_shell(4)
    magics = shell.magics_manager.registry["DistributedMagics"]
    ckpt = tempfile.mkdtemp(prefix="gpuhub-bench-ckpt-")
    os.chmod(ckpt, 0o700)
    res = {"shrink": ([], []), "grow": ([], [])}
    for _ in range(repeats):
        # shrink in place
        cell(shell, "--gpus 4", DEFINE)
        from gpu_magics.kernel import resize

        t = time.perf_counter()
        life = magics.lifecycle
        resize.shrink(life.pool, [3])
        (_, nodes, per_node), backend, timeout = life.key
        life.key = ((3, nodes, per_node), backend, timeout)
        cell(shell, "--gpus 3", STEP)
        res["shrink"][0].append(time.perf_counter() - t)
        shell.run_line_magic("distributed", "shutdown")
        # before: autosave, stop, new pool, define again, restore
        cell(shell, f"--gpus 4 --autosave model opt --dir {ckpt}", DEFINE)
        t = time.perf_counter()
        shell.run_line_magic("distributed", "shutdown")  # saves the autosave names first
        cell(shell, "--gpus 3", DEFINE)
        shell.run_line_magic("distributed", f"restore model opt --dir {ckpt}")
        cell(shell, "--gpus 3", STEP)
        res["shrink"][1].append(time.perf_counter() - t)
        shell.run_line_magic("distributed", "shutdown")

        # grow in place
        cell(shell, "--gpus 2", DEFINE)
        t = time.perf_counter()
        cell(shell, "--gpus 4", STEP)
        res["grow"][0].append(time.perf_counter() - t)
        shell.run_line_magic("distributed", "shutdown")
        # before: save, --restart, define again, restore
        cell(shell, "--gpus 2", DEFINE)
        t = time.perf_counter()
        shell.run_line_magic("distributed", f"save model opt --dir {ckpt}")
        cell(shell, "--gpus 4 --restart", DEFINE)
        shell.run_line_magic("distributed", f"restore model opt --dir {ckpt}")
        cell(shell, "--gpus 4", STEP)
        res["grow"][1].append(time.perf_counter() - t)
        shell.run_line_magic("distributed", "shutdown")
    print(f"DDP model, gloo on CPU, medians of {repeats}")
    for key, what in (("shrink", "shrink 4 -> 3, to the next step"), ("grow", "grow 2 -> 4, to the step")):
        inplace, before = (statistics.median(v) for v in res[key])
        print(
            f"{what:34s} in place {inplace:6.2f} s   stop and restore {before:6.2f} s   "
            f"ratio {before / inplace:5.1f}x"
        )


if __name__ == "__main__":
    main()
