"""A borrowed burst taken back from a running `%%distributed --autosave` pool, end to end: a real
hub and proxy with 4 simulated GPUs, a real kernel (outside any server: every GPU of its pool
is a burst), real engines (gloo on CPU), a real spawn that waits for the GPUs.

alice (limit 2, may borrow 2) runs a 4-rank pool on a quiet hub: it is held as two bursts, 2
GPUs within her limit and 2 borrowed. bob's in-limit spawn of 2 then waits; the broker gives
notice to the borrowed burst only; alice's running training cell shows the notice, is
interrupted, saves `model` before the due time, stops its engines and releases both bursts (the
borrowed one recorded as preempted, the in-limit one as released by its owner); bob's server
starts; `%distributed restore model` in a new 2-rank pool gives exactly the saved parameters.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from spawner.ledger import Ledger

from .hubtools import Hub, wait_for
from .kerneltools import BrokerKernel
from .test_checkpoint import DIGEST

pytestmark = pytest.mark.hub

CONFIG = """
c.GpuHub.default_limit = 2
c.GpuHub.group_limits = {}
c.GpuHub.user_limits = {}  # the demo's alice may have 3
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = 20
c.GpuHub.queue_keepalive_seconds = 20
"""

DEFINE = """%%distributed --gpus 4 --timeout 30 --autosave model --dir {dir}
import time
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
""" + DIGEST.replace("{", "{{").replace("}", "}}")

# trains until something stops it (at most 240 s: without a preemption the cell just ends)
TRAIN = """%%distributed --gpus 4 --timeout 30
g = torch.Generator().manual_seed(rank)
X = torch.randn(64, 8, generator=g)
y = X.sum(dim=1, keepdim=True)
if rank == 0:
    print("TRAINING", flush=True)
t0 = time.monotonic()
while time.monotonic() - t0 < 240:
    opt.zero_grad()
    ((model(X) - y) ** 2).mean().backward()
    opt.step()
    time.sleep(0.02)
"""

RESTORE = """%%distributed --gpus 2 --timeout 30
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(1)  # other parameters than the saved ones, until restored
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
""" + DIGEST.replace("{", "{{").replace("}", "}}")

PRINT = """%%distributed --gpus 2 --timeout 30
prints = [None] * world_size
dist.all_gather_object(prints, digest(model.module.state_dict()))
if rank == 0:
    print("DIGESTS", prints)
