"""A gpuhub Slurm spawn against its floors on the same cluster, in one run.

    sudo PATH=node_modules/.bin:$PATH .venv/bin/python benchmarks/slurm_spawn.py [rounds]

Needs the test cluster (``sudo scripts/slurm-cluster start``) and root (jobs run as alice).
Interleaved rounds, so every arm sees the same machine noise:

- **bare sbatch**: ``sudo -u alice sbatch --gres=gpu:2`` of a script that sleeps, from
  submit until ``squeue`` says RUNNING (polled every 20 ms), then ``scancel``: the floor
  the issue names (Slurm's own part);
- **bare sbatch + jupyter server**: the same job running a bare ``python -m jupyter_server``
  (the same Python and extensions, no hub), from submit until the server answers ``/api``
  (polled every 20 ms): what any notebook server in a Slurm job costs;
- **gpu-slurm spawn**: POST to the hub's REST API for 2 GPUs until the hub's progress
  stream says ready (ledger admission, accounting, sbatch, the watcher, batchspawner's port
  callback, the Jupyter server's own start), then stop;
- **untuned**: the same for bob, whose spawns the same hub makes without gpuhub's launcher
  (batchspawner's ``batchspawner-singleuser`` and ``jupyterhub-singleuser``),
  its wait for the server and the fast start loop (``UNTUNED``, a ``pre_spawn_hook``): gpuhub
  before, but for the watcher's faster polling after a submit, which is the hub's (one watcher);
- **previous launcher**: the same for carol with gpuhub's launcher as it was before the port
  report and JupyterLab's version moved into it (``batchspawner-singleuser`` running a
  ``gpuhub-singleuser`` that defers ``rfc3987_syntax`` only: ``PREVIOUS``): what the launcher's
  newer cuts are worth, in the same run.

Prints medians, the spread, gpuhub minus each floor and the ratios.
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.spawn_overhead import line, spawn_once
from tests import slurmtools
from tests.hubtools import free_port
from tests.slurmtools import SlurmHub

JOB = "#!/bin/bash\nsleep 600\n"
UNTUNED = f"""
def _untuned(spawner):
    if spawner.user.name == "bob":
        spawner.cmd = ["{slurmtools.VENV_BIN / "jupyterhub-singleuser"}"]
        spawner.batchspawner_singleuser_cmd = "{slurmtools.VENV_BIN / "batchspawner-singleuser"}"
        spawner.ready_poll_seconds = 0
        spawner.startup_poll_interval = 0.5
    elif spawner.user.name == "carol":
        spawner.cmd = [PREVIOUS_LAUNCHER]
        spawner.batchspawner_singleuser_cmd = "{slurmtools.VENV_BIN / "batchspawner-singleuser"}"
c.Spawner.pre_spawn_hook = _untuned
"""
# gpuhub-singleuser before it took batchspawner-singleuser's place and read JupyterLab's
# version without yarn (the launcher of commit a6dfaa7)
PREVIOUS = f"""#!{sys.executable}
import sys
from spawner.singleuser import defer_import
defer_import()
from jupyterhub.singleuser import main
sys.exit(main())
"""
SERVER_JOB = """#!/bin/bash
export HOME=/home/alice
exec {python} -m jupyter_server --no-browser --ServerApp.ip=0.0.0.0 --ServerApp.port={port} \\
    --IdentityProvider.token= --ServerApp.root_dir=/home/alice
"""


def submit(script: str) -> tuple[float, str]:
    t = time.perf_counter()
    out = slurmtools.slurm(
        "sbatch", "--parsable", "--job-name=gpuhub-test", "--gres=gpu:2", "-o", "/dev/null", "--chdir=/tmp",
        user="alice", input=script,
    )  # fmt: skip
    return t, out.stdout.strip()


def until(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def end(job: str) -> None:
    slurmtools.slurm("scancel", job)
    slurmtools.wait_for(lambda: slurmtools.job_state(job) not in ("RUNNING", "PENDING"), 30, "the job to end")


def bare_sbatch() -> float:
    t, job = submit(JOB)
    until(lambda: slurmtools.job_state(job) == "RUNNING", "the job to run")
    elapsed = time.perf_counter() - t
    end(job)
    return elapsed


def bare_server_job() -> float:
    port = free_port()
    t, job = submit(SERVER_JOB.format(python=sys.executable, port=port))

    node = []  # the test cluster's nodes are hosts of their own: the server is at its node's name

    def answers():
        if slurmtools.job_state(job) in ("FAILED", "COMPLETED", "CANCELLED", "GONE"):
            raise RuntimeError(f"the bare server's job {job} ended")
        if not node:
            name = slurmtools.slurm("squeue", "-h", "-j", job, "-o", "%N").stdout.strip()
            if not name:
                return False
            node.append(name)
        try:
            return requests.get(f"http://{node[0]}:{port}/api", timeout=30).status_code == 200
        except requests.ConnectionError:
            return False

    until(answers, "the bare server to answer")
    elapsed = time.perf_counter() - t
    end(job)
    return elapsed


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    if subprocess.run([str(slurmtools.SCRIPT), "status"], capture_output=True).returncode != 0:
        sys.exit("start the test cluster first: sudo scripts/slurm-cluster start")
    slurmtools.ensure_unix_users()
    launcher_dir = Path(tempfile.mkdtemp(prefix="gpuhub-bench-"))  # readable by the jobs' users
    launcher_dir.chmod(0o755)
    previous = launcher_dir / "gpuhub-singleuser-previous"
    previous.write_text(PREVIOUS)
    previous.chmod(0o755)
    config = UNTUNED.replace("PREVIOUS_LAUNCHER", repr(str(previous)))
    with slurmtools.cluster_turn(), tempfile.TemporaryDirectory() as d:  # the cluster alone
        slurmtools.cancel_all_jobs()
        hub = SlurmHub(Path(d), extra_config=config).start()
        bare, server, spawn, untuned, before = [], [], [], [], []
        try:
            for user in ("alice", "bob", "carol"):  # a first spawn adds the user to Slurm's accounting
                spawn_once(hub, {"gpus": 2}, user)
            for _ in range(rounds):
                bare.append(bare_sbatch())
                server.append(bare_server_job())
                spawn.append(spawn_once(hub, {"gpus": 2}))
                untuned.append(spawn_once(hub, {"gpus": 2}, "bob"))
                before.append(spawn_once(hub, {"gpus": 2}, "carol"))
        finally:
            hub.stop()
            slurmtools.cancel_all_jobs()
            previous.unlink()
            launcher_dir.rmdir()
    b, s, g, u, p = (statistics.median(x) for x in (bare, server, spawn, untuned, before))
    print(f"submit to running/ready, 2 GPUs, median of {rounds} interleaved rounds:")
    print(line("bare sbatch -> RUNNING", bare))
    print(line("bare sbatch + jupyter server", server))
    print(line("gpu-slurm spawn -> ready", spawn))
    print(line("  the same, untuned", untuned))
    print(line("  previous launcher", before))
    print(f"  gpuhub - bare sbatch: {g - b:+.2f} s ({g / b:.2f}x); untuned: {u - b:+.2f} s; ", end="")
    print(f"previous: {p - b:+.2f} s")
    rounds = [round(x / y, 2) for x, y in zip(spawn, before, strict=True)]
    print(f"  gpuhub / previous launcher: {g / p:.2f}x (rounds: {rounds})")
    print(f"  gpuhub - bare server job: {g - s:+.2f} s ({g / s:.2f}x); gpuhub / untuned: {g / u:.2f}x")


if __name__ == "__main__":
    main()
