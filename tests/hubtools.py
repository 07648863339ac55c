"""A real JupyterHub with the real configurable-http-proxy, for end-to-end tests.

Each hub gets its own directory (SQLite files, cookie secret, logs) and free loopback
ports. Waits are on conditions with deadlines, never fixed sleeps.
"""

from __future__ import annotations

import html
import json
import os
import random
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import requests

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "hub_config" / "demo.py"
# a test hub's own passwords (the demo makes its own per state directory: hub_config/demo.py);
# the admin's is the one tests/test_broker_pages.py logs in with
DEMO_PASSWORD = secrets.token_urlsafe(12)
ADMIN_PASSWORD = "gpuhub-demo-admin-password-change-me"


_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before in this process: the kernel may
    give a port just closed straight back, and a hub's own port and its proxy's, asked for one
    after the other, would then be the same ("Address already in use"). Under pytest-xdist
    each worker takes only ports of its own residue (port % workers), so two workers never
    hand out the same port."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    mine = int((os.environ.get("PYTEST_XDIST_WORKER") or "gw0")[2:] or 0)
    # chosen here, not by bind(0): Linux gives bind(0) odd ports only (even ones are kept for
    # connect), so with two workers the even residue would never come; below the ephemeral
    # range (ip_local_port_range), where outgoing connections never take them
    while True:
        port = random.randrange(10000 + mine, 30000, workers)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use
        _handed_out.add(port)
        return port


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except (requests.ConnectionError, OSError) as e:
            last_error = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last_error})")


def kernel_process(kernel_id: str) -> tuple[int, str]:
    """(pid, connection file) of the running kernel ``kernel_id`` of any server here: its
    command line names ``kernel-<id>.json`` (``-f``), wherever its server keeps kernels."""
    name = f"kernel-{kernel_id}.json"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == "-f" and os.path.basename(argv[i + 1]) == name:
                return int(proc.name), argv[i + 1]
    raise LookupError(f"no process of kernel {kernel_id}")


def kernel_connection_file(kernel_id: str) -> str:
    return kernel_process(kernel_id)[1]


def find_process(words: list[str], environ: str = "") -> int:
    """The one process whose command line has each of ``words`` (and whose environment has
    ``environ``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            env = (entry / "environ").read_bytes().decode(errors="replace") if environ else ""
        except OSError:
            continue
        if all(w in cmd for w in words) and environ in env:
            return int(entry.name)
    raise AssertionError(f"no process with {words} {environ}".rstrip())


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def xsrf_from(html: str) -> str:
    """The page's XSRF token: a hidden field, or the query of the form's action URL."""
    m = re.search(r'name="_xsrf"\s+value="([^"]+)"', html) or re.search(r"[?&]_xsrf=([^&\"']+)", html)
    assert m, "no _xsrf in the page"
    return unquote(m.group(1).replace("&amp;", "&"))


class Hub:
    def __init__(
        self,
        workdir: Path,
        extra_config: str = "",
        base_config: Path = DEMO_CONFIG,
        python: Path | None = None,
        ledger_url: str | None = None,
        sampler_token: str | None = None,
    ):
        self.python = python  # run the hub with this Python (an installed gpuhub), not this test's
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.hub_port = free_port()
        self.proxy_api_port = free_port()
        self.broker_port = free_port()
        self.broker_host = "127.0.0.1"  # where the broker listens (and servers reach it)
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_config = extra_config
        self._ledger_url = ledger_url  # default: a SQLite file in the hub's directory
        self.base_config = base_config
        self.proc: subprocess.Popen | None = None
        self.log_path = self.dir / "jupyterhub.log"
        # the nodes' samplers' token (enable_broker's sampler_token_file), in a file of root's
        self.sampler_token_file = None
        if sampler_token is not None:
            self.sampler_token_file = self.dir / "sampler.token"
            fd = os.open(self.sampler_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(sampler_token)

    @property
    def ledger_url(self) -> str:
        return self._ledger_url or f"sqlite:///{self.dir / 'gpuhub.sqlite'}"

    def write_config(self) -> Path:
        cfg = self.dir / "jupyterhub_config.py"
        cfg.write_text(
            f"""
