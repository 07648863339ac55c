"""``%%distributed`` through a real kernel, real ipyparallel engines and real torch.distributed
(gloo on CPU), with GPUs from the real broker of a real hub.

The kernel gets what a gpuhub server gives it: a token with the allocations scope and the
broker's URL. Burst allocations are therefore real ledger rows, checked here.
"""

import os
import re
import signal

import pytest
from jupyter_client import KernelManager

from gpu_magics.common.procs import alive as _alive

from .hubtools import Hub, wait_for
from .kerneltools import run_notebook

pytestmark = pytest.mark.hub

TRAIN = """%%distributed --gpus {n} --timeout 60
import os
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.02)
g = torch.Generator().manual_seed(rank)
X = torch.randn(256, 8, generator=g)
y = X.sum(dim=1, keepdim=True)
losses = []
for step in range(40):
    opt.zero_grad()
    loss = ((model(X) - y) ** 2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print(f"loss {{losses[0]:.5f}} -> {{losses[-1]:.5f}}")
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
gathered = [None] * world_size
dist.all_gather_object(gathered, (round(checksum, 10), os.getpid(), id(model)))
gathered
"""

TRAIN_MORE = """%%distributed --gpus {n} --timeout 60
for step in range(10):
    opt.zero_grad()
    loss = ((model(X) - y) ** 2).mean()
    loss.backward()
    opt.step()
    losses.append(loss.item())
gathered = [None] * world_size
dist.all_gather_object(gathered, (os.getpid(), id(model), len(losses)))
gathered
"""

ALLREDUCE = """%%distributed --gpus 2 --timeout 20
t = torch.ones(1)
dist.all_reduce(t)
t.item()
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(
        tmp_path_factory.mktemp("distributed"), extra_config='c.GpuHub.user_limits = {"alice": 4}'
    ).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture
def kernel_env(hub, tmp_path):
    def make(user="alice"):
        env = dict(os.environ)
        env.update(
            JUPYTERHUB_API_TOKEN=hub.user_token(user),
            GPUHUB_BROKER_URL=f"http://127.0.0.1:{hub.broker_port}/services/gpuhub/api/v1/",
            IPYTHONDIR=str(tmp_path / "ipython"),
        )
        for var in ("GPUHUB_GPUS", "GPUHUB_ALLOCATION_ID", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
            env.pop(var, None)
        return env

    return make


def bursts(ledger, user="alice"):
    return [a for a in ledger.active(user=user) if a.purpose == "distributed"]


@pytest.mark.parametrize("n", [2, 4])
def test_ddp_trains_and_the_pool_stays_warm(hub, ledger, kernel_env, n, tmp_path):
    # each rank's exit handler leaves a file: %distributed shutdown ends the engines cleanly (a
    # shutdown request, as Jupyter asks a kernel), not by signals that skip them
    on_exit = f"%%distributed --gpus {n} --timeout 60\nimport atexit\n"
    on_exit += f"atexit.register(open, '{tmp_path}/exited-%d' % rank, 'w')"
    cells = run_notebook(
        [TRAIN.format(n=n), TRAIN_MORE.format(n=n), on_exit, "%gpus", "%distributed shutdown"], kernel_env()
    )
    train, more, exits, gpus, shutdown = cells
    assert exits.error is None and not exits.stderr, exits
    assert train.error is None, train
    assert "engines up" in str(train.outputs[0])  # the progress display
    lines = train.rank_lines()
    assert sorted(lines) == list(range(n))
    for rank, out in lines.items():
        first, last = map(float, out[-1].removeprefix("loss ").split(" -> "))
        assert last < first / 2, (rank, out)
    gathered = train.result
    assert len({checksum for checksum, _, _ in gathered}) == 1  # identical parameters everywhere
    pids = [pid for _, pid, _ in gathered]
    assert len(set(pids)) == n and os.getpid() not in pids
    # the second cell ran on the same processes, with the same model object, 40 + 10 steps
    assert more.error is None, more
    assert more.result == [(pid, model_id, 50) for _, pid, model_id in gathered]
    assert f"rank {n - 1}: GPU" in gpus.stdout and "burst allocation #" in gpus.stdout
    controller = int(gpus.stdout.split("controller: pid ")[1].split()[0])
    assert "engines stopped and burst GPUs released" in shutdown.stdout
    assert bursts(ledger) == []
    for pid in [*pids, controller]:
        wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 30, f"engine {pid} to exit")
    assert sorted(p.name for p in tmp_path.glob("exited-*")) == [f"exited-{r}" for r in range(n)]


def test_each_rank_has_torchruns_environment(hub, ledger, kernel_env):
    cell = """%%distributed --gpus 3
