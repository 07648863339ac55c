"""A test hub's start: plain ``jupyterhub`` against ``python -m spawner.hub``, side by side.

    .venv/bin/python benchmarks/hub_start.py [rounds]

Each round starts the demo's test hub (tests/hubtools.py: proxy, broker service, 4 simulated
GPUs) once with each command, in turns (who goes first alternates), and times it from the
process's start to the broker answering an authenticated request, then to the hub having
stopped. Prints the medians, the per-round ratios and the load (the machine is shared).
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests import hubtools


def one(kind: str) -> tuple[float, float]:
    workdir = Path(tempfile.mkdtemp(prefix="hub-start-"))
    # python= runs ``python -m jupyterhub`` (hubtools' way for an installed gpuhub)
    hub = hubtools.Hub(workdir, python=Path(sys.executable) if kind == "jupyterhub" else None)
    t0 = time.monotonic()
    hub.start().wait_for_broker()
    up = time.monotonic() - t0
    t1 = time.monotonic()
    hub.stop()
    return up, time.monotonic() - t1


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    kinds = ["jupyterhub", "spawner.hub"]
    ups: dict[str, list[float]] = {k: [] for k in kinds}
    print(f"load at start: {os.getloadavg()[0]:.1f}")
    for r in range(rounds):
        order = kinds if r % 2 == 0 else kinds[::-1]
        for k in order:
            up, down = one(k)
            ups[k].append(up)
            print(f"round {r + 1} {k:12s} up {up:5.1f} s, stop {down:4.1f} s, load {os.getloadavg()[0]:.1f}")
    ratios = [b / a for a, b in zip(ups["jupyterhub"], ups["spawner.hub"], strict=True)]
    for k in kinds:
        print(f"{k:12s} median up {statistics.median(ups[k]):5.1f} s")
    print(f"spawner.hub / jupyterhub per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
