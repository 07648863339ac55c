"""What makes a spawn faster changes nothing a user relies on.

- ``spawner.singleuser`` (the server's launcher) defers ``rfc3987_syntax``: a real Jupyter
  server started through it loads its extensions, its event logger still rejects invalid
  events, and an ``iri`` format check gives the same answers as without the launcher;
- the spawner's own wait for the server (``spawner.spawners.readiness``) follows JupyterHub's rule,
  and a server that dies before it answers fails the spawn at once, its GPUs released;
- the Slurm watcher's pause after a submit (``next_interval``), as a table;
- a real hub's servers are started by the launcher and answer with their extensions, and
  their log is quiet: JupyterLab's polls are not logged at INFO, ipyparallel's extension does
  not warn at each start, and a refused request is still logged.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import pytest
import requests
from jupyterhub.httpclient import JupyterHubHTTPClient, fetch
from tornado import web
from tornado.httpserver import HTTPServer

from spawner.ledger import Ledger
from spawner.singleuser import is_routine
from spawner.slurm.reconcile import next_interval
from spawner.spawners import readiness

from . import slurmtools
from .hubtools import REPO, Hub, free_port, wait_for

PY = sys.executable
IRI_VALUES = [
    "http://example.com/ü",
    "https://例え.jp/パス?q=1#frag",
    "urn:isbn:0451450523",
    "http://exa mple.com",  # a space
    "not an iri",
    "//no-scheme",
    "http://[::1]:80/",
    "",
]


def run_python(code: str) -> str:
    out = subprocess.run(
        [PY, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# the launcher's stand-in -----------------------------------------------------------------

IRI_CHECK = """
import json, sys
{setup}
from jsonschema import FormatChecker
before = "rfc3987_syntax.syntax_helpers" in sys.modules
checker = FormatChecker()
answers = {{f: [checker.conforms(v, f) for v in {values!r}] for f in ("iri", "iri-reference")}}
after = "rfc3987_syntax.syntax_helpers" in sys.modules
facts = {{"before": before, "after": after, "answers": answers, "formats": sorted(checker.checkers)}}
print(json.dumps(facts))
"""


def test_the_iri_format_check_gives_the_same_answers_imported_only_when_used():
    deferred = json.loads(
        run_python(
            IRI_CHECK.format(
                setup="from spawner.singleuser import defer_import; defer_import()", values=IRI_VALUES
            )
        )
    )
    plain = json.loads(run_python(IRI_CHECK.format(setup="", values=IRI_VALUES)))
    assert deferred["answers"] == plain["answers"]
    assert deferred["formats"] == plain["formats"]  # no format check lost
    assert {"iri", "iri-reference", "uri", "date-time"} <= set(deferred["formats"])
    assert True in plain["answers"]["iri"] and False in plain["answers"]["iri"]  # the table tells
    assert not deferred["before"] and deferred["after"]  # deferred until the first check
    assert plain["before"]  # without the launcher, importing jsonschema compiles the grammars


def test_nothing_is_deferred_that_is_not_installed_or_already_imported():
    out = run_python(
        """
        import sys
        from spawner.singleuser import DeferredModule, defer_import
        assert defer_import("gpuhub_no_such_package") is None
        assert "gpuhub_no_such_package" not in sys.modules
        import json
        assert defer_import("json") is None and sys.modules["json"] is json
        m = defer_import()
        assert isinstance(sys.modules["rfc3987_syntax"], DeferredModule)
        import rfc3987_syntax.utils  # a submodule imports as usual
        assert isinstance(sys.modules["rfc3987_syntax"], DeferredModule)
        from rfc3987_syntax import is_valid_syntax  # what jsonschema imports
        assert is_valid_syntax("iri", "http://example.com/") and not is_valid_syntax("iri", "a b")
        assert not isinstance(sys.modules["rfc3987_syntax"], DeferredModule)  # the real one now
        assert m.parse("iri", "http://example.com/") is not None  # anything else: the real module's
        print("ok")
        """
    )
    assert out.strip() == "ok"


SERVER = """
import json, logging, sys, tempfile
from spawner.singleuser import defer_import, server_argv
defer_import()
from jsonschema import ValidationError
from jupyter_server.serverapp import ServerApp

