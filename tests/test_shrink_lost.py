"""A rank's process lost between cells (SIGKILL): the pool shrinks in place without it, the other
ranks keeping their processes and variables, the DDP model training on at the smaller size; a
cell asking for the old size grows the pool back onto the GPU the lost rank left. Real kernel,
real ipyparallel engines, gloo on CPU, the server's own three (simulated) GPUs."""

from __future__ import annotations

import os
import re
import signal

import pytest

from .hubtools import wait_for
from .kerneltools import OwnKernel
from .test_checkpoint import _exited
from .test_grow import CHECK
from .test_grow import DEFINE as GROW_DEFINE

# test_grow's model, optimizer, functions and class, defined on 3 ranks
DEFINE = GROW_DEFINE.replace("--gpus 2", "--gpus 3").replace("defined on 2 ranks", "defined on 3 ranks")


@pytest.fixture
def kernel(tmp_path):
    k = OwnKernel(tmp_path, gpus="t:0,t:1,t:2")
    yield k
    k.close()


def test_a_rank_killed_between_cells_and_the_others_go_on_in_place(kernel):
    out = kernel.run(DEFINE)
    assert out["status"] == "ok", out["text"]
    status = kernel.run("%distributed status")["text"]
    pids = {int(r): int(p) for r, p in re.findall(r"rank (\d): GPU t:\d, pid (\d+)", status)}
    os.kill(pids[2], signal.SIGKILL)
    wait_for(lambda: _exited(pids[2]), 30, "rank 2's engine to die")

    out = kernel.run("%%distributed --gpus 3 --timeout 60\nstep()")
    text = out["text"]
    assert out["status"] == "error", text
    assert f"rank 2 (node t, GPU t:2, pid {pids[2]}) is gone" in text, text
    assert "Lost: the process of rank 2 and what only it held." in text
    assert "The pool shrank in place from 3 to 2 ranks: rank 2 (GPU t:2) left" in text
    assert "The world group was re-formed at 2 ranks and answered a collective on every rank." in text
    assert "checked equal on every rank: model." in text
    assert "GPU t:2 stays held by this session, unused by the pool: a cell with --gpus 3 adds a rank" in text
    assert "This cell did not run: run it again with --gpus 2." in text
    assert "fresh engines" not in text

    # the two go on, in the same processes, DDP averaging over 2 now
    gathered = kernel.result(CHECK.replace("--gpus 3", "--gpus 2"))
    assert [(r, w) for _, r, w, *_ in gathered] == [(0, 2), (1, 2)]
    assert [pid for pid, *_ in gathered] == [pids[0], pids[1]]
    assert len({tuple(now) for _, _, _, now, *_ in gathered}) == 1
    assert all(close for *_, close, _, _ in gathered), "the step left the 2-rank reference"

    # and grow back onto the GPU the lost rank left
    out = kernel.run(CHECK)
    assert out["status"] == "ok", out["text"]
    assert "the pool grew in place from 2 to 3 ranks: new rank 2 on GPU t:2;" in out["text"], out["text"]
    gathered = eval(out["result"])
    assert [pid for pid, *_ in gathered][:2] == [pids[0], pids[1]]
    assert all(close for *_, close, _, _ in gathered), "the step left the 3-rank reference"
    assert {says for *_, says in gathered} == {"defined on 3 ranks at step 4"}


SHARDED = """%%distributed --gpus 3 --timeout 60 --autosave fs fs_opt --dir {dir}
import hashlib, os
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
fs = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
fully_shard(fs, mesh=init_device_mesh("cpu", (world_size,)))
fs_opt = torch.optim.Adam(fs.parameters(), lr=0.01)
def train():
    X = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    fs_opt.zero_grad()
    fs(X).pow(2).mean().backward()
    fs_opt.step()
def digest():
    full = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
    return hashlib.sha256(full.numpy().tobytes()).hexdigest()
train()
print("digest", digest())
"""


def test_a_lost_rank_and_the_sharded_model_comes_back_from_its_checkpoint(kernel, tmp_path):
    d = tmp_path / "ck"
    out = kernel.run(SHARDED.format(dir=d))
    assert out["status"] == "ok", out["text"]
    [saved] = {line.split()[-1] for line in out["text"].splitlines() if "] digest" in line}
    out = kernel.run(f"%distributed save fs fs_opt --dir {d}")
    assert out["status"] == "ok", out["text"]
    out = kernel.run("%%distributed --gpus 3 --timeout 60\ntrain()")  # learned after the save: lost
    assert out["status"] == "ok", out["text"]
    status = kernel.run("%distributed status")["text"]
    pids = {int(r): int(p) for r, p in re.findall(r"rank (\d): GPU t:\d, pid (\d+)", status)}
    os.kill(pids[1], signal.SIGKILL)
    wait_for(lambda: _exited(pids[1]), 30, "rank 1's engine to die")

    out = kernel.run("%%distributed --gpus 3 --timeout 60\ntrain()")
    text = out["text"]
    assert "The pool shrank in place from 3 to 2 ranks: rank 1 (GPU t:1) left" in text, text
    assert f"Restored from the last checkpoint into 2 ranks from {d}:" in text, text
    assert "fs: " in text and "fs_opt: " in text and "resharded from 3 to 2 ranks" in text, text
    assert "What they learned after that checkpoint is lost." in text
    assert "Not resharded: fs" not in text
    out = kernel.run("%%distributed --gpus 2 --timeout 60\nprint('digest', digest(), os.getpid())\ntrain()")
    assert out["status"] == "ok", out["text"]
    lines = [line.split()[-2:] for line in out["text"].splitlines() if "] digest" in line]
    assert [digest for digest, _ in lines] == [saved, saved]  # the checkpoint's parameters, bit for bit
    assert sorted(int(pid) for _, pid in lines) == sorted([pids[0], pids[2]])  # the same processes
