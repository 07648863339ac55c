"""A gpuhub Slurm spawn against a bare ``sbatch`` on the same cluster, in one run.

    sudo PATH=node_modules/.bin:$PATH .venv/bin/python benchmarks/slurm_spawn.py [rounds]

Needs the test cluster (``sudo scripts/slurm-cluster start``) and root (jobs run as alice).
Interleaved rounds, so both arms see the same machine noise:

- **bare sbatch**: ``sudo -u alice sbatch --gres=gpu:2`` of a script that sleeps, from
  submit until ``squeue`` says RUNNING (polled every 20 ms), then ``scancel``;
- **gpu-slurm spawn**: POST to the hub's REST API for 2 GPUs until the server answers
  (ledger admission, accounting, sbatch, the watcher, batchspawner's port callback, the
  Jupyter server's own start), then stop.

Prints medians, the spread and the ratio.
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.spawn_overhead import spawn_once
from tests import slurmtools
from tests.slurmtools import SlurmHub

JOB = "#!/bin/bash\nsleep 600\n"


def bare_sbatch() -> float:
    t = time.perf_counter()
    out = slurmtools.slurm(
        "sbatch", "--parsable", "--job-name=gpuhub-test", "--gres=gpu:2", "-o", "/dev/null", "--chdir=/tmp",
        user="alice", input=JOB,
    )  # fmt: skip
    job = out.stdout.strip()
    while slurmtools.job_state(job) != "RUNNING":
        time.sleep(0.02)
    elapsed = time.perf_counter() - t
    slurmtools.slurm("scancel", job)
    slurmtools.wait_for(lambda: slurmtools.job_state(job) != "RUNNING", 30, "the job to end")
    return elapsed


def hub_spawn(hub: SlurmHub) -> float:
    return spawn_once(hub, {"gpus": 2})


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    if subprocess.run([str(slurmtools.SCRIPT), "status"], capture_output=True).returncode != 0:
        sys.exit("start the test cluster first: sudo scripts/slurm-cluster start")
    slurmtools.ensure_unix_users()
    slurmtools.cancel_all_jobs()
    with tempfile.TemporaryDirectory() as d:
        hub = SlurmHub(Path(d)).start()
        bare, spawn = [], []
        try:
            hub_spawn(hub)  # first spawn adds alice to Slurm's accounting: not measured
            for _ in range(rounds):
                bare.append(bare_sbatch())
                spawn.append(hub_spawn(hub))
        finally:
            hub.stop()
            slurmtools.cancel_all_jobs()
    print(f"submit to running/ready, 2 GPUs, median of {rounds} interleaved rounds:")
    print(f"  bare sbatch -> RUNNING      {statistics.median(bare):6.2f} s  {[round(t, 2) for t in bare]}")
    print(f"  gpu-slurm spawn -> ready    {statistics.median(spawn):6.2f} s  {[round(t, 2) for t in spawn]}")
    print(f"  ratio gpuhub / bare sbatch: {statistics.median(spawn) / statistics.median(bare):.2f}x")


if __name__ == "__main__":
    main()
