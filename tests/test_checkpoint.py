"""``%distributed save|restore`` and ``--autosave`` through a real kernel ("python3-gpus"), real
ipyparallel engines and real torch.distributed (gloo on CPU). The server's own two (simulated)
GPUs hold the pool: no hub, no broker.

Parameters and optimizer state are compared bit for bit: a digest of every tensor's bytes
(``DIGEST``), and ``torch.equal`` against the file on every rank."""

import os
import re
import select
import signal
import subprocess

import pytest
import torch

from gpu_magics.common.procs import alive as _alive

from .hubtools import wait_for
from .kerneltools import own_gpus_env, run_cell, run_notebook, started_kernel

DIGEST = '''
import hashlib
def digest(obj):
    """sha256 of every tensor's bytes (and every other value's repr), in key order."""
    h = hashlib.sha256()
    def walk(x):
        if isinstance(x, torch.Tensor):
            h.update(str(x.dtype).encode() + str(tuple(x.shape)).encode())
            h.update(bytes(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).tolist()))
        elif isinstance(x, dict):
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())
    walk(obj)
    return h.hexdigest()[:16]
'''

DEFINE = """%%distributed --gpus 2 --timeout 30 {extra}
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed({seed})
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)
""" + DIGEST.replace("{", "{{").replace("}", "}}")

TRAIN = """%%distributed --gpus 2 --timeout 30 {extra}
g = torch.Generator().manual_seed(rank)
X = torch.randn(64, 8, generator=g)
y = X.sum(dim=1, keepdim=True)
for _ in range({steps}):
    opt.zero_grad()
    ((model(X) - y) ** 2).mean().backward()
    opt.step()
    sched.step()
"""

# every rank's digests, printed by rank 0 as one line
PRINTS = """%%distributed --gpus 2 --timeout 30
prints = [None] * world_size
mine = tuple(digest(x.state_dict()) for x in (model.module, opt, sched))
dist.all_gather_object(prints, mine)
if rank == 0:
    print("DIGESTS", prints)
"""


def digests(text: str) -> list:
    import ast

    [found] = re.findall(r"DIGESTS (.*)", text)
    return ast.literal_eval(found)


@pytest.fixture
def kernel_env(tmp_path):
    return own_gpus_env(tmp_path, "t:0,t:1")  # the server's own two GPUs: the pool needs no broker


def test_save_kill_a_rank_restore_bit_identical(kernel_env, tmp_path):
    d = tmp_path / "ck"
    with started_kernel(kernel_env) as (_, kc):

        def cell(code, ok=True):
            status, text = run_cell(kc, code)
            assert (status == "ok") is ok, text
            return text

        cell(DEFINE.format(seed=0, extra=""))
        cell(TRAIN.format(steps=3, extra="") + "steps = 3\nlosses = [0.5, 0.25]")
        before = digests(cell(PRINTS))
        assert before[0] == before[1]  # DDP: the ranks are identical

        saved = cell(f"%distributed save model opt sched steps losses --dir {d}")
        assert f"gpuhub: saved by 2 ranks (each its own shards of models and optimizers) to {d} (" in saved
        for line in (
            "model.dcp",
            "DDP module (torch.nn.parallel.distributed.DistributedDataParallel)",
            "opt.dcp",
            "optimizer (torch.optim.adam.Adam) of model",
            "sched.pt",
            "LR scheduler",
            "steps.pt",
            "value (int)",
            "losses.pt",
        ):
            assert line in saved, (line, saved)
        assert sorted(os.listdir(d)) == ["losses.pt", "model.dcp", "opt.dcp", "sched.pt", "steps.pt"]
        assert os.stat(d).st_mode & 0o777 == 0o700

        # one rank's engine is killed from outside
        status = cell("%distributed status")
        pid = int(re.search(r"rank 1: GPU t:1, pid (\d+)", status).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _alive(pid), 30, "rank 1's engine to die")
        cell("%%distributed --gpus 2 --timeout 30\nsteps", ok=False)  # naming the rank: the test below
        cell("%distributed shutdown")  # (a pool that noticed the lost rank restarts by itself)

        # the definitions re-run (fresh engines, other initial values), then the restore
        fresh = cell(DEFINE.format(seed=1, extra=""))
        assert "2 engines up" in fresh, fresh
        assert int(re.search(r"rank 1: GPU t:1, pid (\d+)", cell("%distributed status")).group(1)) != pid
        assert digests(cell(PRINTS))[0] != before[0]
        cell("%%distributed --gpus 2 --timeout 30\nsteps = None")
        restored = cell(f"%distributed restore model opt sched steps losses --dir {d}")
        assert f"gpuhub: restored into 2 ranks from {d}:" in restored, restored
        assert (
            "model: DDP module" in restored and "dcp.load" in restored and "sched: LR scheduler" in restored
        )
        assert "steps: value (int), assigned" in restored
        assert digests(cell(PRINTS)) == before  # every rank, bit for bit

        # and against the checkpoint, read back with DCP into zeroed copies, on every rank
        check = cell(
            f"""%%distributed --gpus 2 --timeout 30
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.utils._pytree import tree_map
def blank(state):
    return tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t, state)
ms, os_ = get_model_state_dict(model), get_optimizer_state_dict(model, opt)
ck = {{"model": blank(ms), "opt": blank(os_)}}
dcp.load(ck["model"], checkpoint_id="{d}/model.dcp")
dcp.load(ck["opt"], checkpoint_id="{d}/opt.dcp")
same = all(torch.equal(v, ck["model"][k]) for k, v in model.module.state_dict().items())
same &= os_["state"].keys() == ck["opt"]["state"].keys() and all(
    torch.equal(t, ck["opt"]["state"][i][k]) for i, s in os_["state"].items() for k, t in s.items())
same &= steps == 3 and losses == [0.5, 0.25] and sched.last_epoch == 3
gathered = [None] * world_size
dist.all_gather_object(gathered, same)
if rank == 0:
    print("SAME", gathered)
"""
        )
        assert "SAME [True, True]" in check, check
        # training goes on from the restored state, the ranks identical
        cell(TRAIN.format(steps=1, extra=""))
        after = digests(cell(PRINTS))
        assert after[0] == after[1] and after[0] != before[0]


