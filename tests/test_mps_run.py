"""A slice's MPS daemon as the server's launcher runs it (spawner/mps_run.py): no GPU here, so
``nvidia-cuda-mps-control`` is a stand-in script on the PATH that records how it was called; the
real daemon and its limits are row 5 of benchmarks/gpu_check.py, for a lent GPU."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from spawner import mps_run

UUID = "GPU-0e4b1f2a-aaaa-bbbb-cccc-123456789abc"
SLICE = {
    "GPUHUB_SLICE_MPS": "1",
    "GPUHUB_SLICE_UUID": UUID,
    "GPUHUB_GPU_SLICE": "1/4",
    "GPUHUB_GPU_MEMORY_MIB": "10240",
    "GPUHUB_GPU_MODEL": "A100",
}
STAND_IN = """#!/bin/sh
{ echo "argv: $*"; echo "visible: $CUDA_VISIBLE_DEVICES"; echo "pipe: $CUDA_MPS_PIPE_DIRECTORY";
  echo "stdin: $(cat)"; } >> "$MPS_CALLS"
exit ${MPS_EXIT:-0}
"""


@pytest.fixture
def stand_in(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    tool = bindir / "nvidia-cuda-mps-control"
    tool.write_text(STAND_IN)
    tool.chmod(0o755)
    return bindir, tmp_path / "calls.log"


def launch(tmp_path, env: dict) -> subprocess.CompletedProcess:
    """``gpuhub-singleuser --version``: the launcher's start and exit, without a server."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GPUHUB_")} | env
    full["TMPDIR"] = str(tmp_path / "shared")  # not private: the launcher makes its own in it
    Path(full["TMPDIR"]).mkdir(exist_ok=True)
    Path(full["TMPDIR"]).chmod(0o1777)  # a shared place, like /tmp
    return subprocess.run(
        [sys.executable, "-m", "spawner.singleuser", "--version"],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_launcher_starts_the_users_daemon_for_the_slice_and_quits_it_at_exit(tmp_path, stand_in):
    bindir, calls = stand_in
    env = SLICE | {"PATH": f"{bindir}:{os.environ['PATH']}", "MPS_CALLS": str(calls)}
    done = launch(tmp_path, env)
    assert done.returncode == 0, done.stderr
    start, quit_ = calls.read_text().split("argv: ")[1:]
    assert start.startswith("-d\n") and f"visible: {UUID}" in start, start
    pipe = start.split("pipe: ")[1].split("\n")[0]
    # in the server's private temporary directory (a random name, 0700), never a shared name
    assert pipe.startswith(str(tmp_path / "shared") + "/") and pipe.endswith(f"/mps-{UUID}/pipe"), pipe
    assert quit_.startswith("\n") and "stdin: quit" in quit_ and f"pipe: {pipe}" in quit_, quit_


def test_the_client_settings_hold_the_server_to_its_slice(tmp_path):
    environ = dict(SLICE)
    runs = []

    def run(argv, **kw):
        runs.append((argv, kw))
        return subprocess.CompletedProcess(argv, 0, "", "")

    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    quit_daemon = mps_run.start(environ, str(private), run=run)
    assert environ["CUDA_VISIBLE_DEVICES"] == UUID
    assert environ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    for d in ("pipe", "log"):
        assert stat.S_IMODE((private / f"mps-{UUID}" / d).stat().st_mode) == 0o700
    quit_daemon()
    assert [argv for argv, _ in runs] == [["nvidia-cuda-mps-control", "-d"], ["nvidia-cuda-mps-control"]]
    assert runs[1][1]["input"] == "quit\n"


@pytest.mark.parametrize(
    "env, why",
    [
        ({"MPS_EXIT": "1"}, "nvidia-cuda-mps-control -d failed (1)"),
        (
            {"PATH": "/usr/bin:/bin"},
            "is not installed on this node, so this slice cannot be held to its share",
        ),
        ({"GPUHUB_SLICE_UUID": "../../etc"}, "incomplete or wrong"),
    ],
)
def test_a_slice_never_runs_without_its_daemon(tmp_path, stand_in, env, why):
    bindir, calls = stand_in
    base = SLICE | {"PATH": f"{bindir}:{os.environ['PATH']}", "MPS_CALLS": str(calls)}
    done = launch(tmp_path, base | env)
    assert done.returncode != 0 and "this server's GPU slice: " in done.stderr and why in done.stderr, (
        done.stderr
    )
    assert "jupyterhub" not in done.stdout.lower()  # the server never started


def test_no_daemon_for_a_whole_gpu_or_a_simulated_slice(tmp_path, stand_in):
    bindir, calls = stand_in
    env = {
        **SLICE,
        "GPUHUB_SLICE_MPS": "0",
        "PATH": f"{bindir}:{os.environ['PATH']}",
        "MPS_CALLS": str(calls),
    }
    assert launch(tmp_path, env).returncode == 0
    assert not calls.exists()
