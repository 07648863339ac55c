"""A pool shrinks in place when its borrowed GPU is taken back, end to end: a real hub and proxy
with 4 simulated GPUs, a real kernel (outside any server: every GPU of its pool is a burst),
real engines (gloo on CPU), a real spawn that waits for the GPU.

alice (limit 3, may borrow 1) trains a 4-rank pool: 3 GPUs within her limit, 1 borrowed. bob's
in-limit spawn of 1 GPU waits; the broker gives notice to the borrowed burst; alice's training
cell is interrupted at the notice's time, rank 3 leaves, and ranks 0 to 2 go on in the same
processes with every variable: the world group re-formed at 3 ranks, the DDP model training on
with the average over 3 ranks. bob's server starts on the GPU given back.
"""

from __future__ import annotations

import pytest

from spawner.ledger import Ledger

from .cells import BATCH
from .hubtools import Hub, wait_for
from .kerneltools import BrokerKernel

pytestmark = pytest.mark.hub

CONFIG = """
c.GpuHub.default_limit = 3
c.GpuHub.group_limits = {}
c.GpuHub.user_limits = {}
c.GpuHub.default_borrow = 1
c.GpuHub.preempt_grace_seconds = 15
c.GpuHub.queue_keepalive_seconds = 20
"""

DEFINE = (
    """%%distributed --gpus 4 --timeout 30
import copy, os, time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
fs = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))  # sharded over the 4 ranks
fully_shard(fs, mesh=init_device_mesh("cpu", (world_size,)))
fs_opt = torch.optim.SGD(fs.parameters(), lr=0.01)
notes = {"defined on": world_size}
"""
    + BATCH
    + """steps = 0
def step():
    global steps
    X, y = batch(rank, steps)
    for m, o in ((model, opt), (fs, fs_opt)):
        o.zero_grad()
        ((m(X) - y) ** 2).mean().backward()
        o.step()
    steps += 1
step()
print("defined", os.getpid())
"""
)

TRAIN = """%%distributed --gpus 4 --timeout 30
if rank == 0:
    print("TRAINING", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 240:
    step()
    time.sleep(0.02)
"""

# one more step on 3 ranks, against a one-process reference from the same parameters: SGD on
# the mean of the 3 ranks' losses (DDP now averages over 3)
CHECK = """%%distributed --gpus 3 --timeout 30
ref = copy.deepcopy(model.module)
ref_fs = copy.deepcopy(model.module)  # the sharded model's full parameters, in one process
with torch.no_grad():
    for p, q in zip(ref_fs.parameters(), fs.parameters()):
        p.copy_(q.full_tensor())
k = steps
step()
for r_model in (ref, ref_fs):
    r_opt = torch.optim.SGD(r_model.parameters(), lr=0.01)
    losses = [((r_model(Xr) - yr) ** 2).mean() for Xr, yr in (batch(r, k) for r in range(world_size))]
    r_opt.zero_grad()
    (sum(losses) / world_size).backward()
    r_opt.step()
now = torch.cat([p.detach().flatten() for p in model.parameters()])
want = torch.cat([p.detach().flatten() for p in ref.parameters()])
fs_now = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
fs_want = torch.cat([p.detach().flatten() for p in ref_fs.parameters()])
gathered = [None] * world_size
close = bool(torch.allclose(now, want, atol=1e-6) and torch.allclose(fs_now, fs_want, atol=1e-6))
close = close and {p.device_mesh.size() for p in fs.parameters()} == {world_size}
dist.all_gather_object(gathered, (os.getpid(), rank, world_size, now.tolist(), close, notes))
gathered
"""


def test_a_preempted_borrowed_gpu_shrinks_the_pool_in_place(tmp_path):
    hub = Hub(tmp_path, extra_config=CONFIG).start()
    ledger = Ledger(hub.ledger_url)
    kernel = None
    try:
        hub.wait_for_broker()
        kernel = BrokerKernel(hub, tmp_path, "alice")
        out = kernel.run("%config DistributedMagics.notice_check_seconds = 1")
        assert out["status"] == "ok", out["text"]
        out = kernel.run(DEFINE)
        assert out["status"] == "ok", out["text"]
        pids = [int(line.split()[-1]) for line in out["text"].splitlines() if "defined" in line]
        by_rank = {
            int(line.split("]")[0].split()[-1]): int(line.split()[-1])
            for line in out["text"].splitlines()
            if "] defined" in line
        }
        held = sorted(ledger.active(user="alice"), key=lambda a: a.borrowed or 0)
        assert [(len(a.gpus), a.borrowed or 0) for a in held] == [(3, 0), (1, 1)], held
        in_limit, borrowed = held

        spawned = {}

        def bob_asks():  # while alice trains: bob's in-limit spawn waits for the borrowed GPU
            spawned["status"] = hub.spawn("bob", {"gpus": 1}).status_code
            spawned["line"] = hub.wait_progress("bob", "waiting for 1 GPU")

        out = kernel.run(TRAIN, interrupt_when="TRAINING", then=bob_asks, timeout=240)
        text = out["text"]
        assert spawned["status"] == 202, spawned
        assert "the pool shrinks in place to 3 ranks (rank 3 leaves)" in text, text
        assert out["status"] == "error" and out["ename"] == "Preempted", text
        borrowed_gpu = f"{borrowed.gpus[0].node}:{borrowed.gpus[0].index}"
        assert f"The pool shrank in place from 4 to 3 ranks: rank 3 (GPU {borrowed_gpu}) left" in text, text
        assert "The world group was re-formed at 3 ranks and answered a collective on every rank." in text
        assert (
            "DDP models go on with the new group from their replicated parameters, checked equal on "
            "every rank: model." in text
        )
        assert (
            "Resharded onto 3 ranks: fs (FSDP2) with fs_opt, its full state checked equal to the state "
            "before the move." in text
        ), text
        assert "Run the next cells with --gpus 3." in text
        assert "interrupting the cell to shrink the pool in place" in text
        assert "1 borrowed GPU given back now (due at " in text
        assert "Lost" not in text and "Traceback" not in text

        # only the borrowed allocation went, as a preemption; the in-limit one is still alice's
        [p] = ledger.preemptions(user="alice")
        assert p.allocation_id == borrowed.id and p.for_user == "bob"
        wait_for(lambda: ledger.get(borrowed.id).state == "released", 30, "the borrowed GPU to be given back")
        assert [a.id for a in ledger.active(user="alice")] == [in_limit.id]
        hub.wait_ready("bob")

        # ranks 0 to 2 go on in the same processes, with their variables, training at 3 ranks
        gathered = kernel.result(CHECK)
        assert [(r, w) for _, r, w, _, _, _ in gathered] == [(0, 3), (1, 3), (2, 3)]
        assert [pid for pid, _, _, _, _, _ in gathered] == [by_rank[0], by_rank[1], by_rank[2]]
        assert len({tuple(now) for _, _, _, now, _, _ in gathered}) == 1  # one model on every rank
        assert all(close for _, _, _, _, close, _ in gathered), "the step left the 3-rank reference"
        assert all(notes == {"defined on": 4} for *_, notes in gathered)  # a plain variable, kept
        assert len(pids) == 4
    finally:
        if kernel is not None:
            kernel.close()
        ledger.close()
        hub.stop()
