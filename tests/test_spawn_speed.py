"""gpuhub-singleuser's faster start changes nothing a server or the hub relies on.

- In a Slurm job it takes batchspawner-singleuser's place: the hub receives the same port
  report (path, token, body) and the command runs with the same arguments and the port in
  ``$JUPYTERHUB_SERVICE_URL``, but without batchspawner and the hub's API handlers
  imported; a port the hub refuses ends it before any server starts; a server's own
  arguments (options, a file to open) are never taken for a command.
- JupyterLab's version is read without ``yarn config``: the same version, and every other
  ``AppOptions`` (a build, an install) still asks yarn for the registry.
- On the test cluster, a spawn through the default launcher answers with its extensions
  loaded (JupyterLab, jupyter-server-proxy, gpuhub's reporter, ipyparallel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from spawner import singleuser
from spawner.slurm.spawner import GpuSlurmSpawner

from . import slurmtools
from .hubtools import REPO

BIN = Path(sys.executable).parent
# what batchspawner-singleuser imports before it reports the port, and a server never needs
# (jupyterhub.singleuser imports the ORM and SQLAlchemy itself: those are not counted here)
HEAVY = ("batchspawner", "batchspawner.api", "batchspawner.batchspawner", "jupyterhub.apihandlers")

# the command the launcher starts: says what it was given and what was imported before it ran
COMMAND = f"""#!{sys.executable}
import json, os, sys
print(json.dumps({{
    "argv": sys.argv,
    "service_url": os.environ.get("JUPYTERHUB_SERVICE_URL"),
    "imported": sorted(m for m in {HEAVY!r} if m in sys.modules),
}}), flush=True)
"""


class FakeHub:
    """Just the hub's ``/hub/api/batchspawner``: records each request, answers ``status``."""

    def __init__(self, status: int = 201):
        self.requests: list[dict] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hub.requests.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": json.loads(body)}
                )
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"message": "fake"}')

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake_hub():
    hub = FakeHub()
    yield hub
    hub.close()


