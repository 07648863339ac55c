"""GPU slices on the Slurm backend (issue 34), end to end on the real test cluster: a real hub
and proxy with ``c.GpuHub.gpu_slices = {"a100": 4}`` over Slurm's ``gres/shard`` (4 per fake
GPU, ``scripts/slurm-cluster``).

Two students start 1/4-GPU servers: Slurm runs each as a shard job on the one GPU of gpu-node1
that alice's whole GPUs leave, and the ledger gives each its own part of that GPU. Their
associations carry their limits in shards. A whole GPU asked for on that node waits in Slurm's
queue while the shards are in use; when one of the two slices ends, Slurm 22.05.8 gives the
whole GPU beside the other (``tests/test_slurm_shards.py`` pins that fault): gpuhub never
records it, ends that job and tells its owner why, and the slice keeps running. Once the last
slice ends, the whole GPU starts there.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from spawner.ledger import Ledger

from . import slurmtools, wskernel
from .hubtools import wait_for, xsrf_from
from .kerneltools import run_cell
from .slurmtools import job_state, slurm

pytestmark = pytest.mark.hub
NODE = "gpu-node1"  # the interactive partition's one node
START_TIMEOUT = 30


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    config = "\n".join([
        "c.JupyterHub.cleanup_servers = False",
        'c.GpuHub.gpu_slices = {"a100": 4}',
        "c.GpuSlurmSpawner.cpus_per_gpu = 1",  # the node's 8 CPUs are never what a job waits for
        f"c.Spawner.start_timeout = {START_TIMEOUT}",  # the server's own start; Slurm's queue waits longer
    ])  # fmt: skip
    with slurmtools.slurm_hub(tmp_path_factory.mktemp("slurm-slices-hub"), config) as h:
        yield h
    for user in slurmtools.USERS:  # the shard limits this hub wrote are no other hub's
        slurm("sacctmgr", "-i", "modify", "user", "where", f"name={user}", "account=gpuhub", "set",
              "GrpTRES=gres/shard=-1", check=False)  # fmt: skip


@pytest.fixture
def ledger(hub):
    led = Ledger(hub.ledger_url)
    yield led
    led.close()


def slice_of(ledger, user):
    [a] = ledger.active(user=user)
    return a


def tres(job: str) -> str:
    jobs = json.loads(slurm("squeue", "--json").stdout)["jobs"]  # 22.05's --json lists every job
    [raw] = [j for j in jobs if str(j["job_id"]) == job]
    return raw.get("tres_per_node") or ""


def shard_limit(user: str) -> str:
    return slurm("sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=grptres").stdout.strip()


def test_two_students_share_a_gpu_in_shards_and_a_whole_gpu_never_lands_beside_them(hub, ledger):
    # alice (limit 3) holds three of gpu-node1's four GPUs
    assert hub.spawn("alice", {"gpus": 3, "partition": "interactive"}).status_code in (201, 202)
    hub.wait_ready("alice", timeout=120)
    alice = {g.label for g in slice_of(ledger, "alice").gpus}
    [last] = {f"{NODE}:{i}" for i in range(4)} - alice

    # bob and carol (students) take a quarter each: both on the last GPU, each its own part.
    # bob through the REST API; carol on the spawn form, which offers the slice and says what
    # Slurm's shards do not divide
    r = hub.spawn("bob", {"gpu_share": "1/4", "partition": "interactive"})
    assert r.status_code in (201, 202), r.text
    browser = hub.login("carol")
    page = browser.get(f"{hub.url}/hub/spawn")
    assert re.search(r"1/4 GPU of a100 \(\d+ of 32 free\)", page.text), page.text  # 8 GPUs in quarters
    assert "nothing divides its memory or compute" in page.text and "CUDA MPS" not in page.text
    form = {"gpus": "1", "gpu_share": "1/4", "partition": "interactive", "_xsrf": xsrf_from(page.text)}
    r = browser.post(f"{hub.url}/hub/spawn", data=form)
    assert r.status_code == 200 and "/spawn-pending/carol" in r.url, (r.status_code, r.url)
    for user in ("bob", "carol"):
        hub.wait_ready(user, timeout=120)
    slices = {u: slice_of(ledger, u) for u in ("bob", "carol")}
    assert {u: [(g.whole.label, g.parts) for g in a.gpus] for u, a in slices.items()} == {
        "bob": [(last, 4)],
        "carol": [(last, 4)],
    }
    assert sorted(a.gpus[0].part for a in slices.values()) == [1, 2]
    assert ledger.allowance("bob", ["students"]).held == pytest.approx(0.25)
    for user, a in slices.items():
        assert tres(a.backend_job_id) == "gres:shard:a100:1"  # Slurm's shard, not a whole GPU
        env = slurmtools.process_environ(hub.server_pid(user))
        assert f"{env['SLURMD_NODENAME']}:{env['SLURM_JOB_GPUS']}" == last
        assert env["SLURM_SHARDS_ON_NODE"] == "1" and env["GPUHUB_GPU_SLICE"] == "1/4"
        # their limit (students: 2 GPUs) reaches Slurm in shards too: 4 per GPU
        assert "gres/gpu=2" in shard_limit(user) and "gres/shard=8" in shard_limit(user)

    # bob's kernel says what he holds
    kc, _ = wskernel.server_kernel(hub, "bob")
    try:
        status, out = run_cell(kc, "%gpus")
        assert status == "ok", out
        assert (
            f"Server allocation #{slices['bob'].id}: a 1/4 slice of GPU {last} ({last}), its memory not "
            "divided (Slurm's shards fence no memory between their jobs)" in out
        ), out
    finally:
        kc.stop_channels()

    # dave asks for a whole GPU of that node: none is whole there; he waits in Slurm's queue
    assert hub.spawn("dave", {"gpus": 1, "partition": "interactive"}).status_code == 202
    hub.wait_progress("dave", "Queued in Slurm")
    [dave] = ledger.active(user="dave")
    assert dave.gpus == () and job_state(dave.backend_job_id) == "PENDING"
    # a wait in Slurm's queue longer than start_timeout is a wait, not a failed start: the
    # timeout counts from when Slurm runs the job (c.GpuHub.queue_max_wait_hours bounds the wait)
    time.sleep(START_TIMEOUT + 5)
    assert job_state(dave.backend_job_id) == "PENDING" and ledger.get(dave.id).state == "starting"
    assert hub.server("dave") is not None and hub.server("dave")["pending"] == "spawn"

    # carol stops. Slurm 22.05.8 now starts dave's job on the GPU bob's slice still runs on;
    # gpuhub does not record it (nothing double-booked), ends the job and says why
    hub.stop_server("carol")
    failed = hub.wait_progress("dave", "Slurm gave this job a GPU that another job still holds", timeout=120)
    assert "It was ended before your server answered: no work ran there. Start again." in failed
    assert f"job {slices['bob'].backend_job_id} of bob" in failed
    wait_for(lambda: ledger.get(dave.id).state == "released", 60, "dave's allocation to end")
    assert ledger.get(dave.id).gpus == ()  # never held, not even for a moment
    wait_for(lambda: job_state(dave.backend_job_id) in ("CANCELLED", "COMPLETED", "GONE"), 60, "dave's job")
    bob = slice_of(ledger, "bob")
    assert bob.state == "running" and [(g.whole.label, g.part) for g in bob.gpus] == [
        (last, slices["bob"].gpus[0].part)
    ]

    # bob stops: the GPU is whole again, and dave's next start gets it
    hub.stop_server("bob")
    wait_for(lambda: not ledger.active(user="bob"), 60, "bob's slice to end")
    r = hub.spawn("dave", {"gpus": 1, "partition": "interactive"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("dave", timeout=120)
    assert [(g.label, g.part) for g in slice_of(ledger, "dave").gpus] == [(last, 0)]
    for user in ("alice", "dave"):
        hub.stop_server(user)