def test_a_rank_killed_between_cells_is_named_and_the_pool_restarts(kernel_env):
    """With resizing in place off (tests/test_shrink_lost.py has it on)."""
    with started_kernel(kernel_env) as (_, kc):
        assert run_cell(kc, "%config DistributedMagics.resize_in_place = False")[0] == "ok"
        assert run_cell(kc, "%%distributed --gpus 2\nx = 1")[0] == "ok"
        pid = int(re.search(r"rank 1: GPU t:1, pid (\d+)", run_cell(kc, "%distributed status")[1]).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: _exited(pid), 30, "rank 1's engine to die")
        status, text = run_cell(kc, "%%distributed --gpus 2\nx")
        assert status == "error" and "rank 1 (" in text and "is gone" in text and "Lost" in text, text
        status, text = run_cell(kc, "%%distributed --gpus 2\nrank")
        assert status == "ok" and "restarting the engines" in text, text


def _exited(pid: int) -> bool:
    """The whole process has ended, as its pidfd tells (what the pool checks before a cell): a
    killed process's first thread shows as a zombie while its other threads still end."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], 0)[0])
    finally:
        os.close(fd)


def _load_digests(directory, tmp_path) -> tuple:
    """The model's and the scheduler's digests as saved (the model's DCP checkpoint made one
    torch.save file, as docs/checkpoints.md shows)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ns = {"torch": torch}
    exec(DIGEST, ns)
    dcp_to_torch_save(f"{directory}/model.dcp", tmp_path / "model-one-file.pt")
    model = torch.load(tmp_path / "model-one-file.pt", weights_only=True)
    sched = torch.load(f"{directory}/sched.pt", weights_only=True)["state"]
    return ns["digest"](model), ns["digest"](sched)


