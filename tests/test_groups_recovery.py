"""Every holder of a process group survives a recovery: after an interrupt that leaves a rank
in a collective its peers never reach, the same group objects are reconnected in place, so an
FSDP2 model (``fully_shard``, its ``DeviceMesh`` and ``DTensor`` parameters) with Adam, a DDP
model and a ``dist.new_group`` subgroup all train in the next cell, in the same processes, and
agree with a one-process reference trained on the same batches. Real kernel, real ipyparallel
engines, gloo on CPU."""

from __future__ import annotations

import pytest

from .cells import BATCH
from .kerneltools import OwnKernel

N = 2

DEFINE = (
    """%%distributed --gpus 2 --timeout 120
import copy, os, time
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

torch.manual_seed(0)
def net():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
plain = net()  # the reference: one process, every rank's batch
ref_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
fs = copy.deepcopy(plain)
mesh = init_device_mesh("cpu", (world_size,))
for layer in fs:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(fs, mesh=mesh)
fs_opt = torch.optim.Adam(fs.parameters(), lr=0.01)
ddp = DDP(copy.deepcopy(plain))
ddp_opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
sub = dist.new_group([0, 1])
{extra}
"""
    + BATCH
    + """steps = 0
def step():
    global steps
    X, y = batch(rank, steps)
    for m, o in ((fs, fs_opt), (ddp, ddp_opt)):
        o.zero_grad()
        ((m(X) - y) ** 2).mean().backward()
        o.step()
    ref_opt.zero_grad()
    losses = [((plain(Xr) - yr) ** 2).mean() for Xr, yr in (batch(r, steps) for r in range(world_size))]
    (sum(losses) / world_size).backward()
    ref_opt.step()
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    assert t.item() == 2
    steps += 1
step()
print("defined")
"""
)

CHECK = """%%distributed --gpus 2 --timeout 120
before = steps
step()
full = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
replica = torch.cat([p.detach().flatten() for p in ddp.parameters()])
ref = torch.cat([p.detach().flatten() for p in plain.parameters()])
gathered = [None] * world_size
dist.all_gather_object(gathered, (os.getpid(), full.tolist(), replica.tolist(), steps - before))
[bool(torch.allclose(full, ref, atol=1e-6) and torch.allclose(replica, ref, atol=1e-6)), gathered]
"""

STUCK = """%%distributed --gpus 2 --timeout 120
print("waiting")
if rank == 1:
    time.sleep(600)
t = torch.ones(1)
dist.all_reduce(t, group={group})
"""

SLEEP = """%%distributed --gpus 2 --timeout 120
print("sleeping")
for _ in range(100000):
    time.sleep(0.01)
"""


@pytest.fixture
def kernel(tmp_path):
    k = OwnKernel(tmp_path)
    yield k
    k.close()


def trains_on(kernel) -> list[int]:
    """One more step of every model; the ranks' pids. Every rank's full FSDP2 parameters and DDP
    replica are identical, and both equal the one-process reference."""
    close_to_reference, gathered = kernel.result(CHECK)
    assert len(gathered) == N
    assert all(stepped == 1 for _, _, _, stepped in gathered)
    assert len({tuple(full) for _, full, _, _ in gathered}) == 1  # one model, bit for bit on every rank
    assert len({tuple(replica) for _, _, replica, _ in gathered}) == 1
    assert close_to_reference, "the trained models left the one-process reference"
    return [pid for pid, _, _, _ in gathered]


def define(kernel, extra: str = "") -> list[int]:
    out = kernel.run(DEFINE.format(extra=extra))
    assert out["status"] == "ok", out["text"]
    return trains_on(kernel)


