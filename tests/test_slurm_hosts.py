"""Engines on other hosts than the kernel's: how a signal reaches exactly the ranks it is for
(units; the real thing is tests/test_distributed_slurm.py on the test cluster, whose nodes
are hosts of their own)."""

from __future__ import annotations

import signal
import socket
import subprocess

import pytest

from gpu_magics.launch import slurm as slurmengines
from gpu_magics.launch.slurm import EngineFacts, SlurmLauncher, remote_signal_argv


@pytest.mark.parametrize(
    "pids, name, nodes, script",
    [
        (
            {"gpu-node2": [7, 9]},
            "USR1",
            "gpu-node2",
            'case "$SLURMD_NODENAME" in gpu-node2) kill -s USR1 7 9 ;; esac',
        ),
        (
            {"n2": [3], "n1": [1, 2]},
            "INT",
            "n1,n2",
            'case "$SLURMD_NODENAME" in n1) kill -s INT 1 2 ;; n2) kill -s INT 3 ;; esac',
        ),
        ({"a'b": [5]}, "KILL", "a'b", """case "$SLURMD_NODENAME" in 'a'"'"'b') kill -s KILL 5 ;; esac"""),
    ],
)
def test_a_remote_signal_is_one_overlapping_task_per_node_for_only_its_pids(pids, name, nodes, script):
    argv = remote_signal_argv("41", name, pids)
    assert argv[:9] == [
        "srun", "--jobid=41", "--overlap", "--gres=none", f"--nodes={len(pids)}", "--ntasks-per-node=1",
        f"--nodelist={nodes}", "--kill-on-bad-exit=0", "--quiet",
    ]  # fmt: skip
    assert argv[9:11] == ["/bin/sh", "-c"] and argv[11].startswith(script)


def test_the_script_signals_only_the_pids_of_the_node_it_runs_on():
    """The rendered script, run by a real shell as on each node: only that node's pids."""
    sleepers = {n: [subprocess.Popen(["sleep", "60"]) for _ in range(2)] for n in ("n1", "n2")}
    try:
        argv = remote_signal_argv("1", "TERM", {n: [p.pid for p in ps] for n, ps in sleepers.items()})
        done = subprocess.run(argv[9:], env={"SLURMD_NODENAME": "n2", "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0
        assert [p.wait(10) for p in sleepers["n2"]] == [-signal.SIGTERM] * 2
        assert [p.poll() for p in sleepers["n1"]] == [None, None]
        # a node with no pids of its own, or pids already gone: nothing, and no error
        gone = subprocess.run(argv[9:], env={"SLURMD_NODENAME": "n3", "PATH": "/usr/bin:/bin"})
        again = subprocess.run(argv[9:], env={"SLURMD_NODENAME": "n2", "PATH": "/usr/bin:/bin"})
        assert gone.returncode == again.returncode == 0
        assert [p.poll() for p in sleepers["n1"]] == [None, None]
    finally:
        for ps in sleepers.values():
            for p in ps:
                p.kill()
                p.wait()


class _Pool:
    def __init__(self, engine_ids, remote=True):
        self.engine_ids = engine_ids
        self.size = len(engine_ids)
        self._remote = remote
        self.infos = []


def test_signals_go_by_pid_here_and_through_srun_to_the_other_nodes_for_the_named_ranks_only(monkeypatch):
    here = socket.gethostname()
    launcher = SlurmLauncher("job", 2, 2, "/tmp")
    launcher.job_id = "77"
    launcher.facts = {
        10: EngineFacts(10, "node-a", 0, (0, 1), (), here, 1001),
        11: EngineFacts(11, "node-a", 1, (0, 1), (), here, 1002),
        12: EngineFacts(12, "node-b", 0, (0, 1), (), "node-b", 2001),
        13: EngineFacts(13, "node-b", 1, (0, 1), (), "node-b", 2002),
    }
    killed, ran = [], []
    monkeypatch.setattr(slurmengines.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(slurmengines.subprocess, "run", lambda argv, **kw: ran.append((argv, kw["env"])))
    monkeypatch.setenv("SLURM_JOB_ID", "5")  # the server's own job: never passed to the srun
    pool = _Pool([10, 11, 12, 13])

    launcher.signal(pool, signal.SIGUSR1, [1, 3])
    assert killed == [(1002, signal.SIGUSR1)]
    [(argv, env)] = ran
    assert argv[1:] == remote_signal_argv("77", "USR1", {"node-b": [2002]})[1:]
    assert "SLURM_JOB_ID" not in env

    killed.clear(), ran.clear()
    launcher.signal(pool, signal.SIGINT, None)  # every rank
    assert sorted(killed) == [(1001, signal.SIGINT), (1002, signal.SIGINT)]
    assert [a[1:] for a, _ in ran] == [remote_signal_argv("77", "INT", {"node-b": [2001, 2002]})[1:]]

    killed.clear(), ran.clear()
    launcher.signal(pool, signal.SIGINT, [0])  # only ranks here: no srun at all
    assert killed == [(1001, signal.SIGINT)] and ran == []


def test_engines_all_on_the_kernels_host_are_signalled_by_pid_only(monkeypatch):
    launcher = SlurmLauncher("steps", 1, 2, "/tmp")
    launcher.job_id = "9"
    pool = _Pool([0, 1], remote=False)
    pool.infos = [{"pid": 31}, {"pid": 32}]
    killed = []
    monkeypatch.setattr("gpu_magics.launch.base.os.kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(slurmengines.subprocess, "run", lambda *a, **k: pytest.fail("no srun for these"))
    launcher.signal(pool, signal.SIGINT, [1])
    assert killed == [(32, signal.SIGINT)]


def test_a_pid_of_another_host_is_never_read_as_a_process_of_this_one():
    """A rank is lost here only when it runs here and its pid has ended; on another host its pid
    means nothing here (the controller's heartbeat tells whether it lives)."""
    from gpu_magics.kernel.pool import EnginePool

    dead = subprocess.Popen(["true"])
    dead.wait()
    pool = EnginePool([], None, 10, launcher=SlurmLauncher("job", 2, 1, "/tmp"))
    here = socket.gethostname()
    pool.infos = [
        {"pid": dead.pid, "host": here},
        {"pid": dead.pid, "host": "other-node"},
        {"pid": 1, "host": here},
    ]
    pool._remote = True
    assert [pool._ended_here(r) for r in range(4)] == [True, False, False, False]
    pool._remote = False  # every engine on the kernel's machine (the steps of its own job)
    assert [pool._ended_here(r) for r in range(3)] == [True, True, False]