c = get_config()
load_subconfig({str(self.base_config)!r})
# the demo's showcase (borrowing, a 60 s notice, idle reclaim in minutes, students' 8 h and
# their extensions, GPUs whose use follows their processes) is not the test hubs': each test
# sets what it tests, over the defaults
for section, key in [("GpuHub", "default_borrow"), ("GpuHub", "preempt_grace_seconds"),
                     ("GpuHub", "group_max_hours"), ("GpuHub", "extension_max_hours"),
                     ("GpuHub", "simulated_load"), ("GpuHub", "gpu_slices"),
                     ("GpuReclaim", "warn_after_seconds"), ("GpuReclaim", "reclaim_after_seconds")]:
    c[section].pop(key, None)
# a test hub: the tests' passwords, and servers as the tests' own user (root in CI), wherever
# the demo would run them (as root it runs them as Unix accounts of its own)
c.SharedPasswordAuthenticator.user_password = {DEMO_PASSWORD!r}
c.SharedPasswordAuthenticator.admin_password = {ADMIN_PASSWORD!r}
c.JupyterHub.spawner_class = "gpu-local-simple"
c.Spawner.args = ["--allow-root"]
c.JupyterHub.bind_url = {self.url!r}
c.JupyterHub.hub_port = {self.hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{self.proxy_api_port}"
c.ConfigurableHTTPProxy.should_start = True
c.JupyterHub.db_url = "sqlite:///{self.dir / "jupyterhub.sqlite"}"
c.GpuHub.db_url = {self.ledger_url!r}
c.JupyterHub.cookie_secret_file = "{self.dir / "cookie_secret"}"
c.SimpleLocalProcessSpawner.home_dir_template = "{self.dir}/home/{{username}}"
c.JupyterHub.services = [{{"name": "gpuhub-test", "api_token": {self.token!r}}}]
c.JupyterHub.load_roles = [{{
    "name": "gpuhub-test",
    "scopes": ["admin:users", "admin:servers", "admin:server_state", "admin:groups",
               "access:servers", "tokens"],
    "services": ["gpuhub-test"],
}}]
c.Spawner.start_timeout = 60
c.Spawner.http_timeout = 60
c.Spawner.poll_interval = 1
c.GpuBroker.sweep_seconds = 1
{self.extra_config}
from spawner.broker import enable_broker
enable_broker(
    c,
    url="http://{self.broker_host}:{self.broker_port}",
    sampler_token_file={None if self.sampler_token_file is None else str(self.sampler_token_file)!r},
)
"""
        )
        return cfg

    def start(self, timeout: float = 90) -> Hub:
        cfg = self.write_config()
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        bindir = Path(self.python or sys.executable).parent
        env["PATH"] = f"{REPO / 'node_modules' / '.bin'}:{bindir}:{env['PATH']}"
        # this checkout's hub through gpuhub's launcher (JupyterHub without an unused parser:
        # seconds per start, spawner/hub.py); an installed gpuhub through the plain command
        python = self.python or sys.executable
        command = [str(python), "-m", "spawner.hub" if self.python is None else "jupyterhub"]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*command, "-f", str(cfg)],
            cwd=self.dir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"the hub exited ({self.proc.returncode}):\n{self.log()}")
            return requests.get(f"{self.url}/hub/api/", timeout=2).status_code == 200

        wait_for(up, timeout, "the hub to answer")
        return self

    def wait_for_broker(self, timeout: float = 60) -> Hub:
        """Wait until the broker service answers an authenticated request."""
        token = self.user_token("admin")
        wait_for(lambda: self.broker("GET", "me", token).status_code == 200, timeout, "the broker")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 30) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None

    # REST -----------------------------------------------------------------------------

    def api(self, method: str, path: str, **kw) -> requests.Response:
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.request(method, f"{self.url}/hub/api{path}", headers=headers, timeout=30, **kw)

    @property
    def broker_url(self) -> str:
        return f"{self.url}/services/gpuhub"

    def broker(self, method: str, path: str, token: str | None = None, **kw) -> requests.Response:
        """Call the broker's REST API (through the proxy) with ``token`` (default: the test admin's)."""
        headers = {"Authorization": f"token {token or self.token}", **kw.pop("headers", {})}
        return requests.request(method, f"{self.broker_url}/api/v1/{path}", headers=headers, timeout=30, **kw)

    def user_token(self, user: str, scopes: list[str] | None = None) -> str:
        """A new API token of ``user`` (all the user's scopes unless ``scopes`` narrows them)."""
        self.ensure_user(user)
        body = {"note": "gpuhub test"} | ({"scopes": scopes} if scopes is not None else {})
        r = self.api("POST", f"/users/{user}/tokens", json=body)
        assert r.status_code == 201, r.text
        return r.json()["token"]

    def api_url_request(self, method: str, path: str, **kw) -> requests.Response:
        """A request to any path behind the proxy (e.g. a server's API) with the test token."""
        headers = {"Authorization": f"token {self.token}", **kw.pop("headers", {})}
        return requests.request(method, f"{self.url}{path}", headers=headers, timeout=30, **kw)

    def ensure_user(self, name: str) -> None:
        r = self.api("GET", f"/users/{name}")
        if r.status_code == 404:
            assert self.api("POST", f"/users/{name}").status_code == 201

    def server(self, user: str, name: str = "") -> dict | None:
        r = self.api("GET", f"/users/{user}")
        r.raise_for_status()
        return r.json()["servers"].get(name)

    def spawn(self, user: str, user_options: dict | None = None, name: str = "") -> requests.Response:
        self.ensure_user(user)
        body = {} if user_options is None else {"user_options": user_options}
        return self.api("POST", f"/users/{user}/servers/{name}", json=body)

    def wait_ready(self, user: str, name: str = "", timeout: float = 90) -> dict:
        def ready():
            s = self.server(user, name)
            if s is None:
                raise AssertionError(f"{user}'s server is gone:\n{self.log()}")
            return s if s["ready"] else None

        return wait_for(ready, timeout, f"{user}'s server to be ready", interval=0.25)

    def progress(self, user: str, name: str = "", timeout: float = 90):
        """The spawn's progress events, as JupyterHub's progress API streams them to the
        spawn page, until the spawn is ready or failed."""
        path = f"/users/{user}/server/progress" if not name else f"/users/{user}/servers/{name}/progress"
        url = f"{self.url}/hub/api{path}"
        headers = {"Authorization": f"token {self.token}"}
        deadline = time.monotonic() + timeout
        while True:
            with requests.get(url, headers=headers, stream=True, timeout=timeout) as r:
                # jupyterhub 6.1.1 answers 400 "not starting" while it cleans up a failed start
                # (User.stop clears the pending flag before the start's future has failed);
                # the spawn page reloads then (docs/known-issues.md), and so does this reader
                if r.status_code == 400 and "not starting" in r.text and time.monotonic() < deadline:
                    time.sleep(0.2)
                    continue
                assert r.status_code == 200, f"{r.status_code} {r.text}"
                for line in r.iter_lines(decode_unicode=True):
                    if line.startswith("data:"):
                        event = json.loads(line[5:])
                        yield event
                        if event.get("ready") or event.get("failed"):
                            return
                return

    def spawn_waits(self, user: str, user_options: dict, words: str = "waiting for") -> str:
        """A start that waits in the queue, as its progress says: that progress message. The
        POST answers 202, or 201 where the user's last start failed (jupyterhub 6.1.1 answers
        from a spawner it has already replaced: docs/known-issues.md), so the wait is read from
        the progress stream rather than from the status code."""
        r = self.spawn(user, user_options)
        assert r.status_code in (201, 202), r.text
        return self.wait_progress(user, words)

    def refusal(self, r: requests.Response, user: str, name: str = "") -> str:
        """What refused ``user``'s start that the answer ``r`` began: the 4xx's own message, or,
        where the refusal came after the hub stopped waiting for the start (the REST API's
        ``slow_spawn_timeout``, the form's 1 s; a loaded machine), the failed progress event's
        message. A start that did not fail is an AssertionError."""
        if r.status_code >= 400:
            try:
                return r.json()["message"]
            except ValueError:
                return html.unescape(r.text)  # the spawn form, shown again with the reason
        assert r.status_code in (200, 201, 202), f"{r.status_code} {r.text}"
        events = list(self.progress(user, name, timeout=90))
        assert events and events[-1].get("failed"), f"the start did not fail: {events}"
        return events[-1].get("message", "")

    def wait_progress(self, user: str, words: str, name: str = "", timeout: float = 90) -> str:
        """The first progress message of ``user``'s pending spawn that holds ``words``."""
        seen = []
        for event in self.progress(user, name, timeout):
            message = event.get("message", "")
            seen.append(message)
            if words in message:
                return message
        raise AssertionError(f"no progress message with {words!r}; got {seen}\n{self.log()[-3000:]}")

    def stop_server(self, user: str, name: str = "", timeout: float = 60) -> None:
        r = self.api("DELETE", f"/users/{user}/servers/{name}")
        assert r.status_code in (202, 204), r.text
        wait_for(lambda: self.server(user, name) is None, timeout, f"{user}'s server to stop")

    def server_kernel(self, user: str, home: str | None = None):
        """A client of a ``python3-gpus`` kernel that ``user``'s running server started (as
        JupyterLab would), connected and ready; the caller stops its channels. ``home``: the
        user's home where it is not the test hub's (a real Unix account's)."""
        from jupyter_client import BlockingKernelClient

        r = self.api_url_request("POST", f"/user/{user}/api/kernels", json={"name": "python3-gpus"})
        assert r.status_code == 201, r.text
        # in the user's runtime directory, or a private one of the server's (gpu_magics.common.channels)
        conn = kernel_connection_file(r.json()["id"])
        kc = BlockingKernelClient(connection_file=conn)
        kc.load_connection_file()
        # no heartbeat channel: a client that does not own the kernel reads one heartbeat late
        # by 1 s (a busy 2-core machine) as "the kernel died"; kernel_info's reply says it is up
        kc.start_channels(hb=False)
        kc.wait_for_ready(timeout=60)
        return kc

    def server_pid(self, user: str, name: str = "") -> int:
        return int(self.server(user, name)["state"]["pid"])

    def broker_pid(self) -> int:
        """The hub's broker process (a managed service listening on the hub's broker port)."""
        return find_process(["spawner.broker"], environ=f":{self.broker_port}")

    def proxy_pid(self) -> int:
        """The hub's configurable-http-proxy (started by the hub, listening on its port)."""
        return find_process(["configurable-http-proxy", f"--port {self.port}"])

    def server_env(self, user: str, name: str = "") -> dict[str, str]:
        """The environment of the running server process, read from /proc."""
        return process_environ(self.server_pid(user, name))

    # browser-less login ----------------------------------------------------------------

    def login(self, user: str, password: str = DEMO_PASSWORD) -> requests.Session:
        s = requests.Session()
        page = s.get(f"{self.url}/hub/login", timeout=30)
        page.raise_for_status()
        r = s.post(
            f"{self.url}/hub/login?next=",
            data={"username": user, "password": password, "_xsrf": xsrf_from(page.text)},
            timeout=30,
            allow_redirects=False,
        )
        assert r.status_code == 302, f"login failed for {user}: {r.status_code}"
        return s


def user_tokens(hub: Hub, names=("alice", "bob", "carol", "dave", "admin")) -> dict[str, str]:
    return {name: hub.user_token(name) for name in names}


def tidy_ledger(hub: Hub, stop_servers: bool = False):
    """The hub's ledger, for a fixture to yield; after the test nothing waits, no burst is
    held, and (``stop_servers``) no demo user's server runs."""
    from spawner.ledger import Ledger

    led = Ledger(hub.ledger_url)
    try:
        yield led
    finally:
        led.close()
        tidy(hub, stop_servers)


def tidy(
    hub: Hub, stop_servers: bool = False, users=("alice", "bob", "carol", "dave"), limits: bool = False
) -> None:
    """Nothing waits in ``hub``'s queue and no burst is held; with ``stop_servers``, none of
    ``users``' servers runs; with ``limits``, no limit is stored in the ledger (the hub's
    configuration holds again). A hub that tests share is left as the next one expects it."""
    from spawner.ledger import Ledger

    led = Ledger(hub.ledger_url)
    try:
        if limits:
            for e in led.limit_entries():
                if e.origin == "ledger":
                    led.unset_limit(e.scope, e.name)
        for q in led.queue():
            led.leave_queue(q.id, "test cleanup")
        for a in led.active():
            if a.purpose == "distributed":
                led.release(a.id, "test cleanup")
    finally:
        led.close()
    if stop_servers:
        for user in users:
            r = hub.api("GET", f"/users/{user}")
            if r.status_code == 200 and "" in r.json()["servers"]:
                hub.stop_server(user)


def browser_login(browser, hub: Hub, user: str, password: str = DEMO_PASSWORD):
    """A new Chromium page logged in to ``hub`` as ``user`` through the login form."""
    page = browser.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    return page
