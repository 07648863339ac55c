"""The process group's rendezvous (`gpu_magics.engine.rendezvous.open_rendezvous`), both kinds, with real
torch.distributed (gloo) in separate processes: a private FileStore for ranks on one node, and a
TCPStore that picks its own port (which becomes MASTER_PORT) for ranks on several."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import stat
from datetime import timedelta

import pytest

from gpu_magics.engine.rendezvous import group_store, open_rendezvous


def _file_rank(rank: int, world: int, rendezvous: dict, out) -> None:
    import torch
    import torch.distributed as dist

    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    dist.init_process_group("gloo", store=group_store(rendezvous, env, 30), rank=rank, world_size=world)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    out.put((rank, x.item()))
    dist.destroy_process_group()


def _tcp_rank(rank: int, world: int, ports, out) -> None:
    import torch
    import torch.distributed as dist

    if rank == 0:
        rendezvous = open_rendezvous("tcp", world, 30)
        for _ in range(world - 1):
            ports.put(rendezvous)  # as the kernel passes it on: through ipyparallel's signed messages
    else:
        rendezvous = ports.get(timeout=60)
    env = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1"}
    dist.init_process_group("gloo", store=group_store(rendezvous, env, 30), rank=rank, world_size=world)
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    seen = None
    if rank == 0:
        # a plain connection to the port (what any account on the network can open) finds
        # none of the group's keys by their names; through the secret prefix, all of them
        port = rendezvous["port"]
        raw = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=5))
        keys = [f"0//cpu//0/{r}" for r in range(world)]  # gloo's addresses of the ranks (torch 2.13)
        prefixed = dist.PrefixStore(f"gpuhub-{rendezvous['secret']}", raw)
        seen = (raw.check(keys), prefixed.check(keys), raw.num_keys() > 0)
    out.put((rank, x.item(), rendezvous["port"], seen))
    dist.barrier()
    dist.destroy_process_group()


def _run(target, *args, world: int = 3) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(world)]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return sorted(results)


def test_ranks_on_one_node_meet_in_a_private_file_store():
    rendezvous = open_rendezvous("file", 3, 30)
    directory = os.path.dirname(rendezvous["path"])
    try:
        st = os.stat(directory)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid()
        assert _run(_file_rank, rendezvous) == [(0, 6.0), (1, 6.0), (2, 6.0)]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_on_several_nodes_meet_in_a_tcp_store_that_chose_its_port(world):
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    results = _run(_tcp_rank, ports, world=world)
    total = float(sum(range(1, world + 1)))
    assert [(r, v) for r, v, _, _ in results] == [(r, total) for r in range(world)]
    [port] = {p for _, _, p, _ in results}
    assert 1024 <= port < 65536  # the store's own port, the same for every rank
    assert results[0][3] == (False, True, True)  # the keys exist, but only under the secret prefix
