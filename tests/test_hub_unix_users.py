"""`gpu-local` on real Unix users: each server runs setuid as its user, with its own GPUs."""

import os
import pwd
import shutil
import subprocess

import pytest

from spawner.ledger import Ledger

from .hubtools import Hub

pytestmark = [
    pytest.mark.hub,
    pytest.mark.skipif(os.geteuid() != 0, reason="starting servers as other Unix users needs root"),
]

USERS = ("gpuhubtest1", "gpuhubtest2")


@pytest.fixture
def unix_users():
    made = []
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
            made.append(name)
    yield USERS
    for name in made:
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)


def test_setuid_servers_get_disjoint_gpus(tmp_path, unix_users):
    python = shutil.which("python", path=os.path.dirname(os.sys.executable))
    probe = subprocess.run(
        ["runuser", "-u", unix_users[0], "--", python, "-c", "import jupyterhub.singleuser"],
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, (
        "the test environment must be readable by other Unix users (scripts/setup places it "
        f"so); {unix_users[0]} could not import it:\n{probe.stderr}"
    )
    hub = Hub(
        tmp_path,
        extra_config=f"""
c.JupyterHub.spawner_class = "gpu-local"
c.Authenticator.allowed_users = {set(unix_users)!r}
c.GpuHub.user_limits = {{{unix_users[0]!r}: 3, {unix_users[1]!r}: 1}}
c.LocalProcessSpawner.notebook_dir = "~"
c.JupyterHub.allow_named_servers = True
""",
    ).start()
    ledger = Ledger(hub.ledger_url)
    try:
        assert hub.spawn(unix_users[0], {"gpus": 3}).status_code in (201, 202)
        assert hub.spawn(unix_users[1], {"gpus": 1}).status_code in (201, 202)
        seen = set()
        for name, n in zip(unix_users, (3, 1), strict=True):
            hub.wait_ready(name)
            pid = hub.server_pid(name)
            uid = int(
                next(line.split()[1] for line in open(f"/proc/{pid}/status") if line.startswith("Uid:"))
            )
            assert uid == pwd.getpwnam(name).pw_uid  # really runs as that user
            gpus = set(hub.server_env(name)["CUDA_VISIBLE_DEVICES"].split(","))
            assert len(gpus) == n and not gpus & seen
            seen |= gpus
        r = hub.spawn(unix_users[1], {"gpus": 1}, name="second")
        assert r.status_code == 403 and f"limit of 1 (user {unix_users[1]})" in r.json()["message"]
        for name in unix_users:
            hub.stop_server(name)
        assert ledger.active() == []
    finally:
        hub.stop()
        ledger.close()