@pytest.mark.parametrize("group", ["None", "sub"])  # stuck on the world group, on the subgroup
def test_a_rank_stuck_in_a_collective_and_every_holder_trains_on(kernel, group):
    before = define(kernel)
    out = kernel.run(STUCK.format(group=group), interrupt_when="waiting")
    assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
    text = out["text"]
    assert "was waiting in a collective the other ranks did not reach; it was freed from it" in text
    assert (
        "The process groups were reconnected in place (a fresh rendezvous), and each answered a "
        "collective on every member: the world group (2 ranks); sub (ranks 0 and 1)." in text
    ), text
    assert "so these go on: fs (FSDP2), layer (FSDP2), ddp (DDP), mesh (DeviceMesh)." in text, text
    assert "Made equal to rank 0's on every rank (parameters and buffers): ddp." in text
    assert "Not reconnected" not in text and "Not working" not in text
    assert trains_on(kernel) == before  # the same processes; every model goes on
    assert trains_on(kernel) == before


def test_an_interrupt_outside_any_collective_keeps_the_groups_untouched(kernel):
    before = define(kernel)
    out = kernel.run(SLEEP, interrupt_when="sleeping")
    assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
    assert "freed" not in out["text"] and "reconnected" not in out["text"]
    assert "Every rank's variables are kept, in the same processes." in out["text"]
    assert trains_on(kernel) == before


def test_a_group_of_another_backend_is_named_as_not_reconnected(kernel):
    before = define(kernel, extra='own = dist.new_group([0, 1], backend="gloo")')
    out = kernel.run(STUCK.format(group="None"), interrupt_when="waiting")
    text = out["text"]
    assert (
        "Not reconnected: own (ranks 0 and 1), made with backend 'gloo', which gpuhub cannot "
        "reconnect: make it again with dist.new_group(ranks=[0, 1])" in text
    ), text
    assert "go on:" not in text  # nothing is said to go on while a group is lost
    assert trains_on(kernel) == before  # the groups gpuhub reconnected still work


TRAIN = """%%distributed --gpus 2 --timeout 120
for i in range(100000):
    step()
    if i == 3:
        print("training")
"""

AFTER = """%%distributed --gpus 2 --timeout 120
before = steps
step()
full = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
replica = torch.cat([p.detach().flatten() for p in ddp.parameters()])
gathered = [None] * world_size
dist.all_gather_object(gathered, (os.getpid(), full.tolist(), replica.tolist(), steps - before))
gathered
"""


def test_an_interrupt_mid_training_step_leaves_every_model_training(kernel):
    """Ctrl-C lands wherever each rank is in a step (a forward's all-gather, a backward's
    reduce-scatter, DDP's all-reduce): the next cell's step works on every rank, in the same
    processes, with one model on every rank."""
    before = define(kernel)
    for _ in range(2):
        out = kernel.run(TRAIN, interrupt_when="training")
        assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
        assert "Not reconnected" not in out["text"] and "Not working" not in out["text"], out["text"]
        assert "Every rank's variables are kept, in the same processes." in out["text"]
        gathered = kernel.result(AFTER)
        assert [pid for pid, _, _, _ in gathered] == before
        assert all(stepped == 1 for _, _, _, stepped in gathered)
        assert len({tuple(full) for _, full, _, _ in gathered}) == 1
        assert len({tuple(replica) for _, _, replica, _ in gathered}) == 1


APART = """%%distributed --gpus 2 --timeout 120
if rank == 0:  # as if rank 0's optimizer stepped and rank 1's did not when the cell stopped
    for p in ddp.parameters():
        p.grad = torch.ones_like(p)
    ddp_opt.step()
    ddp_opt.zero_grad()
raise ValueError("stopped mid-step")
"""


def test_replicas_a_stopped_cell_left_apart_are_made_equal_again_and_said_so(kernel):
    before = define(kernel)
    out = kernel.run(APART)
    assert out["status"] == "error", out["text"]
    text = out["text"]
    assert "freed" not in text and "reconnected" not in text  # no collective was out of step
    assert (
        "The ranks had stopped at different points of a step; made equal to rank 0's on every rank "
        "(parameters and buffers): ddp, and the state of their optimizers: ddp_opt." in text
    ), text
    gathered = kernel.result(AFTER)
    assert [pid for pid, _, _, _ in gathered] == before
    assert len({tuple(replica) for _, _, replica, _ in gathered}) == 1
