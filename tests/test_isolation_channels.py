"""bob, a second real Unix account, listens in on alice's kernel and on her ``%%distributed`` pool
the way anyone on the machine (or on the Slurm cluster's network) could: he reads her uid's TCP
listeners from ``/proc/net/tcp`` and subscribes a ZeroMQ ``SUB`` socket to every one, then waits
for what she types and what her ranks print. He is also told the Unix sockets her kernel and
her pool's controller listen on (root reads them from her connection files) and connects to each.

Nothing of hers reaches him: her kernel and her local pool's controller listen on no TCP port
(Unix sockets in directories only she can enter), and every TCP socket of a pool (a Slurm pool's
controller on every address, each engine's own loopback helpers) is CurveZMQ, whose handshake a
socket without the key in her connection files never completes. Her next cell works as before.

The attack waits on conditions, never on time alone: ZeroMQ's socket monitor says how each
connection's handshake ended (succeeded, or failed: protocol, authentication, disconnected), and
only a subscription whose handshake succeeded is then read, until her secret arrives.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from .hubtools import DEMO_PASSWORD, kernel_process, wait_for
from .test_broker_pages import login
from .test_isolation import ATTACKER, VICTIM, cell, victim  # noqa: F401  (the fixture)

pytestmark = [
    pytest.mark.hub,
    pytest.mark.skipif(os.geteuid() != 0, reason="two real Unix accounts need root to create and switch"),
]

# bob's listener: every TCP listener of alice's uid (or the ports he was given on another host),
# a SUB socket on each; the Unix sockets he was told of, connected to. It reports which
# handshakes succeeded ("ready"), waits for the go, then reads what the subscriptions bring.
LISTEN = r"""
import json, os, socket, sys, time
import zmq
import zmq.utils.monitor

F = json.loads(sys.argv[1])
R = {"targets": [], "handshakes": {}, "subscribed": [], "seen": [], "unix": {}, "dirs": {}}
secret = F["secret"].encode()


def listeners(uid, wildcard=False):
    found = set()
    for name, family in (("tcp", 4), ("tcp6", 6)):
        try:
            lines = open(f"/proc/net/{name}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            address, port = f[1].rsplit(":", 1)
            if f[3] == "0A" and int(f[7]) == uid and (not wildcard or not address.strip("0")):
                found.add((family, int(port, 16)))  # LISTEN, alice's (on every address)
    return sorted(found)


targets = listeners(F["uid"]) if not F.get("host") else [(4, p) for p in F["ports"]]
R["targets"] = [p for _, p in targets]
R["wildcard"] = [p for _, p in listeners(F["uid"], wildcard=True)]  # reachable from other hosts
R["host"] = socket.gethostname()
ctx = zmq.Context()
ENDED = {
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed: protocol",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "failed: auth",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed",
    zmq.EVENT_DISCONNECTED: "disconnected",
    zmq.EVENT_CLOSED: "closed",
    zmq.EVENT_CONNECT_RETRIED: "refused",
}
subs, monitors = {}, {}
# plain ZMTP on every port; with F["curve"] also as a CurveZMQ client of a guessed server key
modes = [False, True] if F.get("curve") else [False]
for (family, port), curve in [(t, c) for t in targets for c in modes]:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.HANDSHAKE_IVL, 5000)  # a peer that never completes a handshake: failed after 5 s
    if curve:
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()
        s.curve_serverkey = zmq.curve_keypair()[0]  # a guess: some server's public key
    if family == 6:
        s.setsockopt(zmq.IPV6, 1)
    key = f"{port}+curve" if curve else str(port)
    monitors[s.get_monitor_socket()] = key
    host = F.get("host") or ("127.0.0.1" if family == 4 else "[::1]")
    s.connect(f"tcp://{host}:{port}")
    subs[key] = s
poller = zmq.Poller()
for m in monitors:
    poller.register(m, zmq.POLLIN)
