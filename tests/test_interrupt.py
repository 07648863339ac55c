"""`%%distributed` keeps the researcher's work across an interrupt and an error: the same
engine processes, every variable, and a DDP model that trains on in the next cell with
identical parameters on every rank. Real kernel, real ipyparallel engines, gloo on CPU, GPUs
from a real hub's broker."""

from __future__ import annotations

import re

import pytest

from .hubtools import Hub
from .kerneltools import BrokerKernel as Kernel

pytestmark = pytest.mark.hub

DEFINE = """%%distributed --gpus {n} --timeout 120
import os, time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
X = torch.randn(64, 8, generator=g)
y = X.sum(dim=1, keepdim=True)
steps = 0
def step():
    global steps
    opt.zero_grad()
    ((model(X) - y) ** 2).mean().backward()
    opt.step()
    steps += 1
print("defined", os.getpid())
"""

TRAIN_FOREVER = """%%distributed --gpus {n} --timeout 120
for _ in range(100000):
    step()
    if steps == 3:
        print("training")
    time.sleep(0.01)
"""

# every rank outside any collective when the interrupt comes
SLEEP_FOREVER = """%%distributed --gpus {n} --timeout 120
print("sleeping")
for _ in range(100000):
    time.sleep(0.01)
"""

# rank 0 waits in a collective that rank 1 never reaches: it sleeps first
ASYMMETRIC = """%%distributed --gpus {n} --timeout 120
print("waiting")
if rank == 1:
    time.sleep(600)
t = torch.ones(1)
dist.all_reduce(t)
"""

CHECK = """%%distributed --gpus {n} --timeout 120
before = steps
step()
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
gathered = [None] * world_size
dist.all_gather_object(gathered, (os.getpid(), round(checksum, 12), steps - before, type(model).__name__))
gathered
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("interrupt"), extra_config='c.GpuHub.user_limits = {"alice": 4}').start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture
def kernel(hub, tmp_path):
    k = Kernel(hub, tmp_path)
    yield k
    k.close()


def define(kernel, n) -> list[int]:
    """The model, optimizer and data on ``n`` ranks, one step taken; the ranks' pids."""
    defined = kernel.run(DEFINE.format(n=n))
    assert defined["status"] == "ok", defined["text"]
    return pids_and_model(kernel, n)


def pids_and_model(kernel, n):
    gathered = kernel.result(CHECK.format(n=n))
    assert len(gathered) == n
    assert len({checksum for _, checksum, _, _ in gathered}) == 1, gathered  # identical parameters
    assert all(stepped == 1 and kind == "DistributedDataParallel" for _, _, stepped, kind in gathered)
    return [pid for pid, _, _, _ in gathered]


@pytest.mark.parametrize("n", [2, 4])
def test_an_interrupt_mid_training_keeps_every_rank_and_its_model(kernel, n):
    before = define(kernel, n)
    out = kernel.run(TRAIN_FOREVER.format(n=n), interrupt_when="training")
    assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
    assert (
        "gpu_magics" not in out["text"] and "gpu_magics/kernel/" not in out["text"]
    )  # the ranks' report only
    for rank in range(n):
        assert f"rank {rank} (" in out["text"]
    assert "died" not in out["text"] and "killed" not in out["text"]
    assert "Every rank's variables are kept, in the same processes." in out["text"]
    assert out["took"] < 30, out  # seconds, not the collective's timeout (120 s)
    assert pids_and_model(kernel, n) == before  # same processes; DDP trains on, ranks identical


def test_a_rank_stuck_in_a_collective_is_freed_and_the_group_reconnected(kernel):
    n = 2
    before = define(kernel, n)
    out = kernel.run(ASYMMETRIC.format(n=n), interrupt_when="waiting")
    assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
    text = out["text"]
    assert "rank 0 (" in text and "was waiting in a collective the other ranks did not reach" in text
    assert "rank 1 (" in text and "was interrupted" in text
    assert "The process groups were reconnected in place (a fresh rendezvous)" in text
    assert "They hold the same group objects as before, so these go on: model (DDP)." in text
    assert "Made equal to rank 0's on every rank (parameters and buffers): model." in text
    assert out["took"] < 30, out  # the collective's timeout is 120 s
    assert pids_and_model(kernel, n) == before


def test_an_error_on_one_rank_keeps_every_process_and_its_state(kernel):
    n = 2
    before = define(kernel, n)
    failing = f"%%distributed --gpus {n} --timeout 120\nif rank == 1:\n    raise ValueError('bad batch')\n"
    failing += "t = torch.ones(1)\ndist.all_reduce(t)\n"
    out = kernel.run(failing)
    assert out["status"] == "error", out["text"]
    assert "rank 1 (" in out["text"] and "raised ValueError: bad batch" in out["text"]
    assert "rank 0 (" in out["text"] and "died" not in out["text"] and "killed" not in out["text"]
    assert "Every rank's variables are kept" in out["text"]
    assert pids_and_model(kernel, n) == before


def test_an_interrupt_outside_any_collective_keeps_the_group(kernel):
    n = 2
    before = define(kernel, n)
    out = kernel.run(SLEEP_FOREVER.format(n=n), interrupt_when="sleeping")
    assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
    assert len(re.findall(r"^rank \d+ \(.*\) was interrupted\.$", out["text"], re.M)) == n
    assert "freed" not in out["text"]
    assert "reconnected" not in out["text"]  # every rank ran the same collectives: the groups are kept
    assert out["took"] < 30, out
    assert pids_and_model(kernel, n) == before


def test_an_interrupt_while_the_engines_start_is_a_clean_report_and_takes_nothing(hub, kernel):
    from spawner.ledger import Ledger

    out = kernel.run("%%distributed --gpus 2\n1", interrupt_when="Starting engines")
    assert out["status"] == "error" and out["ename"] == "KeyboardInterrupt", out["text"]
    assert "Interrupted while the engines started" in out["text"] and "gpu_magics/kernel/" not in out["text"]
    ledger = Ledger(hub.ledger_url)
    try:
        assert [a for a in ledger.active(user="alice") if a.purpose == "distributed"] == []  # released
    finally:
        ledger.close()
    assert kernel.result("%%distributed --gpus 2\nrank") == 0  # and the next cell starts them