"""


def test_a_borrowed_burst_is_taken_back_from_a_running_pool_which_saves_first(tmp_path):
    hub = Hub(tmp_path, extra_config=CONFIG).start()
    ledger = Ledger(hub.ledger_url)
    kernel = None
    ckpt = tmp_path / "ckpt"
    try:
        hub.wait_for_broker()
        kernel = BrokerKernel(hub, tmp_path, "alice")
        out = kernel.run(
            "%config DistributedMagics.notice_check_seconds = 1\n"
            "%config DistributedMagics.resize_in_place = False"  # the whole pool stops, saved first
        )
        assert out["status"] == "ok", out["text"]
        out = kernel.run(DEFINE.format(dir=ckpt))
        assert out["status"] == "ok", out["text"]
        defined = out["text"]

        # two bursts: 2 GPUs within alice's limit, 2 borrowed beyond it
        held = sorted(ledger.active(user="alice"), key=lambda a: a.borrowed or 0)
        assert [(len(a.gpus), a.borrowed or 0, a.purpose) for a in held] == [
            (2, 0, "distributed"),
            (2, 2, "distributed"),
        ]
        in_limit, borrowed = held
        # the engines-up line says which GPUs are borrowed and may be taken back
        assert f"(burst allocation #{in_limit.id}); rank 2 on " in defined, defined
        assert (
            f"(burst allocation #{borrowed.id}, borrowed beyond your limit: "
            "may be taken back with 20 s notice)" in defined
        ), defined
        out = kernel.run("%gpus")
        assert f"burst allocation #{borrowed.id}: 2 GPUs, 2 borrowed beyond your limit" in out["text"]
        assert f"burst allocation #{in_limit.id}: 2 GPUs, lease" in out["text"]

        spawned = {}

        def bob_asks():  # while alice's cell trains: bob's in-limit spawn waits for her GPUs
            spawned["status"] = hub.spawn("bob", {"gpus": 2}).status_code
            spawned["line"] = hub.wait_progress("bob", "waiting for 2 GPUs")

        out = kernel.run(TRAIN, interrupt_when="TRAINING", then=bob_asks, timeout=240)
        text = out["text"]
        assert spawned["status"] == 202 and "waiting for 2 GPUs" in spawned["line"], spawned
        # the notice, in the running cell's output
        [notice] = [ln for ln in text.splitlines() if "NOTICE:" in ln]
        assert re.search(
            rf"NOTICE: 2 borrowed GPUs of this pool \(allocation #{borrowed.id}\) are taken back at "
            r"\d\d:\d\d:\d\d UTC for another user's request within its limit \(2 GPUs, waiting since ",
            notice,
        ), notice
        assert notice.count("taken back") == 1 and "(in " not in notice and "GPU(s)" not in notice, notice
        assert "interrupting the cell to save model before the borrowed GPUs are taken back" in text
        assert "autosaved before the borrowed GPUs are taken back by 4 ranks (each its own shards" in text
        assert out["status"] == "error" and out["ename"] == "Preempted", text
        assert (
            "Kept: model, saved by 4 ranks (each its own shards of models and optimizers) before the due "
            f"time:\n  model: {ckpt / 'model.dcp'}" in text
        ), text
        assert "Lost: the ranks' other variables: " in text and "opt" in text.split("Lost:")[1]
        assert "The running cell was interrupted" in text
        assert f"allocation #{in_limit.id} (within your limit) was released" in text
        assert f"%distributed restore model --dir {ckpt}" in text
        assert "TRAINING" in text and "Traceback" not in text

        # only the borrowed allocation was preempted; the in-limit one was released by alice
        [p] = ledger.preemptions(user="alice")
        assert p.allocation_id == borrowed.id and p.borrowed == 2 and p.for_user == "bob"
        wait_for(lambda: not ledger.active(user="alice"), 60, "alice's bursts to end")
        ended = ledger.get(borrowed.id)
        assert ended.end_reason.startswith(p.reason)  # the preemption's reason, given back once saved
        assert ended.ended is not None and ended.ended <= p.due + timedelta(seconds=60)
        assert not ledger.get(in_limit.id).end_reason.startswith("preempted")

        # saved within the grace period: the checkpoint was written before the due time
        saved = json.loads((ckpt / "model.dcp" / "gpuhub.json").read_text())
        assert saved["kind"] == "ddp" and saved["world_size"] == 4
        assert saved["saved"] < p.due.timestamp()
        dcp_to_torch_save(ckpt / "model.dcp", tmp_path / "model-one-file.pt")  # as docs/checkpoints.md shows
        saved_state = torch.load(tmp_path / "model-one-file.pt", weights_only=True)

        # bob's spawn starts on the freed GPUs
        hub.wait_ready("bob")
        bobs = {(g.node, g.index) for a in ledger.active(user="bob") for g in a.gpus}
        assert bobs and bobs <= {(g.node, g.index) for g in borrowed.gpus + in_limit.gpus}

        # a new pool within alice's limit gets exactly the saved parameters back
        out = kernel.run(RESTORE)
        assert out["status"] == "ok", out["text"]
        out = kernel.run(f"%distributed restore model --dir {ckpt}")
        assert out["status"] == "ok" and "restored into 2 ranks" in out["text"], out["text"]
        out = kernel.run(PRINT)
        assert out["status"] == "ok", out["text"]
        [line] = [ln for ln in out["text"].splitlines() if "DIGESTS" in ln]
        scope: dict = {"torch": torch}
        exec(DIGEST, scope)
        want = scope["digest"](saved_state)
        assert eval(line.split("DIGESTS", 1)[1]) == [want, want]
    finally:
        if kernel is not None:
            kernel.close()
        ledger.close()
        hub.stop()
