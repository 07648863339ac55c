"""On the real test cluster, bob (a second real account) learns nothing of alice's jobs and
reads nothing in her home: Slurm's ``PrivateData=jobs,usage,users`` and 0700 homes, as
docs/security.md asks of production clusters.

alice runs a job on a node that writes its log into her home, as a notebook server's job does;
bob asks Slurm about it every way a user can, and tries to read the log. alice herself sees her
job and her log; root (the hub's watcher) sees both users' jobs.
"""

import json
import os
import pwd
import subprocess

import pytest

from spawner.slurm import commands, squeue

from . import slurmtools
from .hubtools import wait_for
from .slurmtools import slurm, slurm_cluster_turn  # noqa: F401 (pytestmark)

pytestmark = pytest.mark.usefixtures("slurm_cluster_turn")


@pytest.fixture
def cluster():
    slurmtools.require_cluster()
    slurmtools.ensure_unix_users(("alice", "bob"))
    for user in ("alice", "bob"):
        slurm("sacctmgr", "-i", "add", "user", user, "account=gpuhub", check=False)
    yield
    slurmtools.cancel_all_jobs()


def listed_ids(user: str | None) -> set[str]:
    out = slurm(*commands.squeue_json_argv(), user=user).stdout
    return set(squeue.parse_squeue_json(out, ["gpuhub-server", "gpuhub-test"]).jobs)


def test_bob_sees_no_job_usage_or_log_of_alices(cluster):
    config = slurm("scontrol", "show", "config").stdout
    line = next(x for x in config.splitlines() if x.startswith("PrivateData"))
    assert {"jobs", "usage", "users"} <= set(line.split("=", 1)[1].strip().split(",")), line

    home = pwd.getpwnam("alice").pw_dir
    assert os.stat(home).st_mode & 0o077 == 0, oct(os.stat(home).st_mode)
    log = os.path.join(home, "gpuhub-privacy-test.log")
    job_id = commands.parse_sbatch(
        slurm(
            "sbatch", "--parsable", "--account=gpuhub", "--job-name=gpuhub-test", "--gres=gpu:a100:1",
            f"--chdir={home}", f"--output={log}", "--comment=gpuhub:alice-secret-comment",
            "--wrap", "echo alices-notebook-output; sleep 300", user="alice",
        ).stdout
    )  # fmt: skip
    try:
        wait_for(
            lambda: os.path.exists(log) and "alices-notebook-output" in open(log).read(), 60, "the job's log"
        )
        # alice and root see her job; bob does not
        assert job_id in listed_ids("alice") and job_id in listed_ids(None)
        assert job_id not in listed_ids("bob")
        bob = {
            "scontrol show job": slurm("scontrol", "show", "job", job_id, user="bob", check=False),
            "squeue -j": slurm("squeue", "-h", "-j", job_id, "-o", "%i %u %k", user="bob", check=False),
            "sacct -j": slurm("sacct", "-n", "-X", "-j", job_id, "-o", "JobID,User", user="bob", check=False),
            "sacct -a": slurm("sacct", "-n", "-X", "-a", "-o", "JobID,User", user="bob", check=False),
            "sshare -a": slurm("sshare", "-a", "-n", "-P", "-o", "User", user="bob", check=False),
        }
        for what, p in bob.items():
            assert job_id not in p.stdout and "alice" not in p.stdout, (what, p.stdout, p.stderr)
        assert "alice" in slurm("sshare", "-a", "-n", "-P", "-o", "User").stdout  # root: everyone
        assert "alices-notebook-output" in slurm("cat", log, user="alice").stdout
        read = subprocess.run(
            ["runuser", "-u", "bob", "--", "cat", log], capture_output=True, text=True, timeout=30
        )
        assert read.returncode != 0 and "Permission denied" in read.stderr, (read.stdout, read.stderr)
        listing = subprocess.run(
            ["runuser", "-u", "bob", "--", "ls", home], capture_output=True, text=True, timeout=30
        )
        assert listing.returncode != 0 and "Permission denied" in listing.stderr
        # bob's own job is his to see
        own = commands.parse_sbatch(
            slurm("sbatch", "--parsable", "--account=gpuhub", "--job-name=gpuhub-test", "--chdir=/tmp",
                  "--output=/dev/null", "--wrap", "sleep 300", user="bob").stdout
        )  # fmt: skip
        assert own in listed_ids("bob")
        assert json.loads(slurm(*commands.squeue_json_argv(), user="bob").stdout)["jobs"]
    finally:
        slurmtools.cancel_all_jobs()
        if os.path.exists(log):
            os.unlink(log)
