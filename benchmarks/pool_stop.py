"""``%distributed shutdown`` of a warm pool: the engines asked to shut down first (a shutdown
request on each engine's control channel, as Jupyter asks a kernel) against the launcher's
signals alone (SIGTERM, then a wait for the processes), the way gpuhub stopped them before.

    .venv/bin/python benchmarks/pool_stop.py [ranks] [rounds]

Each round starts a pool, runs a cell, and stops it one way; the ways take turns, each going
first in every other round. Prints the medians and their ratio.
"""

import statistics
import sys
import time

from notebook_shell import magic_shell


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    shell, magic = magic_shell(ranks)
    from gpu_magics.kernel.pool import EnginePool

    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(rounds):
        for ask in (True, False) if i % 2 == 0 else (False, True):
            assert shell.run_cell(magic + "1").success
            EnginePool.ask_engines_first = ask
            t = time.perf_counter()
            shell.run_line_magic("distributed", "shutdown")
            times[ask].append(time.perf_counter() - t)
    EnginePool.ask_engines_first = True
    asked, signalled = statistics.median(times[True]), statistics.median(times[False])
    print(f"\n%distributed shutdown, {ranks} ranks, median of {rounds} each:")
    print(f"  engines asked to shut down first: {asked:.2f} s  {[round(x, 2) for x in times[True]]}")
    print(f"  the launcher's signals alone:     {signalled:.2f} s  {[round(x, 2) for x in times[False]]}")
    print(f"  ratio: {asked / signalled:.2f}x")


if __name__ == "__main__":
    main()
