"""What a slice's admission costs (issue 34), against a whole GPU's in the same run.

    .venv/bin/python benchmarks/slice_admission.py [cycles] [rounds]

A SQLite ledger of 4 nodes x 8 A100s, each A100 splittable in 4 (``c.GpuHub.gpu_slices``).
Each cycle is ``Ledger.allocate`` + ``release`` of:

1. one whole GPU, on an empty cluster (the baseline);
2. one quarter of a GPU, on an empty cluster;
3. one quarter where 31 GPUs already have 3 of their 4 quarters held by others (a full
   teaching session): a slice is placed from every GPU of its model's uses;
4. one whole GPU on that same busy cluster (the free GPUs exclude every split one).

Rounds take turns over the four ways; prints the medians of the rounds' per-cycle means and
each way's ratio against the whole GPU on the empty cluster.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spawner.ledger import Ledger
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu
from spawner.policy.slices import check_gpu_slices

INVENTORY = [Gpu(f"n{n}", i, "A100", 40960) for n in range(4) for i in range(8)]
OFFERS = check_gpu_slices({"A100": 4}, INVENTORY)
QUARTER = {"model": "A100", "slice_parts": 4}


def ledger_at(path: Path, busy: bool) -> Ledger:
    ledger = Ledger(
        f"sqlite:///{path}", config_rules=LimitRules(default=Limit(max_gpus=None)), slice_offers=OFFERS
    )
    ledger.sync_inventory(INVENTORY)
    if busy:  # 31 GPUs with 3 quarters held each, by 93 students; one GPU left whole and free
        for k in range(31 * 3):
            ledger.allocate(f"student{k}", [], 1, server_name="busy", **QUARTER)
    return ledger


def cycle_time(ledger: Ledger, cycles: int, **kw) -> float:
    t = time.perf_counter()
    for k in range(cycles):
        a = ledger.allocate(f"user{k % 5}", [], 1, **kw)
        ledger.release(a.id)
    return (time.perf_counter() - t) / cycles


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    with tempfile.TemporaryDirectory() as d:
        empty, busy = ledger_at(Path(d) / "empty.sqlite", False), ledger_at(Path(d) / "busy.sqlite", True)
        ways = {
            "whole GPU, empty cluster": (empty, {}),
            "quarter, empty cluster": (empty, QUARTER),
            "quarter, 31 GPUs 3/4 held": (busy, QUARTER),
            "whole GPU, 31 GPUs 3/4 held": (busy, {}),
        }
        got: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(rounds):
            for name, (ledger, kw) in ways.items():
                got[name].append(cycle_time(ledger, cycles, **kw))
        empty.close()
        busy.close()
    base = statistics.median(got["whole GPU, empty cluster"])
    print(f"allocate + release, median of {rounds} rounds of {cycles} cycles (SQLite, 32 A100s in quarters)")
    for name, times in got.items():
        m = statistics.median(times)
        print(f"  {name:<30} {m * 1e3:7.2f} ms   {m / base:5.2f}x the whole GPU on an empty cluster")


if __name__ == "__main__":
    main()