deadline = time.monotonic() + 60
while len(R["handshakes"]) < len(monitors) and time.monotonic() < deadline:
    for m, _ in poller.poll(1000):
        event = zmq.utils.monitor.recv_monitor_message(m)["event"]
        key = monitors[m]
        if event in ENDED and key not in R["handshakes"]:
            R["handshakes"][key] = ENDED[event]
R["subscribed"] = sorted(k for k, how in R["handshakes"].items() if how == "succeeded")

for path in F.get("unix", []):
    try:
        u = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        u.connect(path)
        R["unix"][path] = "OPEN"
    except OSError as e:
        R["unix"][path] = type(e).__name__
for path in F.get("dirs", []):
    try:
        os.listdir(path)
        R["dirs"][path] = "OPEN"
    except OSError as e:
        R["dirs"][path] = type(e).__name__

ready = os.path.join(F["exchange"], "ready")
with open(ready + ".tmp", "w") as f:
    json.dump(R, f)
os.rename(ready + ".tmp", ready)
go = os.path.join(F["exchange"], "go")
while not os.path.exists(go):  # the test runs alice's cell, then says go
    time.sleep(0.05)
# read what each subscription that got through brings, until alice's secret is in it
reading = {subs[p]: p for p in R["subscribed"]}
poller = zmq.Poller()
for s in reading:
    poller.register(s, zmq.POLLIN)
deadline = time.monotonic() + 60
while reading and len(R["seen"]) < len(reading) and time.monotonic() < deadline:
    for s, _ in poller.poll(1000):
        frames = s.recv_multipart()
        if any(secret in frame for frame in frames) and reading[s] not in R["seen"]:
            R["seen"].append(reading[s])
print("RESULT " + json.dumps(R), flush=True)
"""


class Listener:
    """bob's :data:`LISTEN` running (as a process of his here, or as ``argv`` that runs it
    elsewhere, e.g. ``srun`` on a node); :meth:`ready` once his sockets are in place,
    :meth:`result` after :meth:`go`."""

    def __init__(self, facts: dict, argv: list[str] | None = None):
        self.exchange = tempfile.mkdtemp(prefix="bob-exchange-")
        os.chmod(self.exchange, 0o777)  # bob writes his report here; nothing of alice's is in it
        facts = dict(facts, exchange=self.exchange)
        script = Path(self.exchange) / "listen.py"
        script.write_text(LISTEN)
        script.chmod(0o644)
        argv = argv or ["runuser", "-u", ATTACKER, "--", sys.executable]
        self.proc = subprocess.Popen(
            [*argv, str(script), json.dumps(facts)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd="/tmp",
        )

    def ready(self) -> dict:
        path = Path(self.exchange) / "ready"
        wait_for(lambda: path.exists() or self.proc.poll() is not None, 120, "bob's sockets")
        if not path.exists():
            out, err = self.proc.communicate()
            raise AssertionError(f"bob's listener failed:\n{out[-3000:]}\n{err[-3000:]}")
        return json.loads(path.read_text())

    def go(self) -> None:
        (Path(self.exchange) / "go").touch()

    def result(self) -> dict:
        out, err = self.proc.communicate(timeout=180)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        assert line, f"bob's listener failed:\n{out[-3000:]}\n{err[-3000:]}"
        return json.loads(line[len("RESULT ") :])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        subprocess.run(["rm", "-rf", self.exchange], check=False)


def tcp_listeners_of(pids: list[int]) -> list[int]:
    """The TCP ports these processes listen on (their socket inodes in /proc/net/tcp{,6})."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    ports = []
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid_net(pids)}/net/{name}").read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                ports.append(int(f[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def pid_net(pids: list[int]) -> str:
    return str(pids[0]) if pids else "self"


def tree(pid: int) -> list[int]:
    import psutil

    p = psutil.Process(pid)
    return [pid, *(c.pid for c in p.children(recursive=True))]


def private(path: str) -> bool:
    st = os.stat(path)
    return st.st_uid == pwd.getpwnam(VICTIM).pw_uid and st.st_mode & 0o777 == 0o700