import os
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS"]
envs = [None] * world_size
dist.all_gather_object(envs, {k: os.environ[k] for k in keys})
envs
"""
    [env_cell] = run_notebook([cell], kernel_env())
    assert env_cell.error is None, env_cell
    envs = env_cell.result
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert all(e["WORLD_SIZE"] == "3" and e["LOCAL_WORLD_SIZE"] == "3" for e in envs)
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2"]  # one node
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1
    assert all(e["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID" for e in envs)
    assert all(e["OMP_NUM_THREADS"] == "1" for e in envs)  # as torchrun sets it
    devices = [e["CUDA_VISIBLE_DEVICES"] for e in envs]
    assert len(set(devices)) == 3
    # equal to the GPUs the ledger gave the burst (released when the kernel shut down)
    history = _last_burst(ledger, "alice")
    assert sorted(devices) == sorted(str(g.index) for g in history.gpus)
    assert history.state == "released"


def _last_burst(ledger, user):
    from sqlalchemy import select

    from spawner.ledger.models import Allocation

    with ledger._read() as s:
        last = s.scalars(
            select(Allocation)
            .where(Allocation.user == user, Allocation.purpose == "distributed")
            .order_by(Allocation.id.desc())
        ).first()
        return ledger.get(last.id)


def test_a_failing_rank_is_named_and_the_next_cell_works(hub, kernel_env):
    # one pool's settings throughout (ALLREDUCE's): the engines hold x, and a pool holding
    # variables is not replaced by a cell with other settings without --restart
    fail = """%%distributed --gpus 2 --timeout 20
x = 1
if rank == 1:
    raise ValueError("boom on purpose")
"""
    rank0 = "%%distributed --gpus 2 --timeout 20 --output rank0\nprint('hi', rank)"
    only1 = "%%distributed --gpus 2 --timeout 20 --targets 1\nprint('only', rank)"
    bad = "%%distributed --gpus 2 --timeout 20 --targets 2\n1"
    failed, after, quiet, targeted, bad_targets = run_notebook(
        [fail, ALLREDUCE, rank0, only1, bad], kernel_env()
    )
    assert failed.error is not None
    tb = failed.traceback
    assert "rank 1 (node" in tb and "GPU" in tb and "raised ValueError: boom on purpose" in tb
    assert 'raise ValueError("boom on purpose")' in tb  # the rank's own traceback
    assert "rank 0" not in tb
    assert after.error is None and after.result == 2.0
    assert quiet.rank_lines() == {0: ["hi 0"]}  # --output rank0
    assert targeted.rank_lines() == {1: ["only 1"]}  # --targets
    assert "UsageError: --targets: ranks run from 0 to 1" in bad_targets.stderr


def test_an_idle_pool_is_stopped_and_its_gpus_released(hub, ledger, kernel_env):
    cells = run_notebook(
        [
            "%config DistributedMagics.idle_seconds = 2",
            "%%distributed --gpus 2\nrank",
            "import time\ntime.sleep(8)",
            "%distributed status",
        ],
        kernel_env(),
    )
    assert cells[1].result == 0
    assert "idle for 2 s; stopping them" in cells[2].stdout + cells[3].stdout
    assert "engines: none" in cells[3].stdout
    assert _last_burst(ledger, "alice").state == "released"


def test_a_killed_rank_fails_the_cell_and_the_pool_goes_on_without_it(hub, kernel_env):
    die = """%%distributed --gpus 2 --timeout 20
import os, time
if rank == 1:
    time.sleep(0.5)
    os._exit(1)
t = torch.ones(1)
dist.all_reduce(t)
"""
    # rank 0 waits in the all_reduce for a rank that is gone: the cell must fail (the pool sees
    # the death, or at worst the group's 20 s timeout ends the wait), never hang; a cell that
    # hangs meets nbclient's timeout, which fails the test
    died, alone, after = run_notebook(
        [die, "%%distributed --gpus 1 --timeout 20\n(rank, world_size)", ALLREDUCE], kernel_env(), timeout=120
    )
    assert died.error is not None
    assert "rank 1" in died.traceback and "died" in died.traceback
    # rank 0 goes on in its own process at 1 rank; a 2-GPU cell grows the pool back
    assert "Lost: the process of rank 1 and what only it held." in died.traceback, died.traceback
    assert "The pool shrank in place from 2 to 1 rank: rank 1 (GPU " in died.traceback
    assert "starts fresh engines" not in died.traceback
    assert alone.error is None and alone.result == (0, 1)
    assert "the pool grew in place from 1 to 2 ranks" in after.shown, after.shown
    assert after.error is None and after.result == 2.0


def test_kernel_shutdown_leaves_no_pool_process(hub, kernel_env):
    [status] = run_notebook(["%%distributed --gpus 2\n1\n", "%distributed status"], kernel_env())[1:]
    pids = [int(w) for w in status.stdout.replace(",", " ").split() if w.isdigit() and int(w) > 100]
    assert len(pids) == 3  # the controller and two engines
    for pid in pids:  # nbclient shut the kernel down: the pool went with it
        wait_for(lambda pid=pid: not _alive(pid), 30, f"pool process {pid} to exit")


def test_a_kernel_interrupt_stops_every_rank(hub, kernel_env):
    long = """%%distributed --gpus 2 --timeout 20
