"""Borrowing on the real test cluster: Slurm's own preemption (``PreemptType=preempt/qos``).

gpuhub writes the borrow QOS through ``SlurmAccounting.sync`` (``borrow_qos_plan``); an
over-limit job of a user runs under it, an in-limit job of another user preempts it, the grace
signal (SIGTERM) reaches the engines' tasks, whose handler (``gpu_magics.engine.main``) saves the
autosave names before the job ends, and the in-limit job starts. The engines' job is gpuhub's
own (``SlurmLauncher.job_script`` / ``job_environ``), its engines a stand-in program that
installs the engines' SIGTERM handler on a namespace holding a model (no ipyparallel
controller needed). Pure parts: test_slurm_units.py."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest
from traitlets.config import Config

from gpu_magics.launch.slurm import SlurmLauncher, preemption_report
from spawner.policy.limits import EffectiveLimit, Limit
from spawner.slurm import accounting

from . import slurmtools
from .hubtools import REPO, wait_for
from .slurmtools import job_state, slurm, slurm_cluster_turn  # noqa: F401 (pytestmark)

pytestmark = [pytest.mark.hub, pytest.mark.usefixtures("slurm_cluster_turn")]

BORROWER, OTHER = "dave", "bob"  # limits 1 and 4 here; dave may borrow 2
GRACE = 20  # seconds: the borrow QOS's GraceTime


class Ledger:
    """What SlurmAccounting.sync reads: limits, groups, the GPUs."""

    def effective_limits(self, users=None):
        limits = {BORROWER: 1, OTHER: 4}
        return {
            u: EffectiveLimit(Limit(max_gpus=n), "user") for u, n in limits.items() if not users or u in users
        }

    def known_groups(self, users):
        return {u: [] for u in users}

    def gpu_table(self):
        class Gpu:
            present = True

        return [Gpu()] * 8


def sync_accounting():
    config = Config()
    config.GpuHub.default_borrow = 0
    config.GpuHub.user_borrow = {BORROWER: 2}
    config.GpuHub.preempt_grace_seconds = GRACE
    acc = accounting.SlurmAccounting(enabled=True, config=config)
    accounting.SlurmAccounting.forget()  # the QOS is deleted under this process's memo of it
    return acc.sync(Ledger())


def qos_of(job_id: str) -> str:
    return slurm("squeue", "-h", "-j", job_id, "-o", "%q").stdout.strip()


ENGINE = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {repo!r})
    import torch
    from gpu_magics.engine.main import autosave_request, on_sigterm
    torch.manual_seed(0)
    ns = {{"model": torch.nn.Linear(3, 2), "step": 41 + int(os.environ["SLURM_PROCID"])}}
    names, directory = autosave_request(os.environ)
    signal.signal(signal.SIGTERM, on_sigterm(names, directory, lambda: ns))
    print("engine ready", os.environ["SLURM_PROCID"], flush=True)
    while True:
        time.sleep(0.2)
    """
)


@pytest.fixture
def cluster(tmp_path):
    slurmtools.require_cluster()
    slurmtools.ensure_unix_users()
    slurmtools.cancel_all_jobs()
    yield
    slurmtools.cancel_all_jobs()


