"""From Ctrl-C to the next training cell's first step, against rebuilding the pool, in one run.

    .venv/bin/python benchmarks/interrupt.py [ranks] [repeats]

Both sides interrupt the same training loop on warm engines (SIGINT to this process while the
cell runs, as the kernel gets it from the stop button); then

- **kept** (gpuhub now): the next cell takes one more step on the same model, in the same
  processes;
- **rebuilt** (what an interrupt cost before: the pool was rebuilt and the variables lost): the
  pool is stopped, and the next cell starts fresh engines, defines the model again and takes its
  first step.

Runs in an IPython shell in this process, on the CPU (gloo), with simulated server GPUs (no hub
needed). Prints medians and their ratio.
"""

import signal
import statistics
import sys
import threading
import time

from notebook_shell import magic_shell

DEFINE = """
import time, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
X, y = torch.randn(128, 64), torch.randn(128, 1)
def step():
    opt.zero_grad(); ((model(X) - y) ** 2).mean().backward(); opt.step()
"""
LOOP = "for _ in range(10**6):\n    step()\n"
FIRST = "step()\nif rank == 0:\n    print('first-step', time.time(), flush=True)\n"


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    shell, magic = magic_shell(ranks)
    assert shell.run_cell(magic + DEFINE).success

    def interrupted_loop() -> float:
        """Run the loop, Ctrl-C it after a second; when the Ctrl-C came."""
        at = []

        def ctrl_c():
            at.append(time.time())
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

        timer = threading.Timer(1.0, ctrl_c)
        timer.start()
        shell.run_cell(magic + LOOP, silent=True)
        timer.join()
        return at[0]

    kept, rebuilt = [], []
    for _ in range(repeats):
        t0 = interrupted_loop()
        kept.append(_first_step(shell, magic + FIRST) - t0)
        t0 = interrupted_loop()
        shell.run_line_magic("distributed", "shutdown")
        rebuilt.append(_first_step(shell, magic + DEFINE + FIRST) - t0)
    shell.run_line_magic("distributed", "shutdown")
    k, r = statistics.median(kept), statistics.median(rebuilt)
    print(f"ranks {ranks}, {repeats} repeats (medians)")
    print(f"Ctrl-C to the next cell's first step, state kept : {k:.2f} s")
    print(f"Ctrl-C to the first step after a rebuild         : {r:.2f} s")
    print(f"ratio rebuilt / kept                             : {r / k:.1f}x")


def _first_step(shell, cell: str) -> float:
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        assert shell.run_cell(cell).success
    line = next(x for x in cap.stdout.splitlines() if "first-step" in x)
    return float(line.split()[-1])


if __name__ == "__main__":
    main()
