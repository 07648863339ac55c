"""The real Slurm cluster of ``scripts/slurm-cluster`` for tests: two nodes with 4 fake
GPUs each, munge, slurmctld, slurmdbd. ``scripts/test`` starts it when run as root and
sets ``GPUHUB_REQUIRE_SLURM=1``, so in CI these tests run or fail, never skip. Elsewhere
they skip with a message that says how to enable them.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import secrets
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from .hubtools import REPO, Hub, process_environ, wait_for

SCRIPT = REPO / "scripts" / "slurm-cluster"
# the cluster's state directory (root-owned, 0755; scripts/slurm-cluster refuses any other)
STATE_DIR = Path(os.environ.get("GPUHUB_SLURM_DIR", "/var/lib/gpuhub-slurm"))
USERS = ("alice", "bob", "carol", "dave")
# this machine as the nodes see it (scripts/slurm-cluster: each node is a network namespace on a
# private bridge; /etc/hosts names the head and both nodes)
HEAD = "gpu-head"
NODES = ("gpu-node1", "gpu-node2")
VENV_BIN = Path(sys.executable).parent


def require_cluster() -> None:
    """Skip (or, with GPUHUB_REQUIRE_SLURM=1, fail) unless the test cluster answers."""
    up = subprocess.run([str(SCRIPT), "status"], capture_output=True, text=True)
    if up.returncode == 0:
        return
    if os.geteuid() == 0:
        started = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True)
        if started.returncode == 0:
            return
        why = started.stdout[-2000:] + started.stderr[-2000:]
    else:
        why = "not root"
    message = (
        "the Slurm test cluster is not running; start it as root with `sudo scripts/slurm-cluster start` "
        f"(or run the suite as root: `scripts/test`). ({why.strip()})"
    )
    if os.environ.get("GPUHUB_REQUIRE_SLURM") == "1":
        pytest.fail(message)
    pytest.skip(message)


def ensure_unix_users(names=USERS) -> None:
    """Slurm jobs run as real users: create the demo users if missing, each with a home that
    only they can open (0700, as docs/security.md asks of production; Debian's useradd would
    make it 0755, and another user could read the server's log and notebooks there)."""
    for name in names:
        try:
            home = pwd.getpwnam(name).pw_dir
        except KeyError:
            subprocess.run(
                ["useradd", "--create-home", "-K", "HOME_MODE=0700", "--shell", "/bin/bash", name], check=True
            )
            home = pwd.getpwnam(name).pw_dir
        if os.path.isdir(home) and os.stat(home).st_mode & 0o077:
            os.chmod(home, 0o700)


def slurm(*argv: str, user: str | None = None, input: str | None = None, check=True):
    cmd = list(argv) if user is None else ["sudo", "-u", user, *argv]
    return subprocess.run(cmd, capture_output=True, text=True, input=input, check=check, timeout=60)


def set_slurm_gpus(user: str, gpus: int, check: bool = True):
    """An operator's ``sacctmgr`` on the user's association in account gpuhub: at most ``gpus``
    GPUs at once (-1: no limit)."""
    where = ["where", f"name={user}", "account=gpuhub"]
    return slurm("sacctmgr", "-i", "modify", "user", *where, "set", f"GrpTRES=gres/gpu={gpus}", check=check)


def job_state(job_id: str) -> str:
    out = slurm("squeue", "-h", "-t", "all", "-j", str(job_id), "-o", "%T", check=False).stdout.strip()
    return out or "GONE"


def cancel_all_jobs() -> None:
    # one name per call: scancel (22.05) takes a comma list, but matches only its first name
    for job_name in ("gpuhub-server", "gpuhub-engines", "gpuhub-test"):
        slurm("scancel", "--full", "--name", job_name, check=False)
    for name in USERS:
        slurm("scancel", "-u", name, check=False)

    def none_left():
        out = slurm("squeue", "-h", "-o", "%i %T", check=False).stdout.strip()
        return not out

    wait_for(none_left, 60, "every Slurm job to end", interval=0.5)


# GPU use on the test cluster's fake GPUs: the servers on the Slurm nodes read this file
# (world-readable: they run as the test users) and report it, as they would NVML. Written by
# root, so it lives in the root-owned state directory, not in a world-writable one.
UTIL_FILE = STATE_DIR / "test-utilization.json"

SLURM_HUB_CONFIG = f"""
c.JupyterHub.spawner_class = "gpu-slurm"
c.JupyterHub.hub_ip = "{HEAD}"  # the servers on the nodes call the hub back there
c.GpuHub.inventory = "slurm"
c.SlurmAccounting.enabled = True
c.Spawner.cmd = ["{VENV_BIN / "gpuhub-singleuser"}"]  # as hub_config/slurm_cluster.py
c.Spawner.args = []
c.GpuSlurmSpawner.batchspawner_singleuser_cmd = "{VENV_BIN / "gpuhub-singleuser"}"  # reports the port
c.SlurmWatcher.min_interval = 0.5
c.SlurmWatcher.max_interval = 2
c.Spawner.start_timeout = 120
# a Slurm server answers within a second of its port callback (hubtools allows 60 s); a
# restarted hub gives up on a server it cannot reach (a job cancelled while nobody watched, a
# spawn still queued in Slurm) only after this long
c.Spawner.http_timeout = 20
c.GpuHub.utilization_source = "simulated"
c.GpuHub.simulated_utilization_file = "{UTIL_FILE}"
c.GpuHub.report_seconds = 1
"""


class SlurmHub(Hub):
    """The demo hub (users, groups, limits) with the Slurm backend on the test cluster, and
    gpuhub's sampler on each node (root, in the node's namespaces, with the hub's sampler
    token): its readings of the fake GPUs (``UTIL_FILE``) decide idle reclaims, as
    ``gpuhub sampler`` on a real cluster's nodes."""

    def __init__(self, workdir, extra_config: str = ""):
        super().__init__(workdir, SLURM_HUB_CONFIG + extra_config, sampler_token=secrets.token_hex(32))
        self.broker_host = HEAD  # the nodes' engines and servers report and ask there
        self.samplers: list[subprocess.Popen] = []

    def start(self, timeout: float = 90) -> SlurmHub:
        super().start(timeout)
        log = open(self.dir / "samplers.log", "a")
        for node in NODES:
            self.samplers.append(
                subprocess.Popen(
                    [str(REPO / "scripts" / "slurm-cluster"), "exec", node,
                     str(VENV_BIN / "gpuhub"), "sampler", "--broker-url", f"http://{HEAD}:{self.broker_port}/services/gpuhub/api/v1/",
                     "--token-file", str(self.sampler_token_file), "--node", node, "--gpus", "4",
                     "--interval", "1", "--source", "simulated", "--simulated-file", str(UTIL_FILE)],
                    stdout=log, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
        log.close()
        return self

    def stop(self, timeout: float = 30) -> None:
        for p in self.samplers:
            p.terminate()
        for p in self.samplers:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        self.samplers = []
        super().stop(timeout)

    def job_id(self, user: str, name: str = "") -> str:
        return self.server(user, name)["state"]["job_id"]

    def server_pid(self, user: str, name: str = "") -> int:
        """The server process of the user's job, found by its SLURM_JOB_ID."""
        job = self.job_id(user, name)
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes()
                if b"-singleuser" not in cmd:  # gpuhub-singleuser gpuhub-singleuser ... (or batchspawner's)
                    continue
                if process_environ(int(proc.name)).get("SLURM_JOB_ID") == job:
                    return int(proc.name)
            except OSError:
                continue
        raise AssertionError(f"no server process of job {job}")


_turns = {"depth": 0, "file": None}


@contextmanager
def cluster_turn():
    """The test cluster for this process alone while it lasts: two test runs on one machine
    (two developers, or two checkouts) would otherwise cancel each other's jobs (a Slurm hub
    test starts and ends by cancelling every job). An flock of the state directory's
    ``run/tests.lock``, re-entrant within a process; without access to it, no turn is taken."""
    if _turns["depth"] == 0:
        try:
            f = open(STATE_DIR / "run" / "tests.lock", "a")
        except OSError:
            f = None
        if f is not None:
            fcntl.flock(f, fcntl.LOCK_EX)
        _turns["file"] = f
    _turns["depth"] += 1
    try:
        yield
    finally:
        _turns["depth"] -= 1
        if _turns["depth"] == 0 and _turns["file"] is not None:
            _turns["file"].close()  # releases the lock
            _turns["file"] = None


@contextmanager
def slurm_hub(workdir, extra_config: str = ""):
    """A started :class:`SlurmHub` on a cluster without jobs; every job ends with it."""
    require_cluster()
    ensure_unix_users()
    with cluster_turn():
        cancel_all_jobs()
        hub = SlurmHub(workdir, extra_config).start()
        try:
            yield hub
        finally:
            hub.stop()
            cancel_all_jobs()


@pytest.fixture(scope="module")
def slurm_cluster_turn():
    """A module's tests have the test cluster alone (:func:`cluster_turn`); a module that
    submits jobs outside :func:`slurm_hub` imports it and names it in ``pytestmark``."""
    with cluster_turn():
        yield
