"""A pool's channels: a trivial ``%%distributed`` cell on warm engines whose controller listens on
Unix sockets with CurveZMQ (gpuhub since issue 27) against loopback TCP without Curve (before),
the same magic otherwise.

    .venv/bin/python benchmarks/channels.py [ranks] [cells] [rounds]

Each round starts a pool one way, runs ``cells`` trivial cells (``1``) after a warm-up, and stops
it; the ways take turns, each going first in every other round. Prints each way's median cell
and the ratio of the medians, with the rounds' paired ratios.
"""

import statistics
import sys
import time

from notebook_shell import magic_shell


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    cells = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 6
    shell, magic = magic_shell(ranks)
    from gpu_magics.launch.local import LocalLauncher

    times: dict[bool, list[float]] = {True: [], False: []}
    paired = []
    for i in range(rounds):
        medians = {}
        for private in (True, False) if i % 2 == 0 else (False, True):
            LocalLauncher.private_channels = private
            for _ in range(20):  # start the pool and warm it
                assert shell.run_cell(magic + "1").success
            mine = []
            for _ in range(cells):
                t = time.perf_counter()
                shell.run_cell(magic + "1")
                mine.append(time.perf_counter() - t)
            shell.run_line_magic("distributed", "shutdown")
            times[private] += mine
            medians[private] = statistics.median(mine)
        paired.append(medians[True] / medians[False])
    LocalLauncher.private_channels = True
    new, old = statistics.median(times[True]), statistics.median(times[False])
    print(f"\ntrivial %%distributed cell, {ranks} ranks, {rounds} rounds of {cells} cells each way:")
    print(f"  Unix sockets + CurveZMQ: {new * 1000:.2f} ms")
    print(f"  loopback TCP, no Curve:  {old * 1000:.2f} ms")
    print(f"  ratio {new / old:.3f}x; per round {[round(r, 3) for r in paired]}")


if __name__ == "__main__":
    main()
