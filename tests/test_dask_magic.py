"""``%dask_cuda``: the pure decisions as tables, the burst path against a fake broker, and the
CPU cluster and the no-GPU refusal through a real kernel."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError
from jupyter_client import KernelManager

from gpu_magics.common.procs import alive as _alive
from gpu_magics.common.ranks import Slot
from gpu_magics.dask import magic as daskmagic
from gpu_magics.dask.magic import (
    DaskMagics,
    DaskRequest,
    make_devices,
    parse_request,
    plan_dask,
)
from gpu_magics.kernel import burst as burstmod
from gpu_magics.kernel.broker import BrokerError
from gpu_magics.report.gpustats import nvml_problem

from .hubtools import wait_for
from .kerneltools import run_notebook

# ---------------------------------------------------------------------------- pure tables


@pytest.mark.parametrize(
    "gpus, cpu, workers, name, own, expected",
    [
        (2, False, None, "client", 0, DaskRequest("gpu", 2, "client")),
        (None, False, None, "client", 3, DaskRequest("gpu", 3, "client")),  # all of the server's
        (1, False, None, "dc", 4, DaskRequest("gpu", 1, "dc")),
        (None, True, None, "client", 0, DaskRequest("cpu", 2, "client")),  # --cpu defaults to 2
        (None, True, 5, "c2", 2, DaskRequest("cpu", 5, "c2")),
    ],
)
def test_parse_request(gpus, cpu, workers, name, own, expected):
    assert parse_request(gpus, cpu, workers, name, own) == expected


@pytest.mark.parametrize(
    "gpus, cpu, workers, name, own, message",
    [
        (0, False, None, "client", 2, "--gpus must be 1 or more; got 0"),
        (-1, False, None, "client", 2, "--gpus must be 1 or more; got -1"),
        (None, True, 0, "client", 0, "--workers must be 1 or more; got 0"),
        (None, False, None, "client", 0, "this server holds no GPUs: say how many, %dask_cuda --gpus N"),
        (2, True, None, "client", 0, "--cpu starts workers without GPUs: size it with --workers N"),
        (None, False, 2, "client", 2, "--workers goes with --cpu"),
        (1, False, None, "my client", 2, "--name must be a Python variable name"),
        (1, False, None, "class", 2, "--name must be a Python variable name"),
    ],
)
def test_parse_request_refuses_with_a_usage_line(gpus, cpu, workers, name, own, message):
    with pytest.raises(UsageError) as e:
        parse_request(gpus, cpu, workers, name, own)
    assert message in str(e.value) and "usage: %dask_cuda --gpus N" in str(e.value)


@pytest.mark.parametrize(
    "own, n, slurm, visible, slots, devices",
    [
        (["n1:2", "n1:3"], 2, False, "2,3", ["n1:2", "n1:3"], "2,3"),
        (["n1:3", "n1:2"], 1, False, "3,2", ["n1:2"], "2"),  # lowest index first, its own entry
        (["n1:0", "n1:1", "n1:5"], 2, False, None, ["n1:0", "n1:1"], "0,1"),  # node indices
        (["n1:4", "n1:6"], 2, True, "0,1", ["n1:4", "n1:6"], "0,1"),  # Slurm renumbered them
        (["n1:4", "n1:6"], 2, True, "", ["n1:4", "n1:6"], "4,6"),
        (["n1:0"], 2, False, "0", [], ""),  # too few: a burst
        ([], 1, False, None, [], ""),
        (["a:0", "b:0"], 2, False, None, [], ""),  # not on one node: a burst
    ],
)
def test_plan_dask(own, n, slurm, visible, slots, devices):
    plan = plan_dask(own, n, slurm, visible)
    assert [s.label for s in plan.slots] == slots
    assert plan.devices == devices


@pytest.mark.parametrize("own", [[], ["n1:0"], ["a:0", "b:0"]])
def test_plan_dask_on_slurm_refuses_a_burst(own):
    with pytest.raises(UsageError) as e:
        plan_dask(own, 2, True, None)
    text = str(e.value)
    assert f"this server holds {len(own)} GPUs" in text and "another node" in text
    assert "Start the server with 2 GPUs" in text and "%%distributed --gpus 2" in text


def test_make_devices_for_a_burst_uses_the_node_indices():
    assert make_devices([Slot("n1", 5), Slot("n1", 7)], (), None) == "5,7"


# ------------------------------------------------------------------ checks before any GPU


def test_no_nvml_is_refused_with_the_reason_and_the_cpu_hint(monkeypatch):
    monkeypatch.setattr(daskmagic, "nvml_problem", lambda: "NVML could not start (no driver)")
    with pytest.raises(UsageError) as e:
        daskmagic.load_local_cuda_cluster()
    text = str(e.value)
    assert "no NVIDIA GPU or driver can be used here (NVML could not start (no driver))" in text
    assert "%dask_cuda --cpu --workers N" in text


@pytest.mark.parametrize(
    "body, shown",
    [
        (None, "ModuleNotFoundError"),  # not installed
        ("raise ImportError(\"cannot import name 'bindings' from 'cuda'\")", "cannot import name 'bindings'"),
        ("raise RuntimeError('CUDA driver version is insufficient')", "RuntimeError: CUDA driver version"),
    ],
)
def test_dask_cuda_that_cannot_import_names_the_install(monkeypatch, tmp_path, body, shown):
    monkeypatch.setattr(daskmagic, "nvml_problem", lambda: None)
    monkeypatch.delitem(sys.modules, "dask_cuda", raising=False)
    if body is None:
        if importlib.util.find_spec("dask_cuda") is not None:
            pytest.skip("dask-cuda is installed here")
    else:
        (tmp_path / "dask_cuda").mkdir()
        (tmp_path / "dask_cuda" / "__init__.py").write_text(body + "\n")
        monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError) as e:
        daskmagic.load_local_cuda_cluster()
    text = str(e.value)
    assert shown in text
    assert "pip install 'jupyterhub-gpuhub[dask-cuda]'" in text and "dask-cuda[cu12]" in text
    assert "%dask_cuda --cpu --workers N" in text


# ------------------------------------------------------ the burst path, with a fake broker


class FakeBroker:
    """Answers like the broker: grants (or refuses) a burst, renews (or has lost) it."""

    def __init__(self, refuse: str | None = None, lost: bool = False):
        self.refuse, self.lost, self.calls = refuse, lost, []

    def request(self, gpus, nodes, gpus_per_node, lease_seconds, node=None, wait=False):
        self.calls.append(("request", gpus, nodes, gpus_per_node) + ((node,) if node else ()))
        if self.refuse:
            raise BrokerError(403, self.refuse, "limit", 1)
        gpus_ = [{"node": "n1", "index": i} for i in (4, 6, 7)[:gpus]]
        return {"id": 7, "gpus": gpus_, "gpu_count": gpus, "lease_expires": "2030-01-01T00:00:00Z"}

    def renew(self, allocation_id, lease_seconds, *more):
        self.calls.append(("renew", allocation_id))
        if self.lost:
            raise BrokerError(404, f"allocation {allocation_id} is not active")
        return {"lease_expires": "2030-01-01T00:05:00Z"}

    def get(self, allocation_id):
        return {"id": allocation_id, "end_reason": "lease expired" if self.lost else None}

    def release(self, allocation_id):
        self.calls.append(("release", allocation_id))

    def made(self, kind: str) -> list:
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def no_server_gpus(monkeypatch):
    for var in ("GPUHUB_GPUS", "GPUHUB_ALLOCATION_ID", "CUDA_VISIBLE_DEVICES", "GPUHUB_BACKEND"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def magics(no_server_gpus):
    m = DaskMagics(shell=SimpleNamespace(user_ns={}))
    m.lease_seconds = 0.3  # renewals (and the watch) every 0.1 s
    yield m
    m.shutdown()


@pytest.fixture
def broker(monkeypatch):
    def install(**kw) -> FakeBroker:
        fake = FakeBroker(**kw)
        monkeypatch.setattr(burstmod.BrokerClient, "from_env", classmethod(lambda cls, environ=None: fake))
        return fake

    return install


@pytest.fixture
def cuda_cluster(monkeypatch):
    """LocalCUDACluster's stand-in: records its arguments, runs a threaded LocalCluster."""
    from distributed import LocalCluster

    calls = []

    class Recording(LocalCluster):
        def __init__(self, n_workers, CUDA_VISIBLE_DEVICES, security, **private):
            calls.append({"n_workers": n_workers, "CUDA_VISIBLE_DEVICES": CUDA_VISIBLE_DEVICES})
            assert security.require_encryption and private["protocol"] == "tls://"
            super().__init__(n_workers=n_workers, processes=False, security=security, **private)

    monkeypatch.setattr(daskmagic, "load_local_cuda_cluster", lambda: Recording)
    return calls


