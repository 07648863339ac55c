"""What the broker's idle pass costs: one Reclaimer.check over many live GPU allocations,
against the bare ledger read it starts with (Ledger.active).

    .venv/bin/python benchmarks/idle_check.py [allocations] [rounds]

Each allocation holds one GPU that has reported (so every one is judged). The pass adds the
per-allocation freshness check and the pure ``judge`` to the read. Prints the ratio; with the
default c.GpuReclaim.check_seconds (30 s) the pass is a small share of the broker's time.
"""

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spawner.broker.reclaimer import Reclaimer
from spawner.broker.utilization import Sample, Utilization
from spawner.ledger import Ledger
from spawner.policy.idle import IdleRules
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu


class Broker:
    def __init__(self, ledger):
        self.ledger, self.utilization = ledger, Utilization()

    async def run(self, fn, *args, **kw):
        return fn(*args, **kw)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    rules = IdleRules()
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger(f"sqlite:///{d}/l.sqlite", config_rules=LimitRules(default=Limit(None)))
        ledger.sync_inventory([Gpu(f"n{k // 8}", k % 8, "A100") for k in range(n)])
        broker = Broker(ledger)
        for k in range(n):
            a = ledger.allocate(f"user{k}", [], 1, purpose="distributed", lease_seconds=3600)
            g = a.gpus[0]
            broker.utilization.add_samples(a, [Sample(g.node, g.index, 50.0, 0, None)], 5, 180)
        reclaimer = Reclaimer(broker, rules)
        ours, bare = [], []
        for _ in range(rounds):  # interleaved, so both see the same machine load
            t = time.perf_counter()
            asyncio.run(reclaimer.check())
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            asyncio.run(broker.run(ledger.active))
            bare.append(time.perf_counter() - t)
        assert len(broker.utilization.verdicts) == n  # every allocation was judged
        ledger.close()
    m_ours, m_bare = statistics.median(ours), statistics.median(bare)
    print(f"one idle pass over {n} live allocations, median of {rounds}:")
    print(f"  Reclaimer.check      {m_ours * 1e3:8.2f} ms")
    print(f"  bare Ledger.active   {m_bare * 1e3:8.2f} ms")
    print(f"  ratio pass / read: {m_ours / m_bare:.2f}x")


if __name__ == "__main__":
    main()
