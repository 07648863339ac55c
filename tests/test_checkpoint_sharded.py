"""Checkpoints of sharded state through ``torch.distributed.checkpoint``: a real kernel
("python3-gpus"), real ipyparallel engines, real torch.distributed (gloo on CPU), FSDP2's
``fully_shard`` and DDP side by side in the same pools.

Parameters are compared bit for bit: a digest of every full parameter's bytes
(``DTensor.full_tensor()`` for FSDP2), gathered from every rank. "The next step equals a
reference": after a restore, a second model of the same pool gets the saved state through
torch's own full-state API (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
``full_state_dict=True``, from a file of ``get_*_state_dict(full_state_dict=True)`` written before
the save); both take one training step on the same data, and their full parameters must be
equal bytes."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpu_magics.common.procs import alive as _alive

from .hubtools import wait_for
from .kerneltools import own_gpus_env, run_cell, started_kernel

ROOT = Path(__file__).resolve().parent.parent
GOLDEN_V1 = ROOT / "tests/golden/checkpoint-v1"

HELPERS = '''
import hashlib
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict)

def layers(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

def sharded(seed):
    m = layers(seed)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)

def full(m):
    """Every parameter's full tensor (an FSDP2 shard's DTensor gathered)."""
    out = {}
    for k, v in get_model_state_dict(m).items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out

def digest(m):
    h = hashlib.sha256()
    for k, v in sorted(full(m).items()):
        h.update(k.encode() + str(tuple(v.shape)).encode())
        h.update(bytes(v.contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()[:16]

def train(m, o, steps=1, seed=7):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    for _ in range(steps):
        X = torch.randn(32, 8, generator=g)
        o.zero_grad()
        ((m(X) - X[:, :4]) ** 2).mean().backward()
        o.step()

def both():
    """The digests of every rank, gathered: {name: [rank 0's, rank 1's, ...]}."""
    mine = {n: digest(globals()[n]) for n in ("fm", "dm")}
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    return {n: [e[n] for e in every] for n in mine}

def write_reference(path):
    """The full state of both models and optimizers, torch's own way, for the reference run."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ref = {n: (get_model_state_dict(globals()[n], options=opts),
               get_optimizer_state_dict(globals()[n], globals()[o], options=opts))
           for n, o in (("fm", "fo"), ("dm", "do"))}
    if rank == 0:
        torch.save(ref, path)

def reference(path):
    """Fresh models and optimizers given the full state of ``path`` through torch's API."""
    ref = torch.load(path, weights_only=True)
    opts = StateDictOptions(full_state_dict=True)
    made = {}
    for n, build in (("fm", lambda: sharded(5)), ("dm", lambda: DDP(layers(5)))):
        m = build()
        o = torch.optim.Adam(m.parameters(), lr=0.01)
        set_model_state_dict(m, ref[n][0], options=opts)
        set_optimizer_state_dict(m, o, ref[n][1], options=opts)
        made[n] = (m, o)
    return made
