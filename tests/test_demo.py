"""The README's first command: the demo hub starts, a user logs in and gets a GPU server."""

import os
import re
import signal
import subprocess

import pytest

from .hubtools import REPO, free_port, process_environ, wait_for, xsrf_from

pytestmark = pytest.mark.hub


def test_demo_command_starts_a_hub_where_a_user_gets_gpus(tmp_path):
    import requests

    port, hub_port, api_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "demo.log", "wb")
    env = dict(os.environ, GPUHUB_DEMO_STATE=str(tmp_path / "state"))
    demo = subprocess.Popen(
        [
            str(REPO / "scripts" / "demo"),
            f"--JupyterHub.bind_url={url}",
            f"--JupyterHub.hub_port={hub_port}",
            f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{api_port}",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    s = requests.Session()
    try:
        wait_for(lambda: s.get(f"{url}/hub/login", timeout=2).status_code == 200, 120, "the demo hub")
        printed = (tmp_path / "demo.log").read_text()
        assert "log in as" in printed and "alice (up to 3 GPUs)" in printed
        password = re.search(r"with the password '([^']+)'", printed).group(1)

        page = s.get(f"{url}/hub/login")
        r = s.post(
            f"{url}/hub/login",
            data={"username": "alice", "password": password, "_xsrf": xsrf_from(page.text)},
        )
        assert r.status_code == 200 and r.url.endswith("/hub/spawn"), r.url  # the GPU form
        assert 'data-gpuhub="free">4<' in r.text and 'data-gpuhub="fits">3<' in r.text
        r = s.post(f"{url}/hub/spawn", data={"gpus": "3", "_xsrf": xsrf_from(r.text)})
        assert r.status_code == 200

        def ready():
            r = s.get(f"{url}/hub/api/users/alice", headers={"X-XSRFToken": s.cookies.get("_xsrf")})
            r.raise_for_status()
            server = r.json()["servers"].get("")
            return server if server and server["ready"] else None

        wait_for(ready, 90, "alice's demo server")
        # the server answers through the proxy, behind the hub's login
        lab = s.get(f"{url}/user/alice/lab")
        assert lab.status_code == 200 and "JupyterLab" in lab.text

        # the admin's view: `gpuhub gpus` in the demo's directory shows alice's 3 GPUs
        out = subprocess.run(
            [str(REPO / ".venv" / "bin" / "gpuhub"), "gpus"],
            cwd=tmp_path / "state",
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = [line for line in out.splitlines() if " alice " in f" {line} "]
        assert len(rows) == 3, out
        jobs = {re.search(r"#(\d+)", line).group(1) for line in rows}
        assert len(jobs) == 1
        # and the server process has exactly those GPUs
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        envs = []
        for pid in pids:
            try:
                e = process_environ(pid)
            except OSError:
                continue
            if e.get("JUPYTERHUB_USER") == "alice" and e.get("GPUHUB_ALLOCATION_ID") in jobs:
                envs.append(e)
        assert envs and {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1,2"}
    finally:
        os.killpg(demo.pid, signal.SIGTERM)
        demo.wait(30)
        log.close()
