"""``%%distributed`` on the Slurm backend, end to end: a Slurm-spawned server's own kernel
(started through the server's REST API, as JupyterLab does) runs DDP

- inside its own allocation (2 GPUs: one ``srun`` step, nothing new allocated), and
- across both nodes of the test cluster (``--gpus 8 --nodes 2``: a burst job of the user,
  admitted by the broker, placed by Slurm), including a burst job killed mid-training.
"""

from __future__ import annotations

import re

import pytest

from spawner.ledger import Ledger
from spawner.policy import Limit

from . import slurmtools, wskernel
from .hubtools import wait_for
from .slurmtools import job_state, slurm
from .test_distributed_hub import run

pytestmark = pytest.mark.hub

DDP = """%%distributed {args}
import os, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(rank)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(20):
    x = torch.randn(16, 8); loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
checksum = sum(float(p.sum()) for p in model.parameters())
print(f"node={{os.environ['SLURMD_NODENAME']}} job={{os.environ['SLURM_JOB_ID']}} world={{world_size}} "
      f"gpu={{os.environ['GPUHUB_RANK_GPU']}} checksum={{checksum:.6f}}")
"""
LINE = re.compile(r"\[rank (\d+)\] node=(\S+) job=(\d+) world=(\d+) gpu=(\S+) checksum=(\S+)")


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with slurmtools.slurm_hub(tmp_path_factory.mktemp("slurmhub")) as h:
        yield h.wait_for_broker()


def kernel_of(hub, user: str):
    """A kernel of the user's server on its node, driven through the proxy as JupyterLab does."""
    return wskernel.server_kernel(hub, user)


def ranks_of(out: str) -> dict[int, tuple]:
    return {int(m[0]): m[1:] for m in LINE.findall(out)}


