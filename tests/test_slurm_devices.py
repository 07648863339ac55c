"""A Slurm job can open only its own GPUs' device files: on the real test cluster, as a real
account, with the fake GPUs of ``scripts/slurm-cluster`` (character devices, major 195, mode
0666, so file permissions let anyone open any of them and only the job's device cgroup,
``ConstrainDevices=yes``, can stop it).

A job opens every fake GPU device file of its node and writes what each open answered to a
file the test reads. There is no driver behind the fake devices, so an open the cgroup lets
through fails with ``ENXIO`` (the kernel reached the device and found no driver); an open the
cgroup refuses fails with ``EPERM``. The job's own GPUs are the indices in ``SLURM_JOB_GPUS``
(the node's numbering: ``CUDA_VISIBLE_DEVICES`` is renumbered from 0 by the cgroup), mapped to
files in the order of the node's ``File=`` list in gres.conf.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from . import slurmtools
from .hubtools import wait_for
from .slurmtools import job_state, slurm, slurm_cluster_turn  # noqa: F401 (pytestmark)

pytestmark = pytest.mark.usefixtures("slurm_cluster_turn")

USER = "alice"
GRES_CONF = Path(os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")).with_name("gres.conf")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "GONE"}
# What a cgroup lets through: no driver answers the fake device (ENXIO); a real one would open.
PASSED = {"opened", "ENXIO"}

PROBE = r"""
import errno, json, os, sys
files, out = json.loads(sys.argv[1]), sys.argv[2]
node = os.environ.get("SLURMD_NODENAME", "")
result = {"node": node, "job_gpus": os.environ.get("SLURM_JOB_GPUS"),
          "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "opens": {}}
for path in files.get(node, sorted({p for ps in files.values() for p in ps})):
    try:
        os.close(os.open(path, os.O_RDWR))
        result["opens"][path] = "opened"
    except OSError as e:
        result["opens"][path] = errno.errorcode.get(e.errno, str(e.errno))
with open(out + ".tmp", "w") as f:
    json.dump(result, f)
os.rename(out + ".tmp", out)
"""


def expand(pattern: str) -> list[str]:
    """``/x/nvidia[4-7]`` -> ``/x/nvidia4 ... /x/nvidia7`` (gres.conf's one range form used here)."""
    m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", pattern)
    if not m:
        return [pattern]
    return [f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)]


def node_gpu_files() -> dict[str, list[str]]:
    """Each node's GPU device files, in gres.conf's order (file k is the node's GPU index k)."""
    files: dict[str, list[str]] = {}
    for line in GRES_CONF.read_text().splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f and not line.startswith("#"))
        if fields.get("Name") == "gpu" and "File" in fields:
            files.setdefault(fields["NodeName"], []).extend(expand(fields["File"]))
    return files


@pytest.fixture
def cluster():
    slurmtools.require_cluster()
    slurmtools.ensure_unix_users((USER,))
    slurm("sacctmgr", "-i", "add", "user", USER, "account=gpuhub", check=False)
    files = node_gpu_files()
    assert set(files) == {"gpu-node1", "gpu-node2"} and all(len(f) == 4 for f in files.values()), files
    for paths in files.values():
        for path in paths:  # only the cgroup may stop a job: the files themselves are open to all
            st = os.stat(path)
            assert os.major(st.st_rdev) == 195 and st.st_mode & 0o666 == 0o666, path
    work = Path(tempfile.mkdtemp(prefix="gpuhub-devices-"))
    user = pwd.getpwnam(USER)
    os.chown(work, user.pw_uid, user.pw_gid)
    work.chmod(0o700)
    (work / "probe.py").write_text(PROBE)
    os.chown(work / "probe.py", user.pw_uid, user.pw_gid)
    yield files, work
    slurmtools.cancel_all_jobs()
    shutil.rmtree(work, ignore_errors=True)


def probe(work: Path, files, *sbatch_args: str) -> dict:
    """Run the probe as a batch job of USER; wait for it to end; its results."""
    out = work / f"result-{len(list(work.glob('result-*')))}.json"
    job = slurm(
        "sbatch", "--parsable", "--account=gpuhub", "--job-name=gpuhub-test", "--chdir=/tmp",
        f"--output={work}/job-%j.out", *sbatch_args,
        "--wrap", f"{sys.executable} {work}/probe.py '{json.dumps(files)}' {out}", user=USER,
    ).stdout.strip().split(";")[0]  # fmt: skip
    wait_for(lambda: job_state(job) in ENDED, 60, f"probe job {job} to end", interval=0.2)
    if not out.exists():
        log = work / f"job-{job}.out"
        said = log.read_text() if log.exists() else "(no output)"
        raise AssertionError(f"job {job} wrote no result: {said}")
    return json.loads(out.read_text())


def hold(node: str, gpus: int) -> str:
    """A job of USER holding GPUs of a node, so the probe gets GPUs other than the first ones."""
    job = slurm(
        "sbatch", "--parsable", "--account=gpuhub", "--job-name=gpuhub-test", "--chdir=/tmp",
        "--output=/dev/null", f"--gres=gpu:{gpus}", "-w", node, "--wrap", "sleep 300", user=USER,
    ).stdout.strip().split(";")[0]  # fmt: skip
    wait_for(lambda: job_state(job) == "RUNNING", 60, f"holder job {job} to run", interval=0.2)
    return job


def check_only_own(result: dict, files, count: int) -> None:
    node = result["node"]
    own_indices = [int(i) for i in result["job_gpus"].split(",")]
    assert len(own_indices) == count, result
    own = {files[node][i] for i in own_indices}
    opens = result["opens"]
    assert set(opens) == set(files[node]), result
    passed = {path for path, answer in opens.items() if answer in PASSED}
    refused = {path: answer for path, answer in opens.items() if answer not in PASSED}
    assert passed == own, f"the job could open {sorted(passed)}, its own GPUs are {sorted(own)}: {result}"
    assert set(refused.values()) == {"EPERM"}, f"another GPU's file was not refused by the cgroup: {result}"
    # the cgroup renumbers what the job sees from 0; SLURM_JOB_GPUS keeps the node's indices
    assert result["cuda"] == ",".join(str(i) for i in range(count)), result


def test_outside_a_job_every_fake_gpu_file_passes_the_permission_check(cluster):
    files, _ = cluster
    every = [p for paths in files.values() for p in paths]
    answers = subprocess.run(
        ["sudo", "-u", USER, sys.executable, "-c",
         "import errno, os, sys\nfor p in sys.argv[1:]:\n"
         "    try: os.close(os.open(p, os.O_RDWR)); print('opened')\n"
         "    except OSError as e: print(errno.errorcode[e.errno])", *every],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.split()  # fmt: skip
    assert len(answers) == len(every) and set(answers) <= PASSED, answers


@pytest.mark.parametrize("node", ["gpu-node1", "gpu-node2"])
def test_a_1_gpu_job_opens_only_its_own_gpu(cluster, node):
    files, work = cluster
    hold(node, 1)
    result = probe(work, files, "--gres=gpu:1", "-w", node)
    assert result["node"] == node
    assert result["job_gpus"] != "0", "the holder job should have taken another GPU first"
    check_only_own(result, files, 1)


def test_a_2_gpu_job_opens_exactly_its_two(cluster):
    files, work = cluster
    hold("gpu-node2", 1)
    result = probe(work, files, "--gres=gpu:2", "-w", "gpu-node2")
    check_only_own(result, files, 2)
