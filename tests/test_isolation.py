"""Users are mutually untrusted: bob, a second real Unix account on the same machine, attacks
what alice's notebook started (her Dask cluster and its dashboard, her `%%distributed`
rendezvous, her ipyparallel engines) and gets nowhere; alice's next cells work as before.

A real hub and proxy with the setuid `gpu-local` spawner, alice's kernel started by her server;
bob's attacks run as bob's own processes (runuser), with only what bob can see: alice's ports
(visible to every account in /proc/net/tcp) and whatever he can read of her files.
"""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
import textwrap

import pytest

from .hubtools import DEMO_PASSWORD, Hub, free_port
from .kerneltools import run_cell
from .slurmtools import ensure_unix_users
from .test_broker_pages import login

pytestmark = [
    pytest.mark.hub,
    pytest.mark.skipif(os.geteuid() != 0, reason="two real Unix accounts need root to create and switch"),
]

VICTIM, ATTACKER = "alice", "bob"


def as_attacker(code: str, **facts) -> dict:
    """Run ``code`` as bob; it gets ``facts`` as ``F`` and fills the dict ``R``, which comes back."""
    script = "import json, sys\nF = json.loads(sys.argv[1])\nR = {}\n" + textwrap.dedent(code)
    script += "\nprint('RESULT ' + json.dumps(R))\n"
    p = subprocess.run(
        ["runuser", "-u", ATTACKER, "--", sys.executable, "-c", script, json.dumps(facts)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/tmp",
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, f"the attack script failed as {ATTACKER}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(line[len("RESULT ") :])


ATTEMPT = """
def attempt(name, f):
    try:
        f()
        R[name] = "OPEN"
    except BaseException as e:
        R[name] = type(e).__name__
"""


@pytest.fixture(scope="module")
def victim(tmp_path_factory):
    """alice's running server (2 simulated GPUs) and a kernel it started."""
    ensure_unix_users((VICTIM, ATTACKER))
    hub = Hub(
        tmp_path_factory.mktemp("isolation"),
        extra_config=f"""
c.JupyterHub.spawner_class = "gpu-local"
c.Authenticator.allowed_users = {{{VICTIM!r}, {ATTACKER!r}}}
c.LocalProcessSpawner.notebook_dir = "~"
""",
    ).start()
    kc = None
    try:
        assert hub.spawn(VICTIM, {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready(VICTIM)
        status = open(f"/proc/{hub.server_pid(VICTIM)}/status").read()
        uid = next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:"))
        assert int(uid) == pwd.getpwnam(VICTIM).pw_uid  # her server really is her account's
        kc = hub.server_kernel(VICTIM, home=pwd.getpwnam(VICTIM).pw_dir)
        yield hub, kc
    finally:
        if kc is not None:
            kc.stop_channels()
        hub.stop()


def cell(kc, code: str, timeout: float = 180) -> str:
    status, out = run_cell(kc, code, timeout)
    assert status == "ok", out
    return out


def test_bob_cannot_reach_alices_dask_cluster_nor_its_dashboard(victim, browser):
    hub, kc = victim
    out = cell(kc, "%dask_cuda --cpu --workers 1")
    assert "Dask cluster up: 1 CPU worker" in out and f"dashboard /user/{VICTIM}/gpuhub/dask/" in out
    facts = json.loads(
        cell(
            kc,
            "import json\nm = get_ipython().magics_manager.registry['DaskMagics']\n"
            "print(json.dumps({'address': client.scheduler.address, 'link': client.dashboard_link, "
            "'socket': m.private.socket, 'pointer': str(m.private.pointer), "
            "'workers': list(client.scheduler_info()['workers'])}))",
        ).strip()
    )
    assert facts["address"].startswith("tls://127.0.0.1:")
    R = as_attacker(
        ATTEMPT
        + """
import os, socket
from distributed import Client
from distributed.security import Security
host_port = F["address"].split("://")[1]
def run_code(address, **kw):
    c = Client(address, timeout=5, **kw)
    c.run(os.getpid)
attempt("plain tcp", lambda: run_code("tcp://" + host_port))
attempt("tls, own cert", lambda: run_code("tls://" + host_port, security=Security.temporary()))
for w in F["workers"]:  # straight to a worker
    attempt("worker " + w, lambda: run_code("tcp://" + w.split("://")[1]))
def dashboard():
    s = socket.socket(socket.AF_UNIX)
    s.connect(F["socket"])
attempt("dashboard socket", dashboard)
attempt("socket directory", lambda: os.listdir(os.path.dirname(F["socket"])))
attempt("pointer file", lambda: open(F["pointer"]).read())
""",
        **facts,
    )
    assert R.pop("dashboard socket") == "PermissionError"
    assert R.pop("socket directory") == "PermissionError"
    assert R.pop("pointer file") == "PermissionError"
    assert R and "OPEN" not in R.values(), R  # every way in to the scheduler and workers failed

    # through the hub: bob's login does not open alice's dashboard; alice's does
    link = f"{hub.url}{facts['link']}"
    mine = hub.login(VICTIM).get(link, timeout=60)
    assert mine.status_code == 200 and "Dask" in mine.text, mine.text[:500]
    theirs = hub.login(ATTACKER).get(link, timeout=60)
    assert theirs.status_code == 403 and "Dask" not in theirs.text
    # in alice's browser the dashboard is live: Bokeh's document arrives over the websocket
    page = login(browser, hub, VICTIM, DEMO_PASSWORD)
    page.goto(link)
    page.wait_for_function(
        "() => window.Bokeh && Bokeh.documents.length > 0 && Bokeh.documents[0].roots().length > 0",
        timeout=60_000,
    )
    page.close()

    # nothing changed for alice
    assert cell(kc, "print(client.submit(lambda x: x + 1, 41).result())").strip() == "42"
    assert "Dask cluster closed" in cell(kc, "%dask_cuda shutdown")
    assert not os.path.exists(facts["socket"]) and not os.path.exists(facts["pointer"])


def test_bob_cannot_join_read_or_write_alices_rendezvous_nor_use_her_engines(victim):
    _, kc = victim
    code = (
        "%%distributed --gpus 2\nimport os, json\nx = torch.ones(1)\ndist.all_reduce(x)\n"
        "if rank == 0:\n"
        "    print('FACTS ' + json.dumps({'addr': os.environ['MASTER_ADDR'], "
        "'port': int(os.environ['MASTER_PORT']), 'sum': x.item()}))"
    )
    out = cell(kc, code)
    facts = json.loads(out.split("FACTS ", 1)[1].splitlines()[0])
    assert facts["sum"] == 2.0
    pool = json.loads(
        cell(
            kc,
            "import json\np = get_ipython().magics_manager.registry['DistributedMagics'].pool\n"
            "print(json.dumps({'rendezvous': p.rendezvous, 'profile': p.cluster.profile_dir, "
            "'cluster_id': p.cluster.cluster_id}))",
        ).strip()
    )
    assert pool["rendezvous"]["kind"] == "file"
    store = pool["rendezvous"]["path"]
    assert os.stat(os.path.dirname(store)).st_mode & 0o777 == 0o700
    client_file = os.path.join(pool["profile"], "security", f"ipcontroller-{pool['cluster_id']}-client.json")
    connection = json.load(open(client_file))  # root reads it; bob gets only what he could see
    R = as_attacker(
        ATTEMPT
        + """
import os, secrets
from datetime import timedelta
import torch.distributed as dist
def join_tcp():
    dist.TCPStore(F["addr"], F["port"], 3, is_master=False, timeout=timedelta(seconds=3))
attempt("tcp store at MASTER_PORT", join_tcp)
attempt("store directory", lambda: os.listdir(os.path.dirname(F["store"])))
attempt("store file read", lambda: open(F["store"], "rb").read())
attempt("store file write", lambda: open(F["store"], "ab").write(b"x"))
attempt("file store", lambda: dist.FileStore(F["store"], 3).set("k", "v"))
attempt("ipyparallel connection file", lambda: open(F["client_file"]).read())
attempt("ipyparallel security directory", lambda: os.listdir(os.path.dirname(F["client_file"])))
def engines():  # the controller's ports are public knowledge; the key is not
    import ipyparallel as ipp
    forged = dict(F["connection"], key=secrets.token_hex(16))
    c = ipp.Client(forged, timeout=5)
    c.wait_for_engines(1, timeout=5)
    c[:].apply_sync(os.getpid)
attempt("ipyparallel with a guessed key", engines)
""",
        store=store,
        client_file=client_file,
        connection=connection,
        **facts,
    )
    assert R == {
        "tcp store at MASTER_PORT": R["tcp store at MASTER_PORT"],
        "store directory": "PermissionError",
        "store file read": "PermissionError",
        "store file write": "PermissionError",
        "file store": R["file store"],
        "ipyparallel connection file": "PermissionError",
        "ipyparallel security directory": "PermissionError",
        "ipyparallel with a guessed key": R["ipyparallel with a guessed key"],
    }, R
    assert "OPEN" not in R.values(), R

    # alice's pool goes on: the same processes, the group intact
    out = cell(
        kc,
        "%%distributed --gpus 2\nx = torch.full((1,), float(rank + 1))\ndist.all_reduce(x)\nprint(x.item())",
    )
    assert out.count("3.0") == 2, out
    cell(kc, "%distributed shutdown")
    assert not os.path.exists(os.path.dirname(store))


def private_to(path: str, user: str) -> bool:
    st = os.lstat(path)
    return os.path.isdir(path) and st.st_uid == pwd.getpwnam(user).pw_uid and st.st_mode & 0o077 == 0


def test_alices_server_has_no_generic_proxy_for_bob_to_listen_behind(victim):
    """bob listens on a loopback port; a page alice's browser loads from her own server's
    ``/proxy/<bob's port>/`` would hand him her cookies. Her server has no such route."""
    hub, _ = victim
    port = free_port()
    listener = subprocess.Popen(
        ["runuser", "-u", ATTACKER, "--", sys.executable, "-c", LISTEN, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert listener.stdout.readline().strip() == "listening"
        alice = hub.login(VICTIM)
        base = f"{hub.url}/user/{VICTIM}"
        answers = {
            path: alice.get(f"{base}/{path}", timeout=30).status_code
            for path in (
                f"proxy/{port}/x.png",
                f"proxy/127.0.0.1:{port}/x.png",
                f"proxy/absolute/{port}/x.png",
                "server-proxy/servers-info",
            )
        }
        assert answers == dict.fromkeys(answers, 404), answers
        assert alice.get(f"{base}/lab", timeout=30).status_code == 200  # the same session reaches her server
    finally:
        listener.terminate()
        got = listener.communicate(timeout=30)[0]
    assert "REQUEST" not in got, got  # not one request reached bob, so no cookie either


LISTEN = """
import socket, sys
s = socket.socket()
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
while True:
    c, _ = s.accept()
    print("REQUEST", c.recv(65536)[:200], flush=True)
    c.close()
"""


def test_bob_cannot_plant_code_in_alices_dask_scratch_nor_stall_it(victim):
    """bob makes distributed's default scratch places first (open to all, a module in each) and
    holds their lock: alice's cluster uses none of them, imports nothing of his, and starts."""
    _, kc = victim
    uid = pwd.getpwnam(VICTIM).pw_uid
    planted = [f"/tmp/dask-scratch-space-{uid}", "/tmp/dask-scratch-space"]
    locker = None
    try:
        R = as_attacker(
            ATTEMPT
            + """
import os
for d in F["planted"]:
    def plant(d=d):
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o777)
        open(os.path.join(d, "bobs_module.py"), "w").write("import os\\nBOB = os.getuid()\\n")
        os.chmod(os.path.join(d, "bobs_module.py"), 0o666)
    attempt(d, plant)
""",
            planted=planted,
        )
        assert R == dict.fromkeys(planted, "OPEN"), R  # /tmp lets him: the names are his now
        locker = subprocess.Popen(
            ["runuser", "-u", ATTACKER, "--", sys.executable, "-c", LOCK, *planted],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert locker.stdout.readline().strip() == "locked"

        out = cell(kc, "%dask_cuda --cpu --workers 1")
        assert "Dask cluster up" in out, out
        facts = json.loads(
            cell(
                kc,
                "import json, os, sys, tempfile\n"
                "def where(dask_worker):\n"
                "    import importlib.util, os\n"
                "    return {'dir': dask_worker.local_directory, 'tmp': os.environ.get('TMPDIR'),\n"
                "            'bob': importlib.util.find_spec('bobs_module') is not None}\n"
                "w = list(client.run(where).values())[0]\n"
                "import importlib.util\n"
                "print(json.dumps({'worker': w, 'kernel_tmp': tempfile.gettempdir(),\n"
                "    'kernel_bob': importlib.util.find_spec('bobs_module') is not None,\n"
                "    'sched_dir': client.run_on_scheduler(lambda dask_scheduler: "
                "dask_scheduler.local_directory)}))",
            ).strip()
        )
        assert facts["kernel_bob"] is False and facts["worker"]["bob"] is False, facts
        for path in (facts["worker"]["dir"], facts["sched_dir"]):
            assert not any(path.startswith(p) for p in planted), facts
        # the worker's scratch lies in directories of alice's that only she can open
        assert private_to(os.path.dirname(os.path.dirname(facts["worker"]["dir"])), VICTIM), facts
        assert private_to(facts["kernel_tmp"], VICTIM), facts
        assert cell(kc, "print(client.submit(lambda x: x * 2, 21).result())").strip() == "42"
        assert "Dask cluster closed" in cell(kc, "%dask_cuda shutdown")
        # nothing of alice's was written into bob's places (the lock file is bob's own)
        assert all(sorted(os.listdir(p)) == ["bobs_module.py", "global.lock"] for p in planted), [
            os.listdir(p) for p in planted
        ]
    finally:
        if locker is not None:
            locker.communicate("", timeout=30)
        subprocess.run(["rm", "-rf", *planted], check=True)


LOCK = """
import fcntl, os, sys
held = []
for d in sys.argv[1:]:
    f = open(os.path.join(d, "global.lock"), "a+")
    fcntl.flock(f, fcntl.LOCK_EX)
    held.append(f)
print("locked", flush=True)
sys.stdin.read()
"""


def test_alices_server_kernel_and_engines_keep_temporary_files_private(victim):
    _, kc = victim
    # the kernel's environment is the one its server gave it (the server makes TMPDIR at start)
    server_tmp = cell(kc, "import os\nprint(os.environ['TMPDIR'])").strip()
    assert server_tmp.startswith("/tmp/gpuhub-") and private_to(server_tmp, VICTIM), server_tmp
    out = cell(kc, "%%distributed --gpus 2\nimport os, tempfile\nprint('TMP', tempfile.gettempdir())")
    engine_tmps = {line.split("TMP ", 1)[1].strip() for line in out.splitlines() if "TMP " in line}
    assert engine_tmps == {server_tmp}, out
    cell(kc, "%distributed shutdown")
    # bob can neither list nor write there
    R = as_attacker(
        ATTEMPT
        + """
import os
attempt("list", lambda: os.listdir(F["tmp"]))
attempt("write", lambda: open(os.path.join(F["tmp"], "x"), "w"))
""",
        tmp=server_tmp,
    )
    assert R == {"list": "PermissionError", "write": "PermissionError"}, R