def test_a_refused_burst_is_a_usage_error_with_the_brokers_message(magics, broker, cuda_cluster):
    fake = broker(refuse="you hold 1 of a limit of 2: at most 1 more")
    with pytest.raises(UsageError) as e:
        magics.dask_cuda("--gpus 2")
    assert str(e.value) == "gpuhub refused 2 GPUs for %dask_cuda: you hold 1 of a limit of 2: at most 1 more"
    assert fake.calls == [("request", 2, 1, None)]  # one node: the workers run here
    assert cuda_cluster == [] and magics.burst is None and "client" not in magics.shell.user_ns


def test_on_slurm_a_burst_is_refused_without_asking_the_broker(magics, broker, cuda_cluster, monkeypatch):
    fake = broker()
    monkeypatch.setenv("GPUHUB_BACKEND", "slurm")
    monkeypatch.setenv("GPUHUB_GPUS", "n1:0")
    with pytest.raises(UsageError, match="Start the server with 2 GPUs"):
        magics.dask_cuda("--gpus 2")
    assert fake.calls == [] and cuda_cluster == []


def test_without_a_broker_more_gpus_than_held_are_refused(magics, cuda_cluster, monkeypatch):
    monkeypatch.setattr(burstmod.BrokerClient, "from_env", classmethod(lambda cls, environ=None: None))
    with pytest.raises(UsageError, match="holds 0 and no gpuhub broker is configured"):
        magics.dask_cuda("--gpus 1")
    assert cuda_cluster == []


