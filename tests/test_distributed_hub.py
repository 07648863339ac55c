"""End to end through the hub: a server with 1 GPU runs `%%distributed --gpus 2` in its own
kernel (started by the server, as the notebook UI does), which takes a burst from the broker."""

import pytest

from spawner.ledger import Ledger

from .hubtools import Hub, wait_for
from .kerneltools import run_cell as run

pytestmark = pytest.mark.hub


def test_a_server_with_one_gpu_runs_distributed_on_two(tmp_path):
    hub = Hub(tmp_path).start()
    ledger = Ledger(hub.ledger_url)
    try:
        wait_for(
            lambda: hub.broker("GET", "me", hub.user_token("admin")).status_code == 200, 60, "the broker"
        )
        assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
        hub.wait_ready("alice")
        [server_alloc] = ledger.active(user="alice")
        # the server starts the kernel, as JupyterLab would
        kc = hub.server_kernel("alice")

        status, out = run(kc, "%%distributed --gpus 2\nimport os\n(rank, os.environ['CUDA_VISIBLE_DEVICES'])")
        assert status == "ok", out
        assert "2 engines up" in out and "(0," in out
        [burst] = [a for a in ledger.active(user="alice") if a.purpose == "distributed"]
        assert len(burst.gpus) == 2 and not set(burst.gpus) & set(server_alloc.gpus)

        status, out = run(kc, "%gpus")
        assert f"Server allocation #{server_alloc.id}: 1 GPU(s)" in out
        assert f"burst allocation #{burst.id}: 2 GPUs" in out and "rank 1: GPU" in out

        status, out = run(kc, "%distributed shutdown")
        assert "burst GPUs released" in out
        assert ledger.get(burst.id).state == "released"
        assert [a.id for a in ledger.active(user="alice")] == [server_alloc.id]
        kc.stop_channels()
        hub.stop_server("alice")
        assert ledger.active() == []
    finally:
        hub.stop()
        ledger.close()