def attack(kc, facts: dict, code: str, argv: list[str] | None = None) -> tuple[dict, dict]:
    """bob listens (``facts``), alice runs ``code`` (which shows ``facts["secret"]``), bob
    reads. Returns (what bob had in place before her cell, what he got)."""
    bob = Listener(facts, argv)
    try:
        before = bob.ready()
        out = cell(kc, code)
        assert facts["secret"] in out, out  # alice sees her own output
        bob.go()
        return before, bob.result()
    finally:
        bob.close()


def test_bob_cannot_read_alices_kernel(victim):  # noqa: F811
    _, kc = victim
    kid = os.path.basename(kc.connection_file).removeprefix("kernel-").removesuffix(".json")
    pid, connection_file = kernel_process(kid)
    connection = json.load(open(connection_file))  # root reads it; bob is told where it is
    secret = f"alice-{uuid.uuid4().hex}"
    unix = (
        [f"{connection['ip']}-{connection[k]}" for k in ("shell_port", "iopub_port", "control_port")]
        if connection["transport"] == "ipc"
        else []
    )
    facts = {
        "uid": pwd.getpwnam(VICTIM).pw_uid,
        "secret": secret,
        "unix": unix,
        "dirs": [os.path.dirname(connection_file)],
    }
    before, R = attack(kc, facts, f"print({secret!r})")

    assert R["seen"] == [], R  # pre-fix: bob read her execute_input and stream on IOPub
    assert R["subscribed"] == [], R  # no ZeroMQ socket of hers let him in
    assert connection["transport"] == "ipc", connection
    assert tcp_listeners_of(tree(pid)) == []  # her kernel has no TCP port at all
    assert private(os.path.dirname(connection_file))
    assert set(R["unix"].values()) == {"PermissionError"}, R
    assert set(R["dirs"].values()) == {"PermissionError"}, R
    assert before["targets"] == R["targets"]  # he tried every listener of her uid he could see
    # nothing changed for alice
    assert cell(kc, "print(6 * 7)").strip() == "42"


def test_alices_kernel_starts_no_debugger_port_for_bob_to_attach_to(victim):  # noqa: F811
    """ipykernel's debugger listens on a loopback TCP port (debugpy) once a client starts it,
    and whoever attaches first runs code as the kernel's owner. In a gpuhub server the kernel
    says it has no debugger (JupyterLab then offers none) and a debug request opens nothing."""
    _, kc = victim
    kid = os.path.basename(kc.connection_file).removeprefix("kernel-").removesuffix(".json")
    pid, _ = kernel_process(kid)
    kc.kernel_info()
    info = kc.get_shell_msg(timeout=60)
    content = info["content"]
    assert content["status"] == "ok" and "debugger" not in content["supported_features"], content
    assert not content.get("debugger"), content  # the older way of saying it
    for command in ("initialize", "attach"):  # what JupyterLab's debugger sends first
        msg = kc.session.msg(
            "debug_request", {"type": "request", "seq": 1, "command": command, "arguments": {}}
        )
        kc.control_channel.send(msg)
        reply = kc.get_control_msg(timeout=60)
        assert reply["parent_header"]["msg_id"] == msg["header"]["msg_id"]
        assert reply["content"] == {}, reply["content"]  # not handled: no debugpy started
    assert tcp_listeners_of(tree(pid)) == []
    assert cell(kc, "print(6 * 7)").strip() == "42"


POOL_FACTS = (
    "import json, os\np = get_ipython().magics_manager.registry['DistributedMagics'].pool\n"
    "print(json.dumps({'profile': p.cluster.profile_dir, 'cluster_id': p.cluster.cluster_id, "
    "'controller': p.controller_pid, 'engines': p.pids}))"
)


