"""What an admission costs: gpuhub's Ledger.allocate + release against a bare SQLite booking.

    .venv/bin/python benchmarks/ledger_admission.py [cycles]

Both sides do a multi-process-safe write on the same kind of file (WAL, synchronous=NORMAL,
BEGIN IMMEDIATE). The baseline books one GPU row with no policy, no limits and no history;
gpuhub adds the limit check, placement, and the allocation record. Prints the ratio.
"""

import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from spawner.ledger import Ledger
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu


def bench_gpuhub(path: Path, cycles: int) -> list[float]:
    ledger = Ledger(f"sqlite:///{path}", config_rules=LimitRules(default=Limit(max_gpus=8)))
    ledger.sync_inventory([Gpu(f"n{n}", i, "A100") for n in range(4) for i in range(8)])
    times = []
    for k in range(cycles):
        t = time.perf_counter()
        a = ledger.allocate(f"user{k % 5}", [], 2)
        ledger.release(a.id)
        times.append(time.perf_counter() - t)
    ledger.close()
    return times


def bench_bare_sqlite(path: Path, cycles: int) -> list[float]:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # as the ledger's default (c.GpuHub.sqlite_synchronous)
    conn.execute("CREATE TABLE held (gpu INTEGER PRIMARY KEY, user TEXT)")
    times = []
    for k in range(cycles):
        t = time.perf_counter()
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("INSERT INTO held VALUES (?, ?)", (k % 32, f"user{k % 5}"))
        conn.execute("COMMIT")
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM held WHERE gpu = ?", (k % 32,))
        conn.execute("COMMIT")
        times.append(time.perf_counter() - t)
    conn.close()
    return times


def main() -> None:
    cycles = int(sys.argv[1]) if len(sys.argv) > 1 else 300
    with tempfile.TemporaryDirectory() as d:
        ours = bench_gpuhub(Path(d) / "ledger.sqlite", cycles)
        bare = bench_bare_sqlite(Path(d) / "bare.sqlite", cycles)
    m_ours, m_bare = statistics.median(ours), statistics.median(bare)
    print(f"allocate+release, median of {cycles} cycles (32 GPUs, 5 users):")
    print(f"  gpuhub ledger     {m_ours * 1e3:8.2f} ms  ({1 / m_ours:7.0f} cycles/s)")
    print(f"  bare SQLite rows  {m_bare * 1e3:8.2f} ms  ({1 / m_bare:7.0f} cycles/s)")
    print(f"  ratio gpuhub / bare: {m_ours / m_bare:.1f}x")


if __name__ == "__main__":
    main()