def test_autosave_before_the_idle_stop_the_shutdown_and_kernel_exit(kernel_env, tmp_path):
    d, at_exit = tmp_path / "auto", tmp_path / "exit"
    wait_stop = f"""import os, time
magics = get_ipython().magics_manager.registry["DistributedMagics"]
deadline = time.monotonic() + 60
while (magics.pool is not None or not os.path.exists("{d}/sched.pt")) and time.monotonic() < deadline:
    time.sleep(0.1)
print("STOPPED", magics.pool is None, sorted(os.listdir("{d}")))
"""
    autosave = f"--autosave model opt sched --dir {d}"
    cells = run_notebook(
        [
            "%config DistributedMagics.idle_seconds = 2",
            DEFINE.format(seed=0, extra=autosave),
            TRAIN.format(steps=3, extra=""),
            PRINTS,
            wait_stop,  # 3: the idle stop saves
            "%config DistributedMagics.idle_seconds = 1800",
            "%distributed status",
            DEFINE.format(seed=1, extra=""),  # 7: a new pool
            f"%distributed restore model opt sched --dir {d}",
            PRINTS,
            TRAIN.format(steps=2, extra=autosave),  # 10
            PRINTS,
            "%distributed shutdown",  # 12: saves
            DEFINE.format(seed=2, extra=""),
            f"%distributed restore model opt sched --dir {d}",
            PRINTS,
            TRAIN.format(steps=1, extra=f"--autosave model opt sched --dir {at_exit}"),  # 16
            PRINTS,
            "%distributed status",
        ],
        kernel_env,
        timeout=180,
    )
    for i, c in enumerate(cells):
        assert c.error is None, (i, c)
    assert f"gpuhub: autosave of model, opt, sched to {d} before the engines stop" in cells[1].shown
    trained = digests(cells[3].stdout)
    stopped = cells[3].stdout + cells[4].stdout
    assert "idle for 2 s; stopping them" in stopped, stopped
    assert (
        "gpuhub: autosaved before the idle stop by 2 ranks (each its own shards of models and optimizers) "
        f"to {d}" in stopped
    ), stopped
    assert "STOPPED True ['model.dcp', 'opt.dcp', 'sched.pt']" in cells[4].stdout
    assert "engines: none" in cells[6].stdout and "autosave" not in cells[6].stdout  # forgotten
    assert digests(cells[9].stdout) == trained  # restored into a new pool
    more = digests(cells[11].stdout)
    assert more != trained
    assert (
        "gpuhub: autosaved before %distributed shutdown by 2 ranks (each its own shards of models and "
        f"optimizers) to {d}" in cells[12].shown
    )
    assert "engines stopped" in cells[12].stdout
    assert digests(cells[15].stdout) == more
    last = digests(cells[17].stdout)
    assert f"autosave: model, opt, sched to {at_exit}" in cells[18].stdout
    # the notebook ended: kernel shutdown saved the last pool's state
    assert _load_digests(at_exit, tmp_path) == (last[0][0], last[0][2])
    assert not [f for f in os.listdir(d) + os.listdir(at_exit) if f.endswith(".tmp")]


@pytest.fixture
def small_and_readonly(tmp_path):
    """A full disk (a 64 KiB tmpfs) and a read-only one: root passes any mode bits."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir()
    ro.mkdir()
    mounted = []
    try:
        for path, opts in ((full, "size=64k,mode=0700"), (ro, "size=64k,ro")):
            r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
            if r.returncode:
                pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
            mounted.append(path)
        yield full, ro
    finally:
        for path in mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def test_bad_input_is_a_usage_error_and_writes_nothing(kernel_env, tmp_path, small_and_readonly):
    full, ro = small_and_readonly
    d = tmp_path / "ck"
    cells = run_notebook(
        [
            "%distributed save model",  # 0: no pool yet
            """%%distributed --gpus 2
import torch.nn as nn
model = nn.Linear(4, 4)
big = torch.zeros(100_000)
f = lambda x: x
gen = (i for i in range(3))
fh = open("/etc/hostname")
if rank == 0:
    only0 = 1
