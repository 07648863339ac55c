"""``%%distributed`` on the Slurm backend, end to end: a Slurm-spawned server's own kernel
(started through the server's REST API, as JupyterLab does) runs DDP

- inside its own allocation (2 GPUs: one ``srun`` step, nothing new allocated), and
- across both nodes of the test cluster (``--gpus 8 --nodes 2``: a burst job of the user,
  admitted by the broker, placed by Slurm), including a burst job killed mid-training.
"""

from __future__ import annotations

import os
import pwd
import re
import socket
import subprocess
import threading
import uuid
from pathlib import Path

import pytest

from spawner.ledger import Ledger
from spawner.policy.limits import Limit

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
import socket
print(f"node={{os.environ['SLURMD_NODENAME']}} job={{os.environ['SLURM_JOB_ID']}} world={{world_size}} "
      f"gpu={{os.environ['GPUHUB_RANK_GPU']}} checksum={{checksum:.6f}} host={{socket.gethostname()}} "
      f"master={{os.environ['MASTER_ADDR']}}")
"""
# another account's view of rank 0's TCPStore: the names torch 2.13's gloo gives the ranks'
# addresses (keys of the group, were they not under gpuhub's secret prefix), then a forgery
STORE_PROBE = """
import socket, sys
from datetime import timedelta
import torch.distributed as dist
host, port, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
raw = dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=20))
keys = [f"0//cpu//0/{r}" for r in range(world)]
print(f"bob reached the store on {socket.gethostname()}: found {raw.check(keys)}", flush=True)
for k in keys:
    raw.set(k, b"forged by bob")
"""
HOSTS = "%%distributed {args}\nimport socket\nprint('on', socket.gethostname())"
LINE = re.compile(
    r"\[rank (\d+)\] node=(\S+) job=(\d+) world=(\d+) gpu=(\S+) checksum=(\S+) host=(\S+) master=(\S+)"
)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with slurmtools.slurm_hub(tmp_path_factory.mktemp("slurmhub")) as h:
        yield h.wait_for_broker()


def kernel_of(hub, user: str):
    """A kernel of the user's server on its node, driven through the proxy as JupyterLab does."""
    return wskernel.server_kernel(hub, user)


def engines_of(user: str) -> list[int]:
    """Pids of ``user``'s engine processes on any node (the nodes share this machine's pids)."""
    uid, found = pwd.getpwnam(user).pw_uid, []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and proc.stat().st_uid == uid:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if b"gpu_magics.engine.main" in argv and b"python" in Path(argv[0].decode()).name.encode():
                    found.append(int(proc.name))  # an engine, not the srun that started it
        except OSError:
            continue
    return found


def hang_cell(gpus, rank, marker):
    """A cell on 2 nodes whose rank RANK writes MARKER (the killer's signal), then every rank waits."""
    return (
        f"%%distributed --gpus {gpus} --nodes 2\nimport time\nif rank == {rank}:\n"
        f"    open({marker!r}, 'w').close()\nfor _ in range(600):\n    time.sleep(0.1)\n"
    )


def kill_when_there(marker: str, node: str, *pids: str) -> None:
    """Once ``marker`` exists, SIGKILL ``pids`` from inside ``node`` (as its OOM killer would)."""
    wait_for(lambda: os.path.exists(marker), 120, f"{marker} to be written")
    os.unlink(marker)
    subprocess.run([str(slurmtools.SCRIPT), "exec", node, "kill", "-KILL", *pids], check=True, timeout=30)


def interrupted(hub, kc, kid: str, code: str, when: str) -> tuple[dict, str]:
    """Run ``code``, press the notebook's stop button (the REST interrupt) once ``when`` is
    shown: (the cell's reply, everything the cell showed)."""
    msg_id, out, sent = kc.execute(code), [], False
    while True:
        msg = kc.get_iopub_msg(timeout=120)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        c = msg["content"]
        if msg["msg_type"] == "status" and c["execution_state"] == "idle":
            break
        out.append(
            c.get("text") or "\n".join(c.get("traceback", [])) or c.get("data", {}).get("text/plain", "")
        )
        if not sent and when in "".join(out):
            r = hub.api_url_request("POST", f"/user/alice/api/kernels/{kid}/interrupt")
            assert r.status_code == 204, r.text
            sent = True
    reply = kc.get_shell_msg(timeout=60)
    return reply, "".join(out)