'''


def define(world: int, seed: int) -> str:
    return f"""%%distributed --gpus {world} --timeout 60
{HELPERS}
fm = sharded({seed})
fo = torch.optim.Adam(fm.parameters(), lr=0.01)
dm = DDP(layers({seed}))
do = torch.optim.Adam(dm.parameters(), lr=0.01)
"""


def cell_of(world: int, code: str) -> str:
    return f"%%distributed --gpus {world} --timeout 60\n" + textwrap.dedent(code)


def gathered(text: str, tag: str):
    import ast

    [found] = re.findall(rf"{tag} (.*)", text)
    return ast.literal_eval(found)


@pytest.fixture
def kernel_env(tmp_path):
    return own_gpus_env(tmp_path, "t:0,t:1,t:2,t:3")  # the server's own four GPUs: no broker


def _cell(kc, code, ok=True):
    status, text = run_cell(kc, code)
    assert (status == "ok") is ok, text
    return text


def _check_reference_step(kc, world: int, ref: Path) -> dict:
    """After a restore: the restored models and the reference take one step; equal bytes on
    every rank. Answers the restored models' digests after the step."""
    out = _cell(
        kc,
        cell_of(
            world,
            f"""
            made = reference("{ref}")
            train(fm, fo)
            train(dm, do)
            for n, (m, o) in made.items():
                train(m, o)
            mine = {{n: (digest(globals()[n]), digest(m)) for n, (m, o) in made.items()}}
            every = [None] * world_size
            dist.all_gather_object(every, mine)
            if rank == 0:
                print("STEPPED", every)
            """,
        ),
    )
    every = gathered(out, "STEPPED")
    assert len(every) == world
    for n in ("fm", "dm"):
        ours = {e[n][0] for e in every}
        theirs = {e[n][1] for e in every}
        assert len(ours) == 1 and ours == theirs, (n, every)  # every rank; equal to the reference
    return {n: every[0][n][0] for n in ("fm", "dm")}


def test_sharded_and_ddp_checkpoints_reshard_2_to_4_to_2_bit_for_bit(kernel_env, tmp_path):
    d, ref_a, ref_b = tmp_path / "ck", tmp_path / "ref-a.pt", tmp_path / "ref-b.pt"
    with started_kernel(kernel_env) as (_, kc):
        # 2 ranks: train, remember, save
        _cell(kc, define(2, 0))
        out = _cell(
            kc,
            cell_of(
                2,
                f"""
                train(fm, fo, 2)
                train(dm, do, 2)
                steps = 2
                write_reference("{ref_a}")
                d = both()
                if rank == 0:
                    print("DIGESTS", d)
                """,
            ),
        )
        on_two = gathered(out, "DIGESTS")
        assert len(set(on_two["fm"])) == 1 and len(set(on_two["dm"])) == 1  # the full parameters agree
        saved = _cell(kc, f"%distributed save fm fo dm do steps --dir {d}")
        assert f"gpuhub: saved by 2 ranks (each its own shards of models and optimizers) to {d} (" in saved
        for line in (
            "fm.dcp",
            "sharded module (FSDP2)",
            "fo.dcp",
            "optimizer (torch.optim.adam.Adam) of fm",
            "dm.dcp",
            "DDP module (torch.nn.parallel.distributed.DistributedDataParallel)",
            "optimizer (torch.optim.adam.Adam) of dm",
            "steps.pt",
        ):
            assert line in saved, (line, saved)
        assert sorted(os.listdir(d)) == ["dm.dcp", "do.dcp", "fm.dcp", "fo.dcp", "steps.pt"]  # no temporary
        # each FSDP2 rank wrote its own shard file
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "gpuhub.json"} <= set(os.listdir(d / "fm.dcp"))
        meta = json.loads((d / "fo.dcp/gpuhub.json").read_text())
        assert meta["kind"] == "optimizer" and meta["model"] == "fm" and meta["world_size"] == 2

        # a plain program reads it with DCP's documented API (docs/checkpoints.md's snippet)
        _plain_program_reads(d, on_two["fm"][0], tmp_path)

        # 4 ranks: fresh objects, then the restore reshards
        _cell(kc, "%distributed shutdown")
        _cell(kc, define(4, 1))
        restored = _cell(kc, f"%distributed restore fm fo dm do steps --dir {d}")
        assert "gpuhub: restored into 4 ranks from" in restored, restored
        assert (
            "fm: sharded module (FSDP2)" in restored and "dcp.load, resharded from 2 to 4 ranks" in restored
        )
        assert "saved " in restored and "by 2 ranks" in restored
        out = _cell(
            kc, cell_of(4, 'd = both()\nif rank == 0:\n    print("DIGESTS", d)\n    print("STEPS", steps)')
        )
        assert "STEPS 2" in out, out
        # every rank's full parameters: the saved bytes
        assert gathered(out, "DIGESTS") == {n: [v[0]] * 4 for n, v in on_two.items()}
        after_step = _check_reference_step(kc, 4, ref_a)

        # save on 4 (over the checkpoint of 2: replaced whole), back to 2
        _cell(kc, cell_of(4, f'write_reference("{ref_b}")'))
        saved = _cell(kc, f"%distributed save fm fo dm do --dir {d}")
        assert "saved by 4 ranks" in saved, saved
        assert {"__3_0.distcp"} <= set(os.listdir(d / "fm.dcp"))
        assert sorted(os.listdir(d)) == ["dm.dcp", "do.dcp", "fm.dcp", "fo.dcp", "steps.pt"]
        _cell(kc, "%distributed shutdown")
        _cell(kc, define(2, 2))
        restored = _cell(kc, f"%distributed restore fm fo dm do --dir {d}")
        assert "resharded from 4 to 2 ranks" in restored, restored
        out = _cell(kc, cell_of(2, 'd = both()\nif rank == 0:\n    print("DIGESTS", d)'))
        assert gathered(out, "DIGESTS") == {n: [v] * 2 for n, v in after_step.items()}
        _check_reference_step(kc, 2, ref_b)


# the snippet of docs/checkpoints.md that a plain program runs (the test runs it as written)
def _doc_snippet() -> str:
    text = (ROOT / "docs/checkpoints.md").read_text()
    [code] = re.findall(r"<!-- plain-program -->\n```python\n(.*?)```", text, re.S)
    return code


def _plain_program_reads(d: Path, want: str, tmp_path: Path) -> None:
    """docs/checkpoints.md's snippet, in a fresh interpreter without any process group: the
    sharded model's checkpoint loads into a plain model with ``dcp.load(..., no_dist=True)``,
    and ``dcp_to_torch_save`` makes one ``torch.save`` file of it; both the saved bytes."""
    program = f"""
import hashlib
CHECKPOINT = {str(d / "fm.dcp")!r}
ONE_FILE = {str(tmp_path / "fm.pt")!r}
{_doc_snippet()}
def digest(state):
    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode() + str(tuple(v.shape)).encode())
        h.update(bytes(v.contiguous().reshape(-1).view(torch.uint8).tolist()))
    return h.hexdigest()[:16]
print("LOADED", digest(model.state_dict()), digest(torch.load(ONE_FILE, weights_only=True)))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    out = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"LOADED {want} {want}" in out.stdout, (out.stdout, out.stderr[-2000:])


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 256 KiB (a tmpfs), to fill up and to remount read-only: root
    passes any mode bits, so an unwritable directory must be a read-only file system."""
    path = tmp_path / "small"
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(path)], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory: Path, leave: int) -> Path:
    """Fill the file system of ``directory`` (ENOSPC from the kernel), then give back ``leave`` bytes."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError as e:
            assert e.errno == 28, e
        f.truncate(max(0, f.tell() - leave))
    return filler


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


DIGESTS_CELL = 'd = both()\nif rank == 0:\n    print("DIGESTS", d)'

KILL_RANK_1_MID_SAVE = """
if rank == 1:  # write this rank's shard, then die before the save is done
    import os, signal
    from torch.distributed.checkpoint import filesystem
    _real_write = filesystem._write_files_from_queue
    def _write_then_die(*args, **kwargs):
        _real_write(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    filesystem._write_files_from_queue = _write_then_die
"""


def test_a_failed_save_leaves_the_previous_checkpoint_and_errors_say_what_to_do(
    kernel_env, tmp_path, small_disk
):
    small, d, old = small_disk, tmp_path / "ck", tmp_path / "old"
    import shutil

    shutil.copytree(GOLDEN_V1, old)
    with started_kernel(kernel_env) as (_, kc):
        _cell(kc, define(2, 0))
        out = _cell(kc, cell_of(2, "train(fm, fo, 2)\ntrain(dm, do, 2)\n" + DIGESTS_CELL))
        first = gathered(out, "DIGESTS")
        assert "saved by 2 ranks" in _cell(kc, f"%distributed save fm fo --dir {small}")
        assert "saved by 2 ranks" in _cell(kc, f"%distributed save fm fo dm do --dir {d}")
        kept = _tree(small)
        assert sorted(os.listdir(small)) == ["fm.dcp", "fo.dcp"]

        # a full disk: the temporary directory goes, the previous checkpoint stays
        _cell(kc, cell_of(2, "train(fm, fo)"))
        filler = _fill(small, leave=2 * 4096)
        full = _cell(kc, f"%distributed save fm fo --dir {small}", ok=False)
        assert (
            f"save: no space left for {small}/fm.dcp (No space left on device). Nothing was written" in full
        )
        assert "Traceback" not in full and "[rank" not in full, full
        assert sorted(os.listdir(small)) == ["filler", "fm.dcp", "fo.dcp"]
        filler.unlink()
        assert _tree(small) == kept

        # a directory that cannot be written
        subprocess.run(["mount", "-o", "remount,ro", str(small)], check=True)
        try:
            ro = _cell(kc, f"%distributed save fm fo --dir {small}", ok=False)
            assert f"save: cannot write to {small} (Read-only file system). Nothing was written" in ro, ro
            assert _tree(small) == kept
            # the previous checkpoint restores bit for bit (read from the read-only disk)
            assert "dcp.load" in _cell(kc, f"%distributed restore fm fo --dir {small}")
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(small)], check=True)
        assert gathered(_cell(kc, cell_of(2, DIGESTS_CELL)), "DIGESTS")["fm"] == first["fm"]

        # what a user gets wrong is said with what to do, never a traceback per rank
        no_model = _cell(kc, f"%distributed save fo --dir {d}", ok=False)
        assert (
            "save: 'fo' is an optimizer whose model is not saved with it, and its state is kept by the "
            "model's parameter names. Nothing was written: save the model with it: %distributed save fm fo."
        ) in no_model, no_model
        _cell(kc, cell_of(2, "del dm"))
        undefined = _cell(kc, f"%distributed restore dm --dir {d}", ok=False)
        assert (
            "restore: 'dm': is not defined: re-run the cell that defines the module (same layers as saved) "
            "first, then restore\nNothing was restored." in undefined
        ), undefined
        _cell(
            kc,
            cell_of(
                2,
                "dm = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.ReLU(), "
                "nn.Linear(5, 2)))",
            ),
        )
        other = _cell(kc, f"%distributed restore dm --dir {d}", ok=False)
        assert (
            "restore: 'dm': the checkpoint does not fit this module (yours has 4.weight, 4.bias, not in the "
            "checkpoint; 2.weight saved (4, 16), yours (5, 16); 2.bias saved (4,), yours (5,)): define dm "
            "as it "
            "was saved (same layers) in a cell, then restore\nNothing was restored." in other
        ), other
        for text in (undefined, other, no_model):
            assert "Traceback" not in text and "[rank" not in text, text

        # gpuhub's first format (one file per name) still restores, into FSDP2 and into DDP
        _cell(kc, cell_of(2, "model = sharded(9)\nopt = torch.optim.Adam(model.parameters(), lr=0.01)"))
        refused = _cell(kc, f"%distributed restore model opt steps --dir {old}", ok=False)
        assert (
            "'opt': is an optimizer of a sharded model, and this checkpoint is of gpuhub's first format"
            in refused
        )
        restored = _cell(kc, f"%distributed restore model steps --dir {old}")
        assert "model: module (torch.nn.modules.container.Sequential), load_state_dict" in restored, restored
        same = f"""
        ck = {{n: torch.load("{old}/" + n + ".pt", weights_only=True)["state"] for n in ("model", "opt")}}
        same = all(torch.equal(v, ck["model"][k]) for k, v in full(model).items()) and steps == 2
        every = [None] * world_size
        dist.all_gather_object(every, same)
        if rank == 0:
            print("SAME", every)
        """
        assert "SAME [True, True]" in _cell(kc, cell_of(2, same))
        _cell(kc, cell_of(2, "model = DDP(layers(9))\nopt = torch.optim.Adam(model.parameters(), lr=0.01)"))
        assert "opt: optimizer" in _cell(kc, f"%distributed restore model opt --dir {old}")
        same_opt = same.replace(
            "and steps == 2",
            'and all(torch.equal(t, ck["opt"]["state"][i][k]) for i, s in opt.state_dict()["state"].items() '
            "for k, t in s.items())",
        )
        assert "SAME [True, True]" in _cell(kc, cell_of(2, same_opt))

        # a rank killed mid-save (after writing its shard): nothing is visible, the old one restores
        before = _tree(d)
        _cell(kc, cell_of(2, "train(fm, fo)\n" + KILL_RANK_1_MID_SAVE))
        killed = _cell(kc, f"%distributed save fm fo --dir {d}", ok=False)
        assert (
            "save: rank 1's engine process ended (killed?) before it finished. Nothing was written; "
            in killed
        )
        assert f"the checkpoints in {d} are as they were. The pool lost rank 1" in killed, killed
        assert _tree(d) == before and sorted(os.listdir(d)) == ["dm.dcp", "do.dcp", "fm.dcp", "fo.dcp"]
        _cell(kc, "%distributed shutdown")
        _cell(kc, define(2, 4))
        _cell(kc, f"%distributed restore fm fo dm do --dir {d}")
        assert gathered(_cell(kc, cell_of(2, DIGESTS_CELL)), "DIGESTS") == first

        # autosave with a rank gone: models and optimizers need every rank; the rest is saved
        auto = tmp_path / "auto"
        _cell(kc, f"%%distributed --gpus 2 --timeout 60 --autosave fm fo steps --dir {auto}\nsteps = 5")
        pid = int(re.search(r"rank 1: GPU t:1, pid (\d+)", _cell(kc, "%distributed status")).group(1))
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not _alive(pid), 30, "rank 1's engine to die")
        stopped = _cell(kc, "%distributed shutdown")
        assert f"gpuhub: autosaved before %distributed shutdown from rank 0 to {auto}" in stopped, stopped
        for name in ("fm", "fo"):
            assert (
                f"  not saved: '{name}': a model or optimizer needs every rank, and rank 1 did not answer"
                in stopped
            )
        assert os.listdir(auto) == ["steps.pt"]


def test_preempted_engines_save_their_shards_and_the_next_pool_restores_them(tmp_path):
    """Slurm's SIGTERM to every engine (as a preemption of the pool's job sends it): each rank
    writes its shards of the autosave names, rank 0 makes them visible; an FSDP2 model restores
    bit for bit. Then SIGTERM to rank 0 alone (another job's ranks go on): it saves alone what it
    holds whole (the DDP model, its optimizer, values) and names the sharded ones not saved,
    whose last checkpoint stays."""
    pre = tmp_path / "preempted"
    env = own_gpus_env(tmp_path, "t:0,t:1")
    env.update(
        GPUHUB_AUTOSAVE_NAMES="fm fo dm do steps",
        GPUHUB_AUTOSAVE_DIR=str(pre),
        GPUHUB_PREEMPT_GATHER_SECONDS="5",
    )

    def engine_pids(kc):
        status = _cell(kc, "%distributed status")
        pids = [int(p) for p in re.findall(r"rank \d: GPU t:\d, pid (\d+)", status)]
        assert len(pids) == 2, status
        return pids

    with started_kernel(env) as (_, kc):
        _cell(kc, define(2, 0))
        trained = gathered(
            _cell(kc, cell_of(2, "train(fm, fo, 3)\ntrain(dm, do, 3)\nsteps = 3\n" + DIGESTS_CELL)), "DIGESTS"
        )
        pids = engine_pids(kc)
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not any(_alive(p) for p in pids), 60, "the preempted engines to save and end")
        report = json.loads((pre / ".gpuhub-preempted-nojob.json").read_text())
        assert report["ok"] and report["saved"] == ["fm", "fo", "dm", "do", "steps"], report
        listing = [".gpuhub-preempted-nojob.json", "dm.dcp", "do.dcp", "fm.dcp", "fo.dcp", "steps.pt"]
        assert sorted(os.listdir(pre)) == listing
        assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(pre / "fm.dcp"))  # each rank's shard
        _cell(kc, "%distributed shutdown")
        _cell(kc, define(2, 1))
        restored = _cell(kc, f"%distributed restore fm fo dm do steps --dir {pre}")
        assert "fm: sharded module (FSDP2)" in restored and "steps: value (int), assigned" in restored
        out = _cell(kc, cell_of(2, DIGESTS_CELL + "\n    print('STEPS', steps)"))
        assert gathered(out, "DIGESTS") == trained and "STEPS 3" in out

        # rank 0 alone is preempted
        fm_before = _tree(pre / "fm.dcp")
        more = gathered(
            _cell(kc, cell_of(2, "train(fm, fo)\ntrain(dm, do)\nsteps = 4\n" + DIGESTS_CELL)), "DIGESTS"
        )
        pids = engine_pids(kc)
        os.kill(pids[0], signal.SIGTERM)
        wait_for(lambda: not _alive(pids[0]), 60, "the preempted rank 0 to save and end")
        report = json.loads((pre / ".gpuhub-preempted-nojob.json").read_text())
        assert report["ok"] and report["saved"] == ["dm", "do", "steps"] and report["skipped"] == ["fm", "fo"]
        assert "not saved (sharded, and not every rank was preempted with this one): fm, fo" in report["text"]
        assert sorted(os.listdir(pre)) == listing and _tree(pre / "fm.dcp") == fm_before
        _cell(kc, "%distributed shutdown")
        _cell(kc, define(2, 2))
        _cell(kc, f"%distributed restore fm fo dm do steps --dir {pre}")
        out = _cell(kc, cell_of(2, DIGESTS_CELL + "\n    print('STEPS', steps)"))
        assert gathered(out, "DIGESTS") == {"fm": trained["fm"], "dm": more["dm"]} and "STEPS 4" in out
