"""A soak with faults, long: N users on a real hub for M minutes, faults all along.

    PATH=node_modules/.bin:$PATH .venv/bin/python benchmarks/soak.py \\
        [users=40] [gpus=8] [minutes=30] [sqlite|postgresql]

The same run as ``tests/test_soak.py`` (``tests/soaktools.py``: what the users do, which faults,
what is checked), longer and larger: the fault schedule (broker, server kill, proxy, server
pause, hub restart, database) is run once per 5 minutes. On PostgreSQL the ledger is a fresh
schema of the test server (``scripts/postgres start``; ``GPUHUB_TEST_POSTGRES_URL``).

Prints what the users did (answers by status, allocations, waits, preemptions, reclaims), each
fault and how long its service was down, and every problem found (the goal: none). It measures
what was lost, not speed: there is no other system here to compare with.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy.engine import make_url

from tests.dbtools import ledger_database
from tests.hubtools import Hub
from tests.soaktools import FAULTS, Soak, config


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    gpus = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    minutes = float(sys.argv[3]) if len(sys.argv) > 3 else 30.0
    backend = sys.argv[4] if len(sys.argv) > 4 else "sqlite"
    users = [f"u{i:03d}" for i in range(n)]
    lab, target = [*users[: n // 2], "r000"], users[-1]
    schedule = FAULTS * max(1, math.ceil(minutes / 5))
    with tempfile.TemporaryDirectory() as d, ledger_database(backend, Path(d)) as url:
        hub = Hub(Path(d) / "hub", extra_config=config(gpus, lab, target), ledger_url=url).start(timeout=180)
        soak = Soak(hub, users, lab, target, minutes * 60, seed=35, schedule=schedule, researcher="r000")
        if backend == "postgresql":
            soak.database = make_url(url).query.get("application_name", "")
        t = time.perf_counter()
        try:
            hub.wait_for_broker(120)
            for user in users:
                hub.ensure_user(user)
            soak.run()
        finally:
            soak.shutdown()
        took = time.perf_counter() - t
        figures = soak.figures()
        problems = soak.problems()
    print(f"{n} users, {gpus} simulated GPUs, {minutes:g} min on {backend} (ran {took / 60:.1f} min):")
    for key, value in figures.items():
        if key != "faults":
            print(f"  {key}: {value}")
    print(f"  faults ({len(figures['faults'])}):")
    for line in figures["faults"]:
        print(f"    {line}")
    print(f"  problems: {len(problems)}")
    for p in problems[:50]:
        print(f"    {p}")


if __name__ == "__main__":
    main()
