"""Save and restore of a sharded (FSDP2) model and its Adam state on real engines: gpuhub's
``%distributed save|restore`` (every rank writes and reads its own shards through
``torch.distributed.checkpoint``, durably: a temporary directory, fsynced files, one rename)
against the full state gathered to rank 0 and ``torch.save``d there (fsynced too), and read
back by ``torch.load`` of that file on every rank and ``set_*_state_dict(full_state_dict=True)``
(each rank keeps its shard): what a notebook did before sharded checkpoints. (Not
``broadcast_from_rank0=True``: torch's broadcast asks the world group for its device types,
which gpuhub's reconfigurable group does not list yet: an IndexError.)

    .venv/bin/python benchmarks/checkpoint_sharded.py [ranks] [rounds] [widths...]

Each width is an MLP of four ``Linear(width, width)`` layers, each sharded by ``fully_shard``
(parameters and Adam's two moments: 12 * width**2 * 4 bytes of state). The ways take turns,
each going first in every other round; the medians and their ratios are printed, measured in
this one run.
"""

import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from notebook_shell import magic_shell

DEFINE = """
import os
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)
torch.manual_seed(0)
m = nn.Sequential(*[nn.Linear({width}, {width}) for _ in range(4)])
mesh = init_device_mesh("cpu", (world_size,))
for layer in m:
    fully_shard(layer, mesh=mesh)
fully_shard(m, mesh=mesh)
opt = torch.optim.Adam(m.parameters(), lr=1e-3)
m(torch.randn(8, {width})).sum().backward()
opt.step()
"""

FULL_SAVE = """
full = StateDictOptions(full_state_dict=True, cpu_offload=True)
state = {{"model": get_model_state_dict(m, options=full),
          "opt": get_optimizer_state_dict(m, opt, options=full)}}
if rank == 0:
    with open("{path}", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
del state
dist.barrier()
"""

FULL_LOAD = """
state = torch.load("{path}", weights_only=True)
opts = StateDictOptions(full_state_dict=True)
set_model_state_dict(m, state["model"], options=opts)
set_optimizer_state_dict(m, opt, state["opt"], options=opts)
del state
dist.barrier()
"""


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(shell, cell: str) -> None:
    result = shell.run_cell(cell)
    assert result.success, result.error_in_exec or result.error_before_exec


def measure(shell, magic: str, width: int, rounds: int, where: Path) -> dict[str, list[float]]:
    run(shell, magic + DEFINE.format(width=width))
    d, path = where / f"dcp-{width}", where / f"full-{width}.pt"
    times: dict[str, list[float]] = {k: [] for k in ("dcp save", "full save", "dcp restore", "full restore")}

    def dcp_save():
        shell.run_line_magic("distributed", f"save m opt --dir {d}")

    def full_save():
        run(shell, magic + FULL_SAVE.format(path=path))

    def dcp_restore():
        shell.run_line_magic("distributed", f"restore m opt --dir {d}")

    def full_restore():
        run(shell, magic + FULL_LOAD.format(path=path))

    for i in range(rounds):
        saves = [("dcp save", dcp_save), ("full save", full_save)]
        loads = [("dcp restore", dcp_restore), ("full restore", full_restore)]
        if i % 2:
            saves.reverse()
            loads.reverse()
        for name, fn in saves + loads:
            times[name].append(timed(fn))
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    print(
        f"\nwidth {width}: {4 * width * width * 4 * 3 / 2**20:.0f} MiB of state, "
        f"DCP files {size / 2**20:.1f} MiB"
    )
    return times


def main() -> None:
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    widths = [int(w) for w in sys.argv[3:]] or [512, 2048]
    shell, magic = magic_shell(ranks)
    magic = magic.replace("--output rank0", "--output rank0 --timeout 600")
    where = Path(tempfile.mkdtemp(prefix="gpuhub-ckpt-bench-"))
    try:
        results = {w: measure(shell, magic, w, rounds, where) for w in widths}
    finally:
        shell.run_line_magic("distributed", "shutdown")
        shutil.rmtree(where, ignore_errors=True)
    print(f"\nFSDP2 checkpoint of {ranks} ranks, median of {rounds} rounds each (s):")
    for w, times in results.items():
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"  width {w}:")
        for k, v in times.items():
            print(f"    {k:<13} {med[k]:7.3f}  {[round(x, 3) for x in v]}")
        print(
            f"    save: DCP {med['dcp save'] / med['full save']:.2f}x of torch.save from rank 0; "
            f"restore: DCP {med['dcp restore'] / med['full restore']:.2f}x of torch.load of the full file"
        )


if __name__ == "__main__":
    main()