import time
for i in range(600):
    time.sleep(0.1)
"""
    interrupted, after = run_notebook([long, ALLREDUCE], kernel_env(), timeout=15, interrupt_on_timeout=True)
    assert interrupted.error is not None and interrupted.error["ename"] == "KeyboardInterrupt"
    # every rank was interrupted, and its process (with its variables) is kept
    report = interrupted.traceback  # the ranks' report, in place of the magic's frames
    for rank in (0, 1):
        assert re.search(rf"rank {rank} \(.*\) was interrupted", report), report
    assert (
        "Every rank's variables are kept, in the same processes." in report
        and "gpu_magics/kernel/" not in report
    )
    assert after.error is None and after.result == 2.0


def test_over_the_limit_is_a_usage_error_and_takes_nothing(hub, ledger, kernel_env):
    def bobs():  # an earlier test's kernel may still be giving its GPUs back: bob's only
        return [
            (st.gpu.label, st.holder) for st in ledger.gpu_table() if st.holder and st.holder.user == "bob"
        ]

    before = bobs()
    cell, bad_args, multi = run_notebook(
        ["%%distributed --gpus 3\n1", "%%distributed --gpus 0\n1", "%%distributed --gpus 2 --nodes 2\n1"],
        kernel_env("bob"),
    )
    # IPython shows a UsageError as its message alone, no traceback
    assert "UsageError: gpuhub refused 3 GPUs for %%distributed" in cell.stderr
    assert "you hold 0 of a limit of 2 (group students): your limit lets you hold 2 more GPUs" in cell.stderr
    assert "argument --gpus: must be a whole number from 1 to 4096; got 0" in bad_args.stderr
    assert "--nodes 1 only (multi-node %%distributed needs the Slurm backend)" in multi.stderr
    assert bobs() == before


def test_a_killed_kernels_burst_is_given_back_by_its_reaper_and_its_engines_exit(hub, ledger, kernel_env):
    earlier = {b.id for b in bursts(ledger)}  # an earlier test's kernel may still be releasing
    km = KernelManager(kernel_name="python3-gpus")
    km.start_kernel(env=kernel_env())
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        kc.execute_interactive("%config DistributedMagics.lease_seconds = 12", timeout=30)
        outputs = []
        reply = kc.execute_interactive(
            "%%distributed --gpus 2\nimport os\nos.getpid()", timeout=120, output_hook=outputs.append
        )
        assert reply["content"]["status"] == "ok"
        [burst] = [b for b in bursts(ledger) if b.id not in earlier]
        pids = _pool_pids(kc)
        os.kill(km.provisioner.pid, signal.SIGKILL)  # the kernel dies without cleaning up
        wait_for(lambda: ledger.get(burst.id).state == "released", 40, "the burst to be given back")
        gone = ledger.get(burst.id)
        # the pool's reaper saw its kernel die and gave the GPUs back; the lease is the last resort
        assert gone.end_reason == "its kernel ended (given back by the pool's reaper)", gone.end_reason
        assert gone.ended < gone.lease_expires, (gone.ended, gone.lease_expires)
        for pid in pids:  # engines (their watchdog) and the controller (the reaper)
            wait_for(lambda pid=pid: not _alive(pid), 30, f"pool process {pid} to exit")
    finally:
        kc.stop_channels()
        km.cleanup_resources()


def _pool_pids(kc) -> list[int]:
    """The engines' and the controller's pids."""
    outputs = []
    kc.execute_interactive(
        "pool = get_ipython().magics_manager.registry['DistributedMagics'].pool\n"
        "print([*pool.pids, pool.controller_pid])",
        timeout=30,
        output_hook=lambda m: outputs.append(m["content"].get("text", "")),
    )
    return [int(p) for p in "".join(outputs).strip(" []\n").split(",")]