def hosts_of(out: str) -> list[str]:
    """Each rank's host name, in rank order, from the output of ``HOSTS``."""
    return [host for _, host in sorted((int(r), h) for r, h in re.findall(r"\[rank (\d+)\] on (\S+)", out))]


def ranks_of(out: str) -> dict[int, tuple]:
    return {int(m[0]): m[1:] for m in LINE.findall(out)}


STEP7 = """%%distributed --gpus 7 --nodes 2
x = torch.randn(16, 8)
loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
opt.zero_grad(); loss.backward(); opt.step()
total = round(sum(float(p.sum()) for p in model.parameters()), 6)
print("pid", os.getpid(), "world", world_size, "sum", total)
"""

SHARDED = """%%distributed --gpus 8 --nodes 2
import hashlib
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
torch.manual_seed(0)
fs = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
fully_shard(fs, mesh=init_device_mesh("cpu", (world_size,)))
fs_opt = torch.optim.Adam(fs.parameters(), lr=0.01)
sub = dist.new_group([0, 5])
"""

SHARDED_STEP = """%%distributed --gpus 8 --nodes 2
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
fs_opt.zero_grad()
fs(X).pow(2).mean().backward()
fs_opt.step()
full = torch.cat([p.full_tensor().detach().flatten() for p in fs.parameters()])
print("full", hashlib.sha256(full.numpy().tobytes()).hexdigest())
if rank in (0, 5):
    t = torch.ones(1)
    dist.all_reduce(t, group=sub)
    print("sub", t.item())
"""


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
        # two hosts for real: each node's ranks run under its own host name and address, and every
        # rank reached rank 0's store at gpu-node1 (its address on the nodes' network, not a loopback)
        assert [r[5] for _, r in sorted(ranks.items())] == ["gpu-node1"] * 4 + ["gpu-node2"] * 4
        assert socket.gethostname() not in {r[5] for r in ranks.values()}
        assert {r[6] for r in ranks.values()} == {"gpu-node1"}
        assert socket.gethostbyname("gpu-node1") != socket.gethostbyname("gpu-node2")
        assert not socket.gethostbyname("gpu-node1").startswith("127.")
        assert {r[2] for r in ranks.values()} == {"8"} and len({r[4] for r in ranks.values()}) == 1
        [job] = {r[1] for r in ranks.values()}
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        assert burst.backend_job_id == job and burst.gpu_count == 8
        wait_for(lambda: len(ledger.get(burst.id).gpus) == 8, 30, "the watcher to record the burst's GPUs")
        assert {g.label for g in ledger.get(burst.id).gpus} == {r[3] for r in ranks.values()}

        # gpuhub's sampler on each node reads the burst's GPUs (what decides idle reclaim), and
        # each engine reports its own GPU from its node (kept for alice's view)
        def burst_reported():
            grid = hub.broker("GET", "utilization", hub.user_token("admin")).json()
            mine = [g for g in grid["gpus"] if g["holder"] and g["holder"]["allocation_id"] == burst.id]
            return len(mine) == 8 and all(g["utilization"] is not None and g["reported"] for g in mine)

        wait_for(burst_reported, 30, "the samplers and the engines on both nodes to report the burst's GPUs")

        # the same pool answers the next cell (warm engines, same job)
        status, out = run(
            kc,
            "%%distributed --gpus 8 --nodes 2\n"
            "print('again', os.environ['SLURM_JOB_ID'], os.environ['MASTER_PORT'])",
        )
        assert status == "ok" and out.count(f"again {job}") == 8, out
        assert ledger.get(burst.id).state == "running"  # the burst stays with its warm pool

        # bob, in a job of his own on gpu-node2, reaches rank 0's rendezvous port on gpu-node1 (the
        # nodes' network is open to every account): he finds none of the group's keys by name,
        # and what he writes there changes nothing for alice's ranks
        [port] = set(re.findall(rf"again {job} (\d+)", out))
        slurm("sacctmgr", "-i", "add", "user", "bob", "account=gpuhub", check=False)
        probe = slurm(
            "srun", "--account=gpuhub", "-w", "gpu-node2", "-n1", "--gres=none", "--job-name=gpuhub-test",
            str(slurmtools.VENV_BIN / "python"), "-c", STORE_PROBE, "gpu-node1", port, "8", user="bob",
        )  # fmt: skip
        assert "bob reached the store on gpu-node2: found False" in probe.stdout, (probe.stdout, probe.stderr)
        status, out = run(
            kc,
            "%%distributed --gpus 8 --nodes 2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())",
        )
        assert status == "ok" and out.count("sum 8.0") == 8, out

        # an interrupt while rank 5 (on the second node) sleeps and the others wait in a collective
        # for it: every rank is stopped, the waiting ones freed, and the same processes go on
        pids = "%%distributed --gpus 8 --nodes 2\nimport os\nprint('pid', os.getpid())"
        status, out = run(kc, SHARDED)  # an FSDP2 model over both nodes, and a subgroup across them
        assert status == "ok", out
        status, out = run(kc, pids)
        before = sorted(re.findall(r"\[rank (\d+)\] pid (\d+)", out))
        assert status == "ok" and len(before) == 8, out
        reply, out = interrupted(
            hub,
            kc,
            kid,
            "%%distributed --gpus 8 --nodes 2\nimport time\nprint('waiting', flush=True)\n"
            "if rank == 5:\n    time.sleep(600)\nt = torch.ones(1)\ndist.all_reduce(t)\n",
            "waiting",
        )
        assert reply["content"]["ename"] == "KeyboardInterrupt", (reply["content"], out)
        # rank 5 (on gpu-node2) was interrupted in its sleep, the other seven freed from the
        # collective it never reached: through Slurm on gpu-node2, by pid here
        assert "rank 5 (node gpu-node2, GPU gpu-node2:1" in out and "restarting" not in out, out
        freed = re.findall(r"rank (\d) \(node (\S+), .*? was waiting in a collective", out)
        assert sorted(int(r) for r, _ in freed) == [0, 1, 2, 3, 4, 6, 7], out
        # the same group objects, reconnected over the new TCP rendezvous: the sharded model and
        # the subgroup train on across the nodes
        assert (
            "The process groups were reconnected in place (a fresh rendezvous), and each answered a "
            "collective on every member: the world group (8 ranks); sub (ranks 0 and 5)." in out
        ), out
        assert "so these go on: fs (FSDP2)" in out, out
        status, out = run(kc, SHARDED_STEP)
        hashes = re.findall(r"full ([0-9a-f]{64})", out)
        assert status == "ok" and len(hashes) == 8 and len(set(hashes)) == 1, out
        assert out.count("sub 2.0") == 2, out
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

        # 4. a rank's process is killed on the other node mid-cell: the cell names the rank and its
        # node, and the pool shrinks in place across the nodes: the other 7 ranks keep their
        # processes and the DDP model, the world group re-formed over the new TCP rendezvous
        status, out = run(kc, pids)
        before = dict(re.findall(r"\[rank (\d+)\] pid (\d+)", out))
        victim = before["6"]
        marker = f"/home/alice/.gpuhub-test-rank6-{uuid.uuid4().hex}"
        killer = threading.Thread(target=kill_when_there, args=(marker, "gpu-node2", victim))
        killer.start()
        status, out = run(
            kc,
            hang_cell(8, 6, marker),
        )
        killer.join()
        assert status == "error", out
        assert f"rank 6 (node gpu-node2, GPU gpu-node2:2, pid {victim}) died" in out, out
        assert "The pool shrank in place from 8 to 7 ranks: rank 6 (GPU gpu-node2:2) left" in out, out
        assert "The world group was re-formed at 7 ranks and answered a collective on every rank." in out
        assert "checked equal on every rank: model." in out, out
        assert "Run the next cells with --gpus 7 --nodes 2." in out, out
        assert (
            "GPU gpu-node2:2 stays held by this session's Slurm job, unused by the pool. A Slurm pool "
            "does not grow in place: a cell with --gpus 8 --nodes 2 --restart starts a new pool" in out
        ), out
        status, out = run(kc, STEP7)
        assert status == "ok", out
        after = {r: pid for r, pid, _ in re.findall(r"\[rank (\d+)\] pid (\d+) world 7 sum (\S+)", out)}
        kept = [before[str(r)] for r in (0, 1, 2, 3, 4, 5, 7)]  # rank 7 is rank 6 now
        assert [after[str(r)] for r in range(7)] == kept, out
        assert len(set(re.findall(r"world 7 sum (\S+)", out))) == 1, out  # one model on every rank
        # then the rest of gpu-node2's ranks go at once (the node's ranks leave): the 4 ranks on
        # gpu-node1 keep their processes and the model, and the pool goes on on one node
        status, out = run(kc, pids.replace("--gpus 8", "--gpus 7"))
        mid = dict(re.findall(r"\[rank (\d+)\] pid (\d+)", out))
        assert status == "ok" and [mid[str(r)] for r in range(7)] == kept, out
        victims = [mid[str(r)] for r in (4, 5, 6)]
        marker = f"/home/alice/.gpuhub-test-node2-{uuid.uuid4().hex}"
        killer = threading.Thread(target=kill_when_there, args=(marker, "gpu-node2", *victims))
        killer.start()
        status, out = run(
            kc,
            hang_cell(7, 4, marker),
        )
        killer.join()
        assert status == "error", out
        assert (
            "The pool shrank in place from 7 to 4 ranks: ranks 4 (GPU gpu-node2:0), 5 (GPU gpu-node2:1), "
            "6 (GPU gpu-node2:3) left"
        ) in out, out
        assert "The world group was re-formed at 4 ranks and answered a collective on every rank." in out
        assert "checked equal on every rank: model." in out, out
        assert "Run the next cells with --gpus 4 --nodes 1." in out, out
        status, out = run(kc, STEP7.replace("--gpus 7 --nodes 2", "--gpus 4 --nodes 1"))
        assert status == "ok", out
        after = {r: pid for r, pid, _ in re.findall(r"\[rank (\d+)\] pid (\d+) world 4 sum (\S+)", out)}
        assert [after[str(r)] for r in range(4)] == kept[:4], out
        assert len(set(re.findall(r"world 4 sum (\S+)", out))) == 1, out
        assert hosts_of(run(kc, HOSTS.format(args="--gpus 4 --nodes 1"))[1]) == ["gpu-node1"] * 4
        status, out = run(kc, HOSTS.format(args="--gpus 8 --nodes 2 --restart"))
        assert status == "ok" and hosts_of(out) == ["gpu-node1"] * 4 + ["gpu-node2"] * 4, out

        # 5. the kernel is shut down (JupyterLab's "Shut Down Kernel"): the engines end on both nodes
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        # the shrunk pool's engines end with its job (scancel at the restart above), the new 8 run
        wait_for(lambda: len(engines_of("alice")) == 8, 60, "only the new pool's 8 engines")
        kc.stop_channels()
        r = hub.api_url_request("DELETE", f"/user/alice/api/kernels/{kid}")
        assert r.status_code == 204, r.text
        wait_for(lambda: not engines_of("alice"), 60, "alice's engines on both nodes to end")
        wait_for(lambda: job_state(burst.backend_job_id) in ("CANCELLED", "COMPLETED", "GONE"), 60, "the job")
        wait_for(lambda: ledger.get(burst.id).state == "released", 60, "the burst to be released")

        # 6. the server stops with a pool still up (no shutdown): nothing is left behind
        kc, kid = kernel_of(hub, "alice")
        status, out = run(kc, HOSTS.format(args="--gpus 2 --nodes 2"))
        assert status == "ok" and hosts_of(out) == ["gpu-node1", "gpu-node2"], out
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        kc.stop_channels()
        hub.stop_server("alice")
        wait_for(
            lambda: job_state(burst.backend_job_id) in ("CANCELLED", "COMPLETED", "GONE"),
            90,
            "the burst job to end",
        )
        wait_for(lambda: ledger.get(burst.id).state == "released", 60, "the burst to be released")
        wait_for(lambda: not engines_of("alice"), 60, "alice's engines to end")
        assert ledger.active(user="alice") == []
    finally:
        ledger.unset_limit("user", "alice")
        ledger.close()