app = ServerApp()
app.initialize(argv=server_argv([
    "--allow-root", "--ServerApp.open_browser=False", "--ServerApp.ip=127.0.0.1",
    "--ServerApp.port={port}", "--IdentityProvider.token=", "--ServerApp.root_dir=" + tempfile.mkdtemp(),
    "--ServerApp.jpserver_extensions=gpu_magics.report.reporter=True",
]))

def rejected(schema_id, data):
    try:
        app.event_logger.emit(schema_id=schema_id, data=data)
    except ValidationError:
        return True
    return False

CONTENTS = "https://events.jupyter.org/jupyter_server/contents_service/v1"
IRI_SCHEMA = {{
    "$id": "https://gpuhub.test/events/iri", "version": "1", "title": "iri", "description": "test",
    "type": "object", "required": ["link"],
    "properties": {{"link": {{"title": "link", "description": "an IRI", "type": "string", "format": "iri"}}}},
}}
app.event_logger.register_event_schema(IRI_SCHEMA)
app.event_logger.register_handler(logging.NullHandler())  # events are validated once recorded
facts = {{
    "server_event_invalid_rejected": rejected(CONTENTS, {{"action": "no such action", "path": "a.txt"}}),
    "server_event_valid_accepted": not rejected(CONTENTS, {{"action": "get", "path": "a.txt"}}),
    "grammars_before_iri": "rfc3987_syntax.syntax_helpers" in sys.modules,
    "bad_iri_rejected": rejected(IRI_SCHEMA["$id"], {{"link": "http://exa mple.com"}}),
    "good_iri_accepted": not rejected(IRI_SCHEMA["$id"], {{"link": "http://example.com/ü"}}),
}}
print(json.dumps(facts), flush=True)
app.start()
"""


def test_a_server_started_through_the_launcher_loads_its_extensions_and_validates_events(tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w+")
    env = dict(os.environ, HOME=str(tmp_path), JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"))
    proc = subprocess.Popen(
        [PY, "-c", SERVER.format(port=port)], stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=REPO
    )
    try:
        facts = json.loads(proc.stdout.readline() or "{}")
        assert facts == {
            "server_event_invalid_rejected": True,
            "server_event_valid_accepted": True,
            "grammars_before_iri": False,
            "bad_iri_rejected": True,
            "good_iri_accepted": True,
        }, open(tmp_path / "server.log").read()[-3000:]
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: requests.get(f"{base}/api", timeout=5).ok, 60, "the server to answer")
        assert requests.get(f"{base}/lab", timeout=10).status_code == 200  # jupyterlab
        # jupyter-server-proxy is installed, and its routes are not served (spawner.singleuser)
        for path in ("server-proxy/servers-info", f"proxy/{port}/api", f"proxy/absolute/{port}/api"):
            assert requests.get(f"{base}/{path}", timeout=10).status_code == 404, path
        text = open(tmp_path / "server.log").read()
        for name in ("jupyterlab", "gpu_magics.report.reporter", "ipyparallel"):
            assert f"{name} | extension was successfully loaded" in text, text[-3000:]
        assert "jupyter_server_proxy | extension was successfully loaded" not in text
        assert "extension failed" not in text
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


# the spawner's own wait ------------------------------------------------------------------


@pytest.mark.parametrize(
    "started, proto, base_url, expected",
    [
        (("127.0.0.1", 8888), "http", "/user/alice/", "http://127.0.0.1:8888/user/alice/api"),
        (("gpu-node1", 4321), "https", "/user/bob/gpu/", "https://gpu-node1:4321/user/bob/gpu/api"),
        (("::1", 80), "http", "/user/a/", "http://[::1]:80/user/a/api"),
        (("", 9000), "http", "/user/a/", "http://127.0.0.1:9000/user/a/api"),
        ("http://10.0.0.5:7000", "http", "/user/carol/", "http://10.0.0.5:7000/user/carol/api"),
        ("http://10.0.0.5:7000/ignored", "http", "/", "http://10.0.0.5:7000/api"),
    ],
)
def test_the_probe_asks_what_jupyterhub_asks(started, proto, base_url, expected):
    assert readiness.probe_url(started, proto, base_url) == expected


@pytest.mark.parametrize(
    "status, answer", [(200, True), (302, True), (404, True), (499, True), (500, False), (503, False)]
)
def test_any_answer_but_a_server_error_counts(status, answer):
    assert readiness.is_answer(status) is answer


class Status(web.RequestHandler):
    def get(self):
        self.set_status(self.application.settings["status"])
        self.finish("x")


async def _wait(url, timeout, alive=True):
    async def is_alive():
        return alive

    return await readiness.wait_answering(url, timeout, 0.02, is_alive, fetch)


def test_the_wait_sees_an_answer_a_dead_server_and_a_silent_one():
    async def scenario():
        port = free_port()
        url = f"http://127.0.0.1:{port}/user/a/api"
        gone = await _wait(url, 30, alive=False)  # nothing listens and the process is gone
        server = HTTPServer(web.Application([(r"/.*", Status)], status=200))
        server.listen(port, "127.0.0.1")
        answered = await _wait(url, 30)
        server.stop()
        port = free_port()
        errors = HTTPServer(web.Application([(r"/.*", Status)], status=503))
        errors.listen(port, "127.0.0.1")
        silent = await _wait(f"http://127.0.0.1:{port}/api", 0.3)  # only 5xx: not up
        errors.stop()
        await JupyterHubHTTPClient.loop_instance().close()
        return gone, answered, silent

    assert asyncio.run(scenario()) == (readiness.GONE, readiness.ANSWERED, readiness.TIMEOUT)


# the watcher's pause after a submit --------------------------------------------------------


@pytest.mark.parametrize(
    "previous, changed, waiting, ages, expected",
    [
        (1.0, False, False, [], 2.0),  # nothing new: doubles
        (8.0, False, False, [], 10.0),  # up to max_interval
        (4.0, True, False, [], 1.0),  # a change: back to min_interval
        (4.0, False, True, [], 1.0),  # a spawner waits for an answer
        (4.0, False, False, [0.0], 0.1),  # just submitted: start_interval
        (4.0, False, False, [3.0], 0.3),  # a tenth of its age
        (4.0, False, False, [30.0], 1.0),  # a job that queues: no faster than usual
        (0.5, False, False, [30.0], 1.0),  # ... and the usual rule still applies
        (4.0, False, False, [30.0, 2.0], 0.2),  # the youngest job counts
    ],
)
def test_the_watcher_asks_sooner_right_after_a_submit(previous, changed, waiting, ages, expected):
    got = next_interval(
        previous, changed, waiting, ages, min_interval=1.0, max_interval=10.0, start_interval=0.1
    )
    assert got == pytest.approx(expected)


# the launcher's quiet log ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "routine"),
    [
        ("200 GET /user/alice/api/kernels?1701 (alice@127.0.0.1) 3.21ms", True),
        ("204 HEAD /user/alice/api/status (alice@127.0.0.1) 0.50ms", True),
        ("200 GET /user/alice/api/contents (alice@127.0.0.1) 1500.00ms", False),  # slow: kept
        ("302 GET /user/alice/ -> /user/alice/lab (alice@127.0.0.1) 1.00ms", False),
        ("404 GET /user/alice/nothing (alice@127.0.0.1) 1.00ms", False),
        ("201 POST /user/alice/api/sessions (alice@127.0.0.1) 20.00ms", False),
        ("200 PUT /user/alice/api/contents/a.ipynb (alice@127.0.0.1) 9.00ms", False),
        ("Kernel started: 1234", False),
        ("", False),
    ],
)
def test_only_a_quick_successful_read_is_routine(line, routine):
    assert is_routine(line) is routine


# on a real hub ---------------------------------------------------------------------------


@pytest.fixture
def hub(tidy_demo_hub):
    return tidy_demo_hub


def test_a_hub_server_is_started_by_the_launcher_and_answers_with_its_extensions(hub):
    r = hub.spawn("alice", {"gpus": 1})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("alice")
    try:
        cmdline = open(f"/proc/{hub.server_pid('alice')}/cmdline", "rb").read().split(b"\0")
        assert b"spawner.singleuser" in cmdline
        assert hub.api_url_request("GET", "/user/alice/api/status").status_code == 200
        assert hub.api_url_request("GET", "/user/alice/lab").status_code == 200
        assert hub.api_url_request("GET", "/user/alice/server-proxy/servers-info").status_code == 404
        for _ in range(3):  # what an open JupyterLab asks every few seconds
            assert hub.api_url_request("GET", "/user/alice/api/kernels").status_code == 200
        assert hub.api_url_request("GET", "/user/alice/api/no-such-route").status_code == 404
        wait_for(
            lambda: "/user/alice/api/no-such-route" in hub.log_path.read_text(errors="replace"),
            30,
            "the 404 logged",
        )
        log = hub.log_path.read_text(errors="replace")
        assert "GET /user/alice/api/kernels" not in log
        assert "_jupyter_server_extension_points" not in log
        # JupyterLab asks no new user whether to fetch Jupyter's news (gpuhub's lab defaults)
        notification = hub.api_url_request(
            "GET", "/user/alice/lab/api/settings/@jupyterlab/apputils-extension:notification"
        )
        assert notification.status_code == 200, notification.text
        defaults = {k: v.get("default") for k, v in notification.json()["schema"]["properties"].items()}
        assert defaults["fetchNews"] == "false" and defaults["checkForUpdates"] is False, defaults
    finally:
        hub.stop_server("alice")


def test_a_slurm_server_is_started_by_the_launcher_and_answers(tmp_path):
    with slurmtools.slurm_hub(tmp_path / "slurmhub") as slurm_hub:
        r = slurm_hub.spawn("alice", {"gpus": 1})
        assert r.status_code in (201, 202), r.text
        slurm_hub.wait_ready("alice", timeout=120)
        cmdline = open(f"/proc/{slurm_hub.server_pid('alice')}/cmdline", "rb").read().split(b"\0")
        assert str(slurmtools.VENV_BIN / "gpuhub-singleuser").encode() in cmdline
        assert slurm_hub.api_url_request("GET", "/user/alice/lab").status_code == 200
        # no generic proxy on a Slurm node either, where the server's loopback is everyone's
        assert slurm_hub.api_url_request("GET", "/user/alice/proxy/22/").status_code == 404


def test_a_server_that_dies_before_it_answers_fails_the_spawn_and_frees_its_gpus(tmp_path):
    dying = Hub(
        tmp_path / "hub", extra_config=f'c.Spawner.cmd = ["{PY}", "-c", "import sys; sys.exit(3)"]'
    ).start()
    try:
        r = dying.spawn("bob", {"gpus": 1})
        assert r.status_code in (202, 500), r.text
        if r.status_code == 500:  # failed within the POST's wait (the demo's slow_spawn_timeout)
            message = r.json()["message"]
        else:
            events = list(dying.progress("bob", timeout=60))
            assert events[-1].get("failed"), events
            message = events[-1]["message"]
        # gpuhub's own wait, not JupyterHub's "didn't respond in 60 seconds"
        assert "stopped before it answered" in message, message
        ledger = Ledger(dying.ledger_url)
        wait_for(lambda: not ledger.active(purpose="server"), 30, "bob's GPUs to be released")
        assert dying.server("bob") is None
    finally:
        dying.stop()
