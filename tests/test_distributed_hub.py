"""End to end through the hub: a server with 1 GPU runs `%%distributed --gpus 2` in its own
kernel (started by the server, as the notebook UI does): its own GPU and a burst of 1 from the
broker. A 2-GPU server of a user with a limit of 3 resizes its pool: 2 own + 1 burst, a refused
resize that changes nothing, a resize that would discard variables refused, then --restart."""

import ast
import re

import pytest

from .kerneltools import run_cell as run

pytestmark = pytest.mark.hub

# every rank's (rank, GPU, pid), printed by rank 0
GPUS = """%%distributed {args}
import os
got = [None] * world_size
dist.all_gather_object(got, (rank, os.environ["GPUHUB_RANK_GPU"], os.getpid()))
if rank == 0:
    print("RESULT", got)
"""


def result(out: str):
    return ast.literal_eval(re.search(r"\[rank 0\] RESULT (.*)", out).group(1))


@pytest.fixture
def hub(tidy_demo_hub):
    return tidy_demo_hub  # the demo's limits: alice may hold 3


def test_a_server_with_one_gpu_runs_distributed_on_two(hub, ledger):
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    [server_alloc] = ledger.active(user="alice")
    # the server starts the kernel, as JupyterLab would
    kc = hub.server_kernel("alice")

    status, out = run(kc, GPUS.format(args="--gpus 2"))
    assert status == "ok", out
    assert "2 engines up" in out
    # the server's own GPU and one burst GPU beside it, on the same node
    [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
    assert len(burst.gpus) == 1 and not set(burst.gpus) & set(server_alloc.gpus)
    assert {g.node for g in burst.gpus} == {g.node for g in server_alloc.gpus}
    assert [gpu for _, gpu, _ in result(out)] == sorted(g.label for g in [*server_alloc.gpus, *burst.gpus])
    # the engines-up line says which GPU is the server's and which a burst's (not borrowed: in her limit)
    own, extra = server_alloc.gpus[0].label, burst.gpus[0].label
    assert (
        f"2 engines up: rank 0 on {own} (this server's own); rank 1 on {extra} (burst allocation #{burst.id})"
        in out
    ), out

    status, out = run(kc, "%gpus")
    assert f"Server allocation #{server_alloc.id}: 1 GPU," in out
    assert f"burst allocation #{burst.id}: 1 GPU," in out and "rank 1: GPU" in out
    assert "GPU(s)" not in out and "1 GPUs" not in out
    assert re.search(r", lease until \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", out), out  # never ISO "T...Z"

    status, out = run(kc, "%distributed shutdown")
    assert "burst GPUs released" in out
    assert ledger.get(burst.id).state == "released"
    assert [a.id for a in ledger.active(user="alice")] == [server_alloc.id]
    kc.stop_channels()
    hub.stop_server("alice")
    assert ledger.active() == []


def test_resizing_takes_only_the_difference_and_never_loses_work_silently(hub, ledger):
    assert hub.spawn("alice", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("alice")
    [server] = ledger.active(user="alice")
    own = sorted(g.label for g in server.gpus)
    kc = hub.server_kernel("alice")

    def bursts():
        return [a for a in ledger.active(user="alice") if a.purpose == "distributed"]

    # --gpus 3 on 2 own GPUs with a limit of 3: the 2 and a burst of 1 on their node
    status, out = run(kc, GPUS.format(args="--gpus 3") + "model = rank * 10\n")
    assert status == "ok", out
    [burst] = bursts()
    assert burst.gpu_count == 1 and len(burst.gpus) == 1
    assert {g.node for g in burst.gpus} == {g.node for g in server.gpus}
    ranks = result(out)
    assert [gpu for _, gpu, _ in ranks] == sorted([*own, burst.gpus[0].label])
    assert [gpu for _, gpu, _ in ranks[:2]] == own  # ranks 0 and 1 on the server's own
    pids = [pid for _, _, pid in ranks]

    def unchanged():
        status, out = run(kc, GPUS.format(args="--gpus 3") + "print('model', rank, model)\n")
        assert status == "ok", out
        assert [pid for _, _, pid in result(out)] == pids  # the same processes
        assert all(f"[rank {r}] model {r} {r * 10}" in out for r in range(3)), out
        assert [(a.id, a.gpu_count) for a in bursts()] == [(burst.id, 1)]

    # beyond the limit (even with --restart): refused before anything is stopped
    status, out = run(kc, "%%distributed --gpus 5 --restart\n1")
    assert status == "error"
    assert "gpuhub refused 3 more GPUs for %%distributed --gpus 5 (beside this server's 2)" in out, out
    assert "restarting the engines" not in out
    unchanged()

    # another size while the engines hold a variable, without --restart: refused
    status, out = run(kc, "%%distributed --gpus 2\n1")
    assert status == "error"
    assert "the pool holds your variables (got, model)" in out, out
    assert "--restart to discard them" in out and "--autosave NAME... to carry them over" in out
    unchanged()

    # with --restart it goes ahead: fresh engines on the server's own GPUs, the burst back
    status, out = run(kc, GPUS.format(args="--gpus 2 --restart") + "print('fresh', 'model' in dir())\n")
    assert status == "ok", out
    assert "restarting the engines (the cell asked for --restart)" in out
    fresh = result(out)
    assert [gpu for _, gpu, _ in fresh] == own and not {pid for _, _, pid in fresh} & set(pids)
    assert "[rank 0] fresh False" in out
    assert bursts() == [] and ledger.get(burst.id).state == "released"
    run(kc, "%distributed shutdown")
    kc.stop_channels()
    hub.stop_server("alice")