def launch(launcher: str, command: Path, hub: FakeHub, *args: str) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        JUPYTERHUB_API_TOKEN="secret-token",
        JUPYTERHUB_API_URL=f"http://127.0.0.1:{hub.port}/hub/api",
        JUPYTERHUB_SERVICE_URL="http://127.0.0.1:0/user/alice/",
    )
    return subprocess.run(
        [str(BIN / launcher), str(command), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=REPO,
    )


@pytest.fixture
def command(tmp_path):
    path = tmp_path / "fake-singleuser"
    path.write_text(COMMAND)
    path.chmod(0o755)
    return path


def test_the_launcher_reports_the_port_as_batchspawner_does_without_the_hubs_modules(fake_hub, command):
    seen = {}
    for launcher in ("batchspawner-singleuser", "gpuhub-singleuser"):
        out = launch(launcher, command, fake_hub, "--debug", "--SingleUserNotebookApp.default_url=/lab")
        assert out.returncode == 0, out.stderr[-3000:]
        facts = json.loads(out.stdout.strip().splitlines()[-1])
        request = fake_hub.requests.pop()
        port = request["body"]["port"]
        assert request == {
            "path": "/hub/api/batchspawner",
            "auth": "token secret-token",
            "body": {"port": port},
        }
        assert 0 < port < 65536
        assert facts["service_url"] == f"http://127.0.0.1:{port}/user/alice/"
        assert facts["argv"] == [str(command), "--debug", "--SingleUserNotebookApp.default_url=/lab"]
        seen[launcher] = facts["imported"]
    assert not fake_hub.requests  # one report each
    assert seen["batchspawner-singleuser"] == sorted(HEAVY)  # what the old launcher paid for
    assert seen["gpuhub-singleuser"] == []


def test_a_refused_port_ends_the_launcher_before_the_server_starts(command):
    hub = FakeHub(status=409)
    try:
        out = launch("gpuhub-singleuser", command, hub, "--debug")
    finally:
        hub.close()
    assert out.returncode != 0
    assert out.stdout == ""  # the command never ran
    assert "refused the server's port" in out.stderr and "409" in out.stderr


def test_a_servers_own_arguments_are_not_taken_for_a_command(tmp_path, command):
    notebook = tmp_path / "analysis.ipynb"
    notebook.write_text("{}")
    assert singleuser.launched_command(["gpuhub-singleuser"]) is None
    assert singleuser.launched_command(["gpuhub-singleuser", "--debug", str(command)]) is None
    assert singleuser.launched_command(["gpuhub-singleuser", str(notebook)]) is None  # a file to open
    assert singleuser.launched_command(["gpuhub-singleuser", str(command), "--debug"]) == str(command)
    assert singleuser.launched_command(["x", "gpuhub-singleuser"]) == shutil_which("gpuhub-singleuser")


def shutil_which(name: str) -> str | None:
    import shutil

    return shutil.which(name)


def test_the_slurm_spawner_starts_its_servers_through_the_launcher():
    assert os.path.basename(GpuSlurmSpawner().batchspawner_singleuser_cmd) == "gpuhub-singleuser"


# JupyterLab's version without yarn -------------------------------------------------------

LAB_VERSION = """
import json, subprocess, sys
{setup}
calls = []
real = subprocess.check_output
def check_output(argv, *a, **k):
    calls.append(" ".join(map(str, argv)))
    return real(argv, *a, **k)
subprocess.check_output = check_output
from jupyterlab import labapp, commands
at_import = [c for c in calls if "yarn" in c and " config" in c]
registry = commands.AppOptions().registry  # what a build or an install asks for
after = [c for c in calls if "yarn" in c and " config" in c]
print(json.dumps({{"version": labapp.app_version, "yarn_at_import": len(at_import),
                   "yarn_for_options": len(after) - len(at_import), "registry": registry}}))
"""


def run_python(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_jupyterlab_reads_the_same_version_without_running_yarn_and_still_asks_it_for_builds():
    import shutil

    if shutil.which("node") is None:
        pytest.skip("no Node.js on the PATH: JupyterLab runs no yarn either way")
    plain = run_python(LAB_VERSION.format(setup=""))
    launcher = run_python(
        LAB_VERSION.format(
            setup="from spawner.singleuser import defer_lab_registry; assert defer_lab_registry()"
        )
    )
    assert plain["yarn_at_import"] == 1 and launcher["yarn_at_import"] == 0
    assert launcher["version"] == plain["version"]
    assert launcher["yarn_for_options"] == plain["yarn_for_options"] == 1
    assert launcher["registry"] == plain["registry"]


def test_nothing_is_patched_where_jupyterlab_is_imported_already_or_not_as_expected():
    import types

    assert run_python(
        """
        import json, jupyterlab.commands
        from spawner.singleuser import defer_lab_registry
        print(json.dumps({"deferred": defer_lab_registry()}))
        """
    ) == {"deferred": False}
    odd = types.ModuleType("jupyterlab.commands")
    odd.get_app_version = lambda app_options=None: "1"
    assert singleuser.lab_version_without_yarn(odd) is False and odd.get_app_version() == "1"


# on the test cluster -----------------------------------------------------------------------


def test_a_slurm_spawn_through_the_launcher_answers_with_its_extensions(tmp_path):
    with slurmtools.slurm_hub(tmp_path / "slurmhub") as hub:
        r = hub.spawn("alice", {"gpus": 1})
        assert r.status_code in (201, 202), r.text
        hub.wait_ready("alice", timeout=120)
        job = hub.job_id("alice")
        cmdline = open(f"/proc/{hub.server_pid('alice')}/cmdline", "rb").read().split(b"\0")
        launcher = str(slurmtools.VENV_BIN / "gpuhub-singleuser").encode()
        assert cmdline.count(launcher) == 2 and not any(b"batchspawner" in part for part in cmdline)
        assert hub.api_url_request("GET", "/user/alice/lab").status_code == 200  # jupyterlab
        # jupyter-server-proxy's generic routes are off (spawner.singleuser.SERVER_ARGS)
        assert hub.api_url_request("GET", "/user/alice/server-proxy/servers-info").status_code == 404
        text = Path(f"/home/alice/.gpuhub-server-{job}.log").read_text()
        for name in ("jupyterlab", "gpu_magics.report.reporter", "ipyparallel", "jupyterhub"):
            assert f"{name} | extension was successfully loaded" in text, text[-3000:]
        assert "jupyter_server_proxy | extension was successfully loaded" not in text
        assert "extension failed" not in text
        hub.stop_server("alice")