def test_a_borrowed_engines_job_is_preempted_after_its_engines_saved(cluster):
    # gpuhub writes the QOS (from nothing) and the limits
    slurm("sacctmgr", "-i", "delete", "qos", "gpuhub-borrow", check=False)
    ran = sync_accounting()
    assert ["sacctmgr", "-i", "add", "qos", "gpuhub-borrow"] in ran
    out = slurm("sacctmgr", "-n", "-P", "show", "qos", accounting.QOS_FORMAT).stdout
    qos = accounting.parse_qos(out)
    assert qos["gpuhub-borrow"] == accounting.Qos(
        "gpuhub-borrow", (), "cancel", GRACE, 3, 8, ("DenyOnLimit",)
    )
    assert "gpuhub-borrow" in qos["normal"].preempt
    assert sync_accounting() == []  # written once: a second sync changes nothing

    home = Path(f"/home/{BORROWER}")
    work = home / f"preempt-{uuid.uuid4().hex[:8]}"
    slurm("mkdir", "-p", str(work), user=BORROWER)
    engine = work / "engine.py"
    slurm("tee", str(engine), user=BORROWER, input=ENGINE.format(repo=str(REPO)))
    save_dir = str(work / "ckpt")

    # within the limit only under the normal QOS; beyond it only under the borrow QOS
    plain = slurm("sbatch", "--parsable", "-J", "gpuhub-test", "-o", "/dev/null", "--gres=gpu:2",
                  "--wrap", "true", user=BORROWER, check=False)  # fmt: skip
    assert plain.returncode != 0 and "AssocGrpGRES" in plain.stderr
    too_many = slurm("sbatch", "--parsable", "-J", "gpuhub-test", "-o", "/dev/null", "--gres=gpu:4",
                     "--qos=gpuhub-borrow", "--wrap", "true", user=BORROWER, check=False)  # fmt: skip
    assert too_many.returncode != 0 and "QOSMaxGRESPerUser" in too_many.stderr

    # gpuhub's own engines job: 2 GPUs (1 beyond dave's limit of 1), autosave model and step
    launcher = SlurmLauncher("job", 1, 2, str(work), "gpu", "gpuhub")
    launcher.borrowed, launcher.borrow_qos = 1, "gpuhub-borrow"
    launcher.autosave = (["model", "step", "absent"], save_dir)
    text = launcher.job_script([sys.executable, str(engine)])
    assert "#SBATCH --qos=gpuhub-borrow\n" in text
    env = launcher.job_environ({k: v for k, v in os.environ.items() if k in ("PATH", "LANG")})
    borrowed = slurm(
        "env", *[f"{k}={v}" for k, v in env.items()], "sbatch", "--parsable", "-w", "gpu-node1",
        user=BORROWER, input=text,
    ).stdout.strip().split(";")[0]  # fmt: skip
    log = work / f"gpuhub-engines-{borrowed}.log"
    wait_for(lambda: job_state(borrowed) == "RUNNING", 60, "the borrowed engines job to run")
    assert qos_of(borrowed) == "gpuhub-borrow"

    def engines_ready():
        return log.exists() and log.read_text().count("engine ready") == 2

    wait_for(engines_ready, 60, "both engines to install their SIGTERM handler")

    # root takes every other GPU; then bob's in-limit job needs the borrowed ones
    held = [
        slurmtools_sbatch("-w", "gpu-node1", "--gres=gpu:2"),
        slurmtools_sbatch("-w", "gpu-node2", "--gres=gpu:4"),
    ]
    wait_for(lambda: all(job_state(j) == "RUNNING" for j in held), 60, "root's jobs to hold the other GPUs")
    waiting = slurmtools_sbatch("--gres=gpu:2", user=OTHER)
    assert qos_of(waiting) == "normal"

    # Slurm preempts in a scheduling pass (measured 0.3-26 s after the submission here)
    wait_for(lambda: job_state(borrowed) not in ("RUNNING", "PENDING"), 120 + GRACE, "the preemption")
    wait_for(lambda: job_state(waiting) == "RUNNING", 60 + GRACE, "the in-limit job to start")
    # Slurm preempted it (PreemptTime set); its engines ended within the grace period, so the
    # job ends COMPLETED (measured; PREEMPTED when Slurm has to kill it at GraceTime)
    detail = slurm("scontrol", "show", "job", borrowed).stdout
    preempted = [w for w in detail.split() if w.startswith("PreemptTime=")]
    assert preempted and preempted[0] not in ("PreemptTime=None", "PreemptTime=Unknown"), detail

    # slurmdbd records the job's end a moment after slurmctld ends it: sacct may still say RUNNING
    def accounted() -> str | None:
        state = slurm("sacct", "-n", "-X", "-P", "-j", borrowed, "-o", "State").stdout.strip()
        return state if state != "RUNNING" else None

    assert wait_for(accounted, 30, "sacct to record the job's end") in ("COMPLETED", "PREEMPTED")

    # the grace signal reached the engines: rank 0 saved, rank 1 did not write
    output = log.read_text()
    assert (
        f"gpuhub: engine rank 0 preempted by Slurm (job {borrowed}): saved model, step to {save_dir}"
        in output
    )
    # these engines hold no process group to meet in: rank 0 saves what it holds whole
    assert "not defined: absent" in output
    assert (
        f"engine rank 1 preempted by Slurm (job {borrowed}) without the other ranks: rank 0 saves" in output
    )
    import torch

    torch.manual_seed(0)
    want = torch.nn.Linear(3, 2).state_dict()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = json.loads(Path(f"{save_dir}/model.dcp/gpuhub.json").read_text())
    assert meta["kind"] == "module" and meta["reason"] == "preempted", meta
    one_file = Path(tempfile.mkdtemp()) / "model-one-file.pt"
    dcp_to_torch_save(f"{save_dir}/model.dcp", one_file)  # as docs/checkpoints.md shows
    model = torch.load(one_file, weights_only=True)
    step = torch.load(f"{save_dir}/step.pt", weights_only=True)
    assert all(torch.equal(model[k], want[k]) for k in want)
    assert step["state"] == 41 and step["rank"] == 0 and step["world_size"] == 2
    # what the kernel shows when it finds the engines gone
    report = preemption_report(save_dir, borrowed)
    assert report is not None and "saved model, step" in report
    assert json.loads(Path(save_dir, f".gpuhub-preempted-{borrowed}.json").read_text())["saved"] == [
        "model",
        "step",
    ]


def slurmtools_sbatch(*args: str, user: str | None = None) -> str:
    argv = ["sbatch", "--parsable", "-J", "gpuhub-test", "-o", "/dev/null", *args]
    return slurm(*argv, user=user, input="#!/bin/sh\nsleep 600\n").stdout.strip().split(";")[0]