def pool_facts(kc) -> dict:
    pool = json.loads(cell(kc, POOL_FACTS).strip().splitlines()[-1])
    security = os.path.join(pool["profile"], "security")
    pool["client"] = json.load(open(f"{security}/ipcontroller-{pool['cluster_id']}-client.json"))
    pool["engine"] = json.load(open(f"{security}/ipcontroller-{pool['cluster_id']}-engine.json"))
    return pool


def ipc_paths(info: dict) -> list[str]:
    """The Unix sockets of a controller's connection file (its ``ipc://`` interface)."""
    proto, _, base = info["interface"].partition("://")
    if proto != "ipc":
        return []
    ports = [v for v in info.values() if isinstance(v, int)]
    ports += [p for v in info.values() if isinstance(v, list) for p in v]
    return [f"{base}:{p}" for p in ports]


def test_bob_cannot_read_alices_distributed_output(victim):  # noqa: F811
    _, kc = victim
    assert "[rank 1] up" in cell(kc, "%%distributed --gpus 2\nprint('up')")
    pool = pool_facts(kc)
    secret = f"alice-{uuid.uuid4().hex}"
    unix = ipc_paths(pool["client"]) + ipc_paths(pool["engine"])
    facts = {
        "uid": pwd.getpwnam(VICTIM).pw_uid,
        "secret": secret,
        "unix": unix,
        "dirs": sorted({os.path.dirname(p) for p in unix}),
    }
    code = f"%%distributed --gpus 2\nimport sys\nprint({secret!r})\nprint({secret!r}, file=sys.stderr)"
    _, R = attack(kc, facts, code)

    assert R["seen"] == [], R  # pre-fix: every rank's stdout and stderr, from the controller's IOPub
    assert R["subscribed"] == [], R
    # one host: the controller listens on Unix sockets only, in a directory that is hers alone
    assert pool["client"]["interface"].startswith("ipc://"), pool["client"]
    assert tcp_listeners_of(tree(pool["controller"])) == []
    assert len(unix) > 10 and set(R["unix"].values()) == {"PermissionError"}, R
    assert all(private(d) for d in facts["dirs"]) and set(R["dirs"].values()) == {"PermissionError"}, R
    # what is left on TCP (each engine's nanny and heartbeat monitor, on loopback) is CurveZMQ
    engines = tcp_listeners_of([p for pid in pool["engines"] for p in tree(pid)])
    assert set(engines) <= set(R["targets"]), (engines, R)
    assert pool["client"]["curve_serverkey"] and pool["engine"]["curve_serverkey"]
    assert not {R["handshakes"].get(str(p)) for p in engines} & {"succeeded", None}, R

    # alice's pool goes on: the same engines, the group intact
    out = cell(kc, "%%distributed --gpus 2\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(x.item())")
    assert out.count("2.0") == 2, out
    assert json.loads(cell(kc, POOL_FACTS).strip().splitlines()[-1])["engines"] == pool["engines"]
    cell(kc, "%distributed shutdown")
    assert not any(os.path.exists(d) for d in facts["dirs"])  # the socket directory goes with the pool


PANEL = ".jp-NotebookPanel:not(.lm-mod-hidden)"  # the notebook in view
NOTEBOOK = f"{PANEL} .jp-Notebook"
LAB_CELLS = [
    "%%distributed --gpus 2\nprint('up', rank, flush=True)",
    "%%distributed --gpus 2\nprint('looping', rank, flush=True)\nwhile True:\n    pass",
    "%%distributed --gpus 2\nx = torch.ones(1)\ndist.all_reduce(x)\nprint('after', rank, x.item())",
]