def test_the_servers_own_gpus_are_used_without_a_burst(magics, broker, cuda_cluster, monkeypatch, capsys):
    fake = broker()
    monkeypatch.setenv("GPUHUB_GPUS", "n1:2,n1:3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    magics.dask_cuda("--gpus 2 --name dc")
    assert cuda_cluster == [{"n_workers": 2, "CUDA_VISIBLE_DEVICES": "2,3"}]
    assert fake.calls == []
    out = capsys.readouterr().out
    up = r"Dask cluster up: 2 workers on GPUs n1:2, n1:3; dashboard /gpuhub/dask/[0-9a-f]{32}/status"
    assert re.search(up, out), out
    assert magics.shell.user_ns["dc"].submit(lambda x: x * 3, 2).result() == 6
    with pytest.raises(UsageError, match=r"already running.*run %dask_cuda shutdown first"):
        magics.dask_cuda("--gpus 1")
    magics.dask_cuda("shutdown")
    assert "dc" not in magics.shell.user_ns and magics.cluster is None


def test_a_burst_is_kept_alive_and_released_at_shutdown(magics, broker, cuda_cluster, capsys):
    fake = broker()
    magics.dask_cuda("--gpus 2")
    assert cuda_cluster[0]["CUDA_VISIBLE_DEVICES"] == "4,6"
    assert "workers on GPUs n1:4, n1:6 (burst allocation #7)" in capsys.readouterr().out
    wait_for(lambda: len(fake.made("renew")) >= 2, 10, "the lease to be renewed")
    magics.dask_cuda("status")
    status = capsys.readouterr().out
    assert "dask-cuda LocalCUDACluster: 2 workers" in status and "GPUs: n1:4, n1:6" in status
    assert "burst allocation #7: lease until 2030-01-01 00:05:00 UTC" in status
    keeper = magics.burst.lease
    magics.dask_cuda("shutdown")
    assert "Dask cluster closed and burst GPUs released." in capsys.readouterr().out
    assert fake.made("release") == [("release", 7)] and magics.burst is None
    keeper._thread.join(5)
    assert not keeper._thread.is_alive()  # no renewal after the release


def test_a_lost_lease_closes_the_cluster(magics, broker, cuda_cluster, capsys):
    broker(lost=True)
    magics.dask_cuda("--gpus 1")
    wait_for(lambda: magics.burst is None, 10, "the burst to be dropped")  # shutdown's last step
    assert magics.cluster is None and "client" not in magics.shell.user_ns
    out = capsys.readouterr().out
    assert "the hub released the burst GPUs of %dask_cuda" in out and "closing the Dask cluster" in out


def test_a_cluster_that_fails_to_start_gives_the_burst_back(magics, broker, monkeypatch):
    fake = broker()

    class broken:
        def __init__(self, **kw):
            raise RuntimeError("CUDA error: no device")

    monkeypatch.setattr(daskmagic, "load_local_cuda_cluster", lambda: broken)
    with pytest.raises(RuntimeError, match="no device"):
        magics.dask_cuda("--gpus 2")
    assert fake.made("release") == [("release", 7)] and magics.burst is None


def test_kernel_exit_closes_the_cluster_and_releases_the_burst(
    no_server_gpus, broker, cuda_cluster, monkeypatch
):
    fake = broker()
    hooks = []
    with monkeypatch.context() as only_here:
        only_here.setattr(daskmagic.atexit, "register", hooks.append)
        m = DaskMagics(shell=SimpleNamespace(user_ns={}))
    assert hooks == [m.shutdown]
    m.dask_cuda("--gpus 1")
    hooks[0]()  # what the interpreter does at exit
    assert m.cluster is None and fake.made("release") == [("release", 7)]


def test_line_commands_take_no_options(magics):
    with pytest.raises(UsageError, match="%dask_cuda status takes no options"):
        magics.dask_cuda("status --gpus 2")
    with pytest.raises(UsageError, match="unrecognized arguments: --nodes=2\nusage: %dask_cuda"):
        magics.dask_cuda("--gpus 2 --nodes=2")


# -------------------------------------------------------------------- through a real kernel


def _kernel_env(tmp_path, **extra) -> dict:
    env = dict(os.environ, IPYTHONDIR=str(tmp_path / "ipython"), **extra)
    for var in ("GPUHUB_GPUS", "GPUHUB_ALLOCATION_ID", "CUDA_VISIBLE_DEVICES", "GPUHUB_BACKEND"):
        env.pop(var, None)
    return env


def _execute(kc, code: str) -> tuple[str, str]:
    """stdout and stderr (a UsageError's message included) of one cell."""
    out = {"stdout": "", "stderr": ""}

    def hook(msg):
        c = msg["content"]
        if msg["msg_type"] == "stream":
            out[c["name"]] += c["text"]
        elif msg["msg_type"] == "error":
            out["stderr"] += "\n".join(c["traceback"])

    kc.execute_interactive(code, timeout=60, output_hook=hook)
    return out["stdout"], out["stderr"]


def test_a_cpu_cluster_runs_tasks_in_its_own_processes_and_shutdown_ends_them(tmp_path):
    km = KernelManager(kernel_name="python3-gpus")
    km.start_kernel(env=_kernel_env(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        out, err = _execute(kc, "%load_ext gpu_magics\n%dask_cuda --cpu --workers 2")
        assert "Dask cluster up: 2 CPU workers (no GPUs); dashboard /gpuhub/dask/" in out, err
        assert "the Client is `client`" in out
        out, err = _execute(
            kc,
            "import os\nprint((client.submit(lambda x: x + 1, 1).result(), "
            "sorted(client.run(os.getpid).values()), os.getpid()))",
        )
        result, pids, kernel_pid = ast.literal_eval(out.strip())
        assert result == 2, err
        assert len(set(pids)) == 2 and kernel_pid not in pids and all(map(_alive, pids))
        out, _ = _execute(kc, "%dask_cuda status")
        assert "LocalCluster (CPU only): 2 workers" in out and "GPUs: none" in out
        _, err = _execute(kc, "%dask_cuda --cpu --workers 1")
        assert "a Dask cluster is already running" in err and "run %dask_cuda shutdown first" in err
        out, _ = _execute(kc, "%dask_cuda shutdown")
        assert "gpuhub: Dask cluster closed." in out
        for pid in pids:  # gone while the kernel still runs
            wait_for(lambda pid=pid: not _alive(pid), 30, f"Dask worker {pid} to exit")
        out, _ = _execute(kc, "print('client' in globals())")
        assert out.strip() == "False"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_kernel_exit_leaves_no_worker(tmp_path):
    _, pids = run_notebook(
        ["%dask_cuda --cpu --workers 1", "import os\nlist(client.run(os.getpid).values())"],
        _kernel_env(tmp_path),
    )
    assert len(pids.result) == 1, pids
    for pid in pids.result:  # nbclient shut the kernel down without %dask_cuda shutdown
        wait_for(lambda pid=pid: not _alive(pid), 30, f"Dask worker {pid} to exit")


class _RecordingBroker(BaseHTTPRequestHandler):
    seen: list = []

    def _answer(self):
        self.seen.append((self.command, self.path))
        body = json.dumps({"message": "refused by the test broker"}).encode()
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer

    def log_message(self, *args):
        pass


def test_without_a_usable_gpu_stack_no_gpu_is_asked_for(tmp_path):
    if nvml_problem() is None and importlib.util.find_spec("dask_cuda") is not None:
        pytest.skip("NVML and dask-cuda work here: %dask_cuda --gpus would really start")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingBroker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = _kernel_env(
            tmp_path,
            GPUHUB_BROKER_URL=f"http://127.0.0.1:{server.server_port}/api/",
            JUPYTERHUB_API_TOKEN="test-token",
        )
        [cell, check] = run_notebook(["%dask_cuda --gpus 1", "'client' in globals()"], env)
    finally:
        server.shutdown()
        server.server_close()
    assert "UsageError: %dask_cuda needs" in cell.stderr, cell
    if nvml_problem():
        assert "no NVIDIA GPU or driver can be used here (" in cell.stderr
    else:
        assert "pip install 'jupyterhub-gpuhub[dask-cuda]'" in cell.stderr
    assert "To try Dask without GPUs: %dask_cuda --cpu --workers N." in cell.stderr
    assert "refused by the test broker" not in cell.stderr
    assert _RecordingBroker.seen == []  # no burst asked for
    assert check.result is False