def test_ddp_in_the_sessions_own_allocation_and_across_two_nodes(hub):
    ledger = Ledger(hub.ledger_url)
    ledger.set_limit("user", "alice", Limit(max_gpus=10))
    try:
        # 1. a 2-GPU server: --gpus 2 runs as a step of its own job, nothing else is allocated
        assert hub.spawn("alice", {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready("alice", timeout=120)
        [server] = ledger.active(user="alice")
        kc, kid = kernel_of(hub, "alice")
        status, out = run(kc, DDP.format(args="--gpus 2"))
        assert status == "ok", out
        ranks = ranks_of(out)
        assert sorted(ranks) == [0, 1], out
        assert {r[1] for r in ranks.values()} == {server.backend_job_id}  # inside the server's job
        assert {r[3] for r in ranks.values()} == {g.label for g in server.gpus}
        assert len({r[4] for r in ranks.values()}) == 1  # DDP kept the replicas identical
        assert [a.id for a in ledger.active(user="alice")] == [server.id]
        # a kernel interrupt (the notebook's stop button) reaches every rank; the next cell works
        kc.execute("%%distributed --gpus 2\nprint('looping', flush=True)\nwhile True:\n    pass\n")
        wait_for(
            lambda: "looping" in (kc.get_iopub_msg(timeout=30)["content"].get("text") or ""), 60, "the loop"
        )
        r = hub.api_url_request("POST", f"/user/alice/api/kernels/{kid}/interrupt")
        assert r.status_code == 204, r.text
        reply = kc.get_shell_msg(timeout=60)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
        status, out = run(kc, "%%distributed --gpus 2\nprint('after', rank)")
        assert status == "ok" and "[rank 0] after 0" in out and "[rank 1] after 1" in out, out
        run(kc, "%distributed shutdown")
        kc.stop_channels()
        hub.stop_server("alice")

        # 2. a server without GPUs: --gpus 8 --nodes 2 is a burst job over both nodes
        assert hub.spawn("alice", {"gpus": 0}).status_code in (201, 202)
        hub.wait_ready("alice", timeout=120)
        kc, kid = kernel_of(hub, "alice")
        status, out = run(kc, DDP.format(args="--gpus 8 --nodes 2"), timeout=300)
        assert status == "ok", out
        ranks = ranks_of(out)
        assert sorted(ranks) == list(range(8)), out
        assert {r[0] for r in ranks.values()} == {"gpu-node1", "gpu-node2"}
        assert [r[0] for _, r in sorted(ranks.items())] == ["gpu-node1"] * 4 + ["gpu-node2"] * 4
        assert {r[2] for r in ranks.values()} == {"8"} and len({r[4] for r in ranks.values()}) == 1
        [job] = {r[1] for r in ranks.values()}
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        assert burst.backend_job_id == job and burst.gpu_count == 8
        wait_for(lambda: len(ledger.get(burst.id).gpus) == 8, 30, "the watcher to record the burst's GPUs")
        assert {g.label for g in ledger.get(burst.id).gpus} == {r[3] for r in ranks.values()}

        # each engine reports its own GPU's use from its Slurm node (idle reclaim, the grid)
        def burst_reported():
            grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
            mine = [g for g in grid["gpus"] if g["holder"] and g["holder"]["allocation_id"] == burst.id]
            return len(mine) == 8 and all(g["utilization"] is not None for g in mine)

        wait_for(burst_reported, 30, "the engines on both nodes to report their GPUs")

        # the same pool answers the next cell (warm engines, same job)
        status, out = run(kc, "%%distributed --gpus 8 --nodes 2\nprint('again', os.environ['SLURM_JOB_ID'])")
        assert status == "ok" and out.count(f"again {job}") == 8, out
        assert ledger.get(burst.id).state == "running"  # the burst stays with its warm pool

        # an interrupt while rank 5 (on the second node) sleeps and the others wait in a collective
        # for it: every rank is stopped, the waiting ones freed, and the same processes go on
        pids = "%%distributed --gpus 8 --nodes 2\nimport os\nprint('pid', os.getpid())"
        status, out = run(kc, pids)
        before = sorted(re.findall(r"\[rank (\d+)\] pid (\d+)", out))
        assert status == "ok" and len(before) == 8, out
        kc.execute(
            "%%distributed --gpus 8 --nodes 2\nimport time\nprint('waiting', flush=True)\n"
            "if rank == 5:\n    time.sleep(600)\nt = torch.ones(1)\ndist.all_reduce(t)\n"
        )
        wait_for(
            lambda: "waiting" in (kc.get_iopub_msg(timeout=30)["content"].get("text") or ""), 60, "the cell"
        )
        r = hub.api_url_request("POST", f"/user/alice/api/kernels/{kid}/interrupt")
        assert r.status_code == 204, r.text
        reply = kc.get_shell_msg(timeout=60)  # seconds, not the collective's timeout
        assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
        status, out = run(
            kc,
            "%%distributed --gpus 8 --nodes 2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())",
        )
        assert status == "ok" and out.count("sum 8.0") == 8, out
        status, out = run(kc, pids)
        assert sorted(re.findall(r"\[rank (\d+)\] pid (\d+)", out)) == before, out
        assert job_state(job) == "RUNNING"
        status, out = run(kc, "%gpus")
        assert f"burst allocation #{burst.id}: 8 GPUs (Slurm job {job})" in out, out

        # 3. the burst job is killed mid-training: the failure is reported, the next cell recovers
        slow = "%%distributed --gpus 8 --nodes 2\nimport time\nfor _ in range(600):\n    time.sleep(0.1)\n"
        kc.execute(slow)
        wait_for(lambda: job_state(job) == "RUNNING", 10, "the burst job")
        slurm("scancel", job)
        reply = kc.get_shell_msg(timeout=120)
        assert reply["content"]["status"] == "error"
        assert "rank" in "".join(reply["content"].get("traceback", [])) or reply["content"]["ename"]
        wait_for(lambda: ledger.get(burst.id).state == "released", 30, "the killed burst to be released")
        status, out = run(kc, DDP.format(args="--gpus 8 --nodes 2"), timeout=300)
        assert status == "ok", out
        assert sorted(ranks_of(out)) == list(range(8))
        assert {r[1] for r in ranks_of(out).values()} != {job}  # a new job
        # 4. the server stops with the pool still up (no shutdown): nothing is left behind
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        kc.stop_channels()
        hub.stop_server("alice")
        wait_for(
            lambda: job_state(burst.backend_job_id) in ("CANCELLED", "COMPLETED", "GONE"),
            90,
            "the burst job to end",
        )
        wait_for(lambda: ledger.get(burst.id).state == "released", 60, "the burst to be released")
        assert ledger.active(user="alice") == []
    finally:
        ledger.unset_limit("user", "alice")
        ledger.close()
