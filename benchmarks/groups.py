"""What gpuhub's reconfigurable process groups cost, against plain gloo groups, in one run.

    .venv/bin/python benchmarks/groups.py [ranks] [repeats]

On ``ranks`` processes (torch.multiprocessing, gloo on CPU, a private FileStore):

- **collective**: one small ``all_reduce`` (and one 1 MiB ``all_reduce``) on a gpuhub group
  (``engine.groups``: a Python ``ProcessGroup`` that hands the call to a gloo group inside it)
  against the same call on a plain gloo group;
- **recovery**: reconnecting the world group and one subgroup in place (what a stuck collective
  costs now: the objects stay) against destroying every group and initialising a new world
  group and subgroup (what it cost before, and every holder of the old groups was lost).

Prints medians and their ratios.
"""

import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from gpu_magics.engine import groups

TIMEOUT = timedelta(seconds=60)


def timed_collectives(group, tensor, calls: int) -> float:
    dist.barrier(group=group)
    t = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(tensor, group=group)
    return (time.perf_counter() - t) / calls


def run(rank: int, world: int, d: str, repeats: int, out) -> None:
    torch.set_num_threads(1)
    groups.register("gloo")
    dist.init_process_group(
        "gpuhub",
        store=dist.FileStore(os.path.join(d, "w"), world),
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    wrapped_sub = dist.new_group(list(range(world)))
    plain = dist.new_group(list(range(world)), backend="gloo")
    small, large = torch.ones(8), torch.ones(256 * 1024)
    res = {"small": ([], []), "large": ([], []), "recover": ([], [])}
    for _ in range(repeats):
        res["small"][0].append(timed_collectives(wrapped_sub, small, 200))
        res["small"][1].append(timed_collectives(plain, small, 200))
        res["large"][0].append(timed_collectives(wrapped_sub, large, 20))
        res["large"][1].append(timed_collectives(plain, large, 20))
    for i in range(repeats):
        # in place: the same objects, new connections
        dist.barrier()
        t = time.perf_counter()
        root = dist.FileStore(os.path.join(d, f"r{i}"), world)
        for g in groups.live_groups():
            g.reconfigure(root, i + 1)
        dist.barrier()
        res["recover"][0].append(time.perf_counter() - t)
    for i in range(repeats):
        # before: every group destroyed, a new world group and subgroup made
        dist.barrier()
        t = time.perf_counter()
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(os.path.join(d, f"n{i}"), world),
            rank=rank,
            world_size=world,
            timeout=TIMEOUT,
        )
        dist.new_group(list(range(world)))
        dist.barrier()
        res["recover"][1].append(time.perf_counter() - t)
    if rank == 0:
        out.put({k: (statistics.median(a), statistics.median(b)) for k, (a, b) in res.items()})
    dist.destroy_process_group()


def main() -> None:
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o700)
        mp.start_processes(run, args=(world, d, repeats, out), nprocs=world, start_method="spawn")
        r = out.get(timeout=10)
    print(f"{world} ranks, gloo on CPU, medians of {repeats}")
    for key, what in (
        ("small", "all_reduce of 8 floats"),
        ("large", "all_reduce of 1 MiB"),
        ("recover", "recovery: reconnect in place vs destroy + init"),
    ):
        gpuhub, plain = r[key]
        print(
            f"{what:48s} gpuhub {gpuhub * 1e3:8.3f} ms   plain {plain * 1e3:8.3f} ms   "
            f"ratio {gpuhub / plain:5.2f}"
        )


if __name__ == "__main__":
    main()