""",
            f"%distributed save model only0 --dir {d}",  # 2
            f"%distributed save nothere --dir {d}",
            f"%distributed save model f --dir {d}",  # 4
            f"%distributed save gen --dir {d}",
            f"%distributed save fh --dir {d}",  # 6
            f"%distributed save big --dir {full}",
            f"%distributed save model --dir {ro}",  # 8
            "%distributed save ../model",
            f"%distributed restore model --dir {d}",  # 10
            "%distributed save model",  # the default directory
            "%%distributed --gpus 2 --targets 1\ndel model",  # 12
            "%distributed restore model",
            f"%%distributed --gpus 2 --dir {d}\n1",  # 14
            "%distributed status --dir /tmp",
            "%%distributed --gpus 2\nmodel = nn.Linear(4, 5)",  # 16
            "%distributed restore model",
        ],
        kernel_env,
    )
    errors = {i: c.stderr for i, c in enumerate(cells) if "UsageError" in c.stderr}
    assert sorted(errors) == [0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 13, 14, 15, 17], {
        i: (c.stdout, c.stderr) for i, c in enumerate(cells)
    }
    assert "save: no engines are running: start them with a %%distributed cell" in errors[0]
    assert "save: 'only0' is not defined on rank 1. Nothing was written" in errors[2]
    assert "save: 'nothere' is not defined on any rank." in errors[3]
    assert "save: cannot save 'f' (a function): " in errors[4] and "Nothing was written" in errors[4]
    assert "cannot save 'gen' (a generator): TypeError: cannot pickle 'generator' object" in errors[5]
    assert "cannot save 'fh' (a _io.TextIOWrapper)" in errors[6]
    assert f"save: no space left for {full}/big.pt (No space left on device)" in errors[7]
    assert f"save: cannot write to {ro} (Read-only file system)" in errors[8]
    assert "'../model' is not a name" in errors[9]
    assert f"restore: 'model': no checkpoint {d}/model.dcp or {d}/model.pt" in errors[10]
    assert f"Checkpoints in {d}: none." in errors[10]
    default = tmp_path / "home/.local/share/gpuhub/checkpoints"
    assert f"saved by 2 ranks (each its own shards of models and optimizers) to {default}" in cells[11].shown
    assert os.stat(default).st_mode & 0o777 == 0o700 and os.listdir(default) == ["model.dcp"]
    assert (
        "restore: 'model' (on rank 1): is not defined: re-run the cell that defines the module (same layers "
        "as saved) first, then restore" in errors[13]
    )
    assert "--dir goes with --autosave" in errors[14]
    assert "NAME... and --dir go with %distributed save|restore" in errors[15]
    assert "the checkpoint does not fit this module" in errors[17] and "Nothing was restored" in errors[17]
    # nothing half-written anywhere, not even a temporary file
    assert not d.exists() or os.listdir(d) == []
    assert os.listdir(full) == [] and os.listdir(ro) == []


def test_a_resize_with_autosave_carries_the_objects_over(kernel_env, tmp_path):
    d = tmp_path / "resize"
    kernel_env["GPUHUB_GPUS"] = "t:0,t:1,t:2"
    three = lambda code: code.replace("--gpus 2", "--gpus 3")  # noqa: E731
    cells = run_notebook(
        [
            # a restart with autosave, not the growth in place (tests/test_grow.py)
            "%config DistributedMagics.resize_in_place = False",
            DEFINE.format(seed=0, extra=f"--autosave model w --dir {d}") + "w = torch.arange(4.0) + 0.5\n",
            TRAIN.format(steps=2, extra=""),
            PRINTS,
            three('%%distributed --gpus 2 --timeout 30\nprint("W", w.tolist(), "model" in dir())'),  # 4
            three(DEFINE.format(seed=1, extra="")),  # the definitions re-run on 3 ranks
            "%distributed status",  # 6
            f"%distributed restore model --dir {d}",
            three(PRINTS),  # 8
            "%distributed status",
        ],
        kernel_env,
        timeout=180,
    )
    for i, c in enumerate(cells):
        assert c.error is None, (i, c)
    trained = digests(cells[3].stdout)[0][0]  # the model's
    resize = cells[4].shown
    # a resize says what a user needs in three lines, before the user's own output
    before_users = resize[: resize.index("[rank ")].splitlines()
    assert len(before_users) == 3, resize
    assert before_users[0].startswith(
        f"gpuhub: restarting the engines (the pool had other settings): model, w autosaved to {d} ("
    ), resize
    assert before_users[1].startswith("3 engines up: rank 0 on t:0"), resize
    assert before_users[2] == (
        f"gpuhub: w restored into the 3 new ranks from {d}; not yet model (DDP module): re-run the "
        f"cells that define it, then %distributed restore model --dir {d} (autosave leaves it out "
        "until then)."
    ), resize
    # each as text and as HTML that wraps at spaces only (JupyterLab breaks stream text anywhere)
    html = [o["data"]["text/html"] for o in cells[4].outputs if "text/html" in o.get("data", {})]
    assert len(html) == 3 and all("word-break: normal" in h for h in html), cells[4].outputs
    assert cells[4].rank_lines() == {r: ["W [0.5, 1.5, 2.5, 3.5] False"] for r in range(3)}
    assert "autosave: model, w" in cells[6].stdout
    assert "restored into 3 ranks" in cells[7].shown
    assert [m for m, _, _ in digests(cells[8].stdout)] == [trained] * 3  # every rank, bit for bit