def test_jupyterlab_runs_a_distributed_cell_and_its_stop_button_reaches_every_rank(victim, browser):  # noqa: F811
    """alice in JupyterLab (headless Chromium): a ``%%distributed`` cell over the new channels,
    the toolbar's stop button (a kernel interrupt) on a looping one, and the next cell."""
    hub, _ = victim
    notebook = {
        "cells": [{"cell_type": "code", "source": s, "metadata": {}, "outputs": [], "execution_count": None}
                  for s in LAB_CELLS],
        "metadata": {"kernelspec": {"name": "python3-gpus", "display_name": "Python 3 (GPUs)",
                                    "language": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }  # fmt: skip
    name = f"channels-{uuid.uuid4().hex[:8]}.ipynb"
    r = hub.api_url_request(
        "PUT", f"/user/{VICTIM}/api/contents/{name}", json={"type": "notebook", "content": notebook}
    )
    assert r.status_code == 201, r.text
    page = login(browser, hub, VICTIM, DEMO_PASSWORD)
    try:
        # ?reset: a workspace of an earlier run would reopen its notebooks beside this one
        page.goto(f"{hub.url}/user/{VICTIM}/lab/tree/{name}?reset")
        page.wait_for_selector(f"{NOTEBOOK} .jp-Cell", timeout=120_000)
        # the notebook's kernel started and JupyterLab connected to it (the status bar says so)
        page.wait_for_function(
            "() => [...document.querySelectorAll('.jp-StatusBar-Widget')]"
            ".some((w) => /Python 3 \\(GPUs\\) \\| Idle/.test(w.textContent))",
            timeout=120_000,
        )

        def shows(i: int, text: str, timeout: float = 180_000) -> None:
            """Wait until cell ``i``'s output holds ``text`` (in the DOM: JupyterLab may leave a
            cell that is out of view unpainted, which Playwright counts as hidden)."""
            try:
                wait(i, text, timeout)
            except Exception:
                page.screenshot(path="/tmp/gpuhub-lab-failure.png")
                cells = page.evaluate(
                    "(nb) => [...document.querySelectorAll(nb + ' .jp-Cell')].map((c) => c.textContent)",
                    NOTEBOOK,
                )
                raise AssertionError(f"cell {i} never showed {text!r}; the cells: {cells}") from None

        def wait(i: int, text: str, timeout: float) -> None:
            page.wait_for_function(
                """([i, text, notebook]) => {
                  const cell = document.querySelectorAll(notebook + " .jp-Cell")[i];
                  const out = cell && cell.querySelector(".jp-Cell-outputArea");
                  return !!out && out.textContent.includes(text);
                }""",
                arg=[i, text, NOTEBOOK],
                timeout=timeout,
            )

        def run(i: int) -> None:
            """Make cell ``i`` the active one, then the toolbar's run button."""
            cell = page.locator(f"{NOTEBOOK} .jp-Cell").nth(i)
            cell.locator(".jp-InputPrompt").click()
            page.wait_for_function(
                "([i, nb]) => document.querySelectorAll(nb + ' .jp-Cell')[i]"
                ".classList.contains('jp-mod-active')",
                arg=[i, NOTEBOOK],
                timeout=30_000,
            )
            page.locator(f"{PANEL} [data-command='notebook:run-cell-and-select-next']").first.click()

        run(0)
        shows(0, "[rank 1] up 1")
        run(1)
        shows(1, "[rank 1] looping 1")
        page.locator(f"{PANEL} [data-command='notebook:interrupt-kernel']").first.click()  # the stop button
        shows(1, "KeyboardInterrupt", 120_000)
        run(2)  # the next cell, on the same engines
        shows(2, "[rank 1] after 1 2.0")

        # the notebook's kernel listens on Unix sockets only
        [session] = [
            s for s in hub.api_url_request("GET", f"/user/{VICTIM}/api/sessions").json() if s["path"] == name
        ]
        pid, connection_file = kernel_process(session["kernel"]["id"])
        assert json.load(open(connection_file))["transport"] == "ipc"
        assert tcp_listeners_of([pid]) == []  # (its pool's engines: each a nanny's, Curve)
    finally:
        page.close()
        for s in hub.api_url_request("GET", f"/user/{VICTIM}/api/sessions").json():
            if s["path"] == name:
                hub.api_url_request("DELETE", f"/user/{VICTIM}/api/sessions/{s['id']}")


@pytest.fixture(scope="module")
def slurm_victim(tmp_path_factory):
    """alice's server as a Slurm job (2 GPUs on one node), a kernel of it, and bob's Slurm
    association (his own jobs, on her node and on the other)."""
    from . import slurmtools, wskernel

    with slurmtools.slurm_hub(tmp_path_factory.mktemp("slurm-channels")) as hub:
        hub.wait_for_broker()
        slurmtools.slurm("sacctmgr", "-i", "add", "user", ATTACKER, "account=gpuhub", check=False)
        assert hub.spawn(VICTIM, {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready(VICTIM, timeout=120)
        kc, kid = wskernel.server_kernel(hub, VICTIM)
        try:
            yield hub, kc, kid
        finally:
            kc.stop_channels()


def bob_on(node: str) -> list[str]:
    """Run as bob, in a job of his own on ``node`` (its network, its host name)."""
    from . import slurmtools

    return ["sudo", "-u", ATTACKER, "srun", "--account=gpuhub", "-w", node, "-n1", "--gres=none",
            "--job-name=gpuhub-test", str(slurmtools.VENV_BIN / "python")]  # fmt: skip


def test_on_slurm_bob_reads_nothing_of_alices_kernel_or_pool_on_her_node_or_from_another(slurm_victim):
    from .hubtools import process_environ

    _, kc, kid = slurm_victim
    pid, connection_file = kernel_process(kid)
    node = process_environ(pid)["SLURMD_NODENAME"]
    other = next(n for n in ("gpu-node1", "gpu-node2") if n != node)
    connection = json.load(open(connection_file))
    assert "[rank 1] up" in cell(kc, "%%distributed --gpus 2\nprint('up')")
    pool = pool_facts(kc)
    secret = f"alice-{uuid.uuid4().hex}"
    body = f"import sys; print({secret!r}); print({secret!r}, file=sys.stderr)"
    code = f"print({secret!r})\nget_ipython().run_cell_magic('distributed', '--gpus 2', {body!r})"
    unix = [f"{connection['ip']}-{connection[k]}" for k in ("shell_port", "iopub_port", "control_port")]
    facts = {"uid": pwd.getpwnam(VICTIM).pw_uid, "secret": secret, "unix": unix,
             "dirs": [os.path.dirname(connection_file)]}  # fmt: skip

    # bob on her node: every TCP listener of her uid there; then bob on the other node, at her
    # node's address, on what listens on every address there
    _, here = attack(kc, facts, code, bob_on(node))
    facts_there = dict(facts, host=node, ports=here["wildcard"], unix=[], dirs=[], curve=True)
    _, there = attack(kc, facts_there, code, bob_on(other))
    assert here["host"] == node and there["host"] == other and there["targets"] == here["wildcard"]
    assert len(there["handshakes"]) == 2 * len(there["targets"]), there  # plain, and Curve of a guessed key
    assert (here["seen"], there["seen"]) == ([], []), (here, there)  # pre-fix: her cell and ranks' output
    assert (here["subscribed"], there["subscribed"]) == ([], []), (here, there)
    assert set(here["unix"].values()) == {"PermissionError"}, here
    assert set(here["dirs"].values()) == {"PermissionError"}, here
    # her kernel: Unix sockets only; her pool's controller: on every address (engines on other
    # nodes come in), and Curve on each of its sockets
    assert connection["transport"] == "ipc"
    assert tcp_listeners_of([pid]) == []
    assert pool["client"]["curve_serverkey"] and pool["client"]["key"] == ""
    controller = tcp_listeners_of(tree(pool["controller"]))
    assert set(controller) & set(here["wildcard"]) and set(controller) <= set(here["targets"]), here
    assert not {here["handshakes"].get(str(p)) for p in controller} & {"succeeded", None}, here

    # alice's kernel and pool go on
    assert cell(kc, "print(6 * 7)").strip() == "42"
    out = cell(kc, "%%distributed --gpus 2\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(x.item())")
    assert out.count("2.0") == 2, out
    cell(kc, "%distributed shutdown")
