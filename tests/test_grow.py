"""A pool grows in place: ``%%distributed --gpus 3`` on a 2-rank pool that holds a DDP model
adds a rank without restarting the two: they keep their processes and variables, the new rank
gets a copy of rank 0's names (the model, its optimizer, the cells' functions, imports), and one
step on 3 ranks equals a one-process reference over the 3 ranks' batches. Real kernel, real
ipyparallel engines, gloo on CPU, the server's own three (simulated) GPUs."""

from __future__ import annotations

import pytest

from .cells import BATCH
from .kerneltools import OwnKernel

DEFINE = (
    """%%distributed --gpus 2 --timeout 60
import copy, os, time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
"""
    + BATCH
    + """steps = 0
def step():
    global steps
    X, y = batch(rank, steps)
    opt.zero_grad()
    ((model(X) - y) ** 2).mean().backward()
    opt.step()
    steps += 1
class Note:
    def __init__(self, text):
        self.text = text
    def says(self):
        return f"{self.text} at step {steps}"
note = Note("defined on 2 ranks")
step()
step()
print("defined", os.getpid())
"""
)

# one step on 3 ranks against a one-process reference from the same parameters and momentum:
# SGD on the mean of the 3 ranks' losses (DDP averages over 3 now)
CHECK = """%%distributed --gpus 3 --timeout 60
ref = copy.deepcopy(model.module)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
ref_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # its own momentum, not opt's
k = steps
step()
losses = [((ref(Xr) - yr) ** 2).mean() for Xr, yr in (batch(r, k) for r in range(world_size))]
ref_opt.zero_grad()
(sum(losses) / world_size).backward()
ref_opt.step()
now = torch.cat([p.detach().flatten() for p in model.parameters()])
want = torch.cat([p.detach().flatten() for p in ref.parameters()])
close = bool(torch.allclose(now, want, atol=1e-6))
gathered = [None] * world_size
dist.all_gather_object(gathered, (os.getpid(), rank, world_size, now.tolist(), close, steps, note.says()))
gathered
"""


@pytest.fixture
def kernel(tmp_path):
    k = OwnKernel(tmp_path, gpus="t:0,t:1,t:2")
    yield k
    k.close()


def test_a_pool_grows_from_2_to_3_ranks_in_place(kernel):
    out = kernel.run(DEFINE)
    assert out["status"] == "ok", out["text"]
    before = {}
    for line in out["text"].splitlines():
        if "] defined" in line:
            before[int(line.split("]")[0].split()[-1])] = int(line.split()[-1])
    out = kernel.run(CHECK)
    text = out["text"]
    assert out["status"] == "ok", text
    assert (
        "gpuhub: the pool grew in place from 2 to 3 ranks: new rank 2 on GPU t:2; ranks 0 and 1 kept "
        "their processes and every variable." in text
    ), text
    assert "The world group was re-formed at 3 ranks and answered a collective on every rank." in text
    assert "The new rank got a copy of rank 0's names: model (DDP), " in text
    for name in ("opt", "batch", "step", "Note", "note", "steps", "nn", "DDP", "copy"):
        assert name in text.split("got a copy of rank 0's names:")[1].split("\n")[0], name
    assert "DDP models go on with the new group, checked equal on every rank: model." in text
    assert "Not copied" not in text and "Lost" not in text
    gathered = eval(out["result"])
    assert [(r, w) for _, r, w, *_ in gathered] == [(0, 3), (1, 3), (2, 3)]
    assert [pid for pid, *_ in gathered][:2] == [before[0], before[1]]  # not restarted
    assert gathered[2][0] not in before.values()
    assert len({tuple(now) for _, _, _, now, *_ in gathered}) == 1  # one model on every rank
    assert all(close for *_, close, _, _ in gathered), "the step left the 3-rank reference"
    # the copied function rebinds the new rank's own `steps`; the copied class reads it
    assert [s for *_, s, _ in gathered] == [3, 3, 3]
    assert {says for *_, says in gathered} == {"defined on 2 ranks at step 3"}


SHARDED = (
    """%%distributed --gpus 2 --timeout 60
import copy, hashlib, os
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
plain = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # the one-process reference
ref_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
fs = copy.deepcopy(plain)
mesh = init_device_mesh("cpu", (world_size,))
for layer in fs:
    if isinstance(layer, nn.Linear):
        fully_shard(layer, mesh=mesh)
fully_shard(fs, mesh=mesh)
fs_opt = torch.optim.Adam(fs.parameters(), lr=0.01)
"""
    + BATCH
    + """steps = 0
def step():
    global steps
    X, y = batch(rank, steps)
    fs_opt.zero_grad()
    ((fs(X) - y) ** 2).mean().backward()
    fs_opt.step()
    ref_opt.zero_grad()
    losses = [((plain(Xr) - yr) ** 2).mean() for Xr, yr in (batch(r, steps) for r in range(world_size))]
    (sum(losses) / world_size).backward()
    ref_opt.step()
    steps += 1
def digest():
    full = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
    return hashlib.sha256(full.numpy().tobytes()).hexdigest()
step()
print("digest", digest())
"""
)

SHARDED_CHECK = """%%distributed --gpus 3 --timeout 60
before = digest()
meshes = {p.device_mesh.size() for p in fs.parameters()}
step()
full = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
ref = torch.cat([p.detach().flatten() for p in plain.parameters()])
gathered = [None] * world_size
close = bool(torch.allclose(full, ref, atol=1e-6))
dist.all_gather_object(gathered, (os.getpid(), before, sorted(meshes), full.tolist(), close))
gathered
"""


def test_an_fsdp2_model_is_resharded_onto_the_grown_pool(kernel):
    out = kernel.run(SHARDED)
    assert out["status"] == "ok", out["text"]
    [saved] = {line.split()[-1] for line in out["text"].splitlines() if "] digest" in line}
    out = kernel.run(SHARDED_CHECK)
    text = out["text"]
    assert out["status"] == "ok", text
    assert "the pool grew in place from 2 to 3 ranks" in text, text
    assert (
        "Resharded onto 3 ranks: fs (FSDP2) with fs_opt, its full state checked equal to the state "
        "before the move." in text
    ), text
    gathered = eval(out["result"])
    assert [b for _, b, *_ in gathered] == [saved] * 3  # the full parameters, bit for bit, on every rank
    assert all(m == [3] for _, _, m, _, _ in gathered)  # sharded over the 3 ranks
    assert len({tuple(full) for *_, full, _ in gathered}) == 1
    assert all(close for *_, close in gathered), "the step on 3 ranks left the one-process reference"
