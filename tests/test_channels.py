"""gpu_magics.common.channels' pieces without a hub: where kernels' and pools' Unix sockets go, and the
GPU kernel's refusal of TCP in a gpuhub server (the attacks themselves:
tests/test_isolation_channels.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpu_magics.common import channels
from gpu_magics.launch.controller import ipc_url


def test_socket_dirs_are_new_private_and_short_enough(tmp_path, monkeypatch):
    made = channels.socket_dir("gpuhub-test-", channels.CONTROLLER_SOCKET_NAME)
    try:
        assert channels.is_private_dir(made) and channels.fits(made, channels.CONTROLLER_SOCKET_NAME)
        assert made != channels.socket_dir("gpuhub-test-", channels.CONTROLLER_SOCKET_NAME)  # never reused
    finally:
        os.rmdir(made)
    deep = tmp_path / ("x" * 90)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)
    made = channels.socket_dir("gpuhub-test-", channels.CONTROLLER_SOCKET_NAME)
    try:
        assert made.startswith("/tmp/gpuhub-test-") and channels.is_private_dir(made)  # no room in TMPDIR
    finally:
        os.rmdir(made)


@pytest.fixture
def short_tmp():
    path = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own is too deep for a socket's name
    yield path
    shutil.rmtree(path)


def test_the_runtime_directory_is_used_when_private_and_short_else_a_new_one(short_tmp):
    tmp_path = short_tmp
    runtime = tmp_path / "rt"
    runtime.mkdir()
    os.chmod(runtime, 0o755)
    assert channels.kernel_connection_dir(str(runtime)) == (str(runtime), False)
    assert os.stat(runtime).st_mode & 0o777 == 0o700  # ours and open: closed
    link = tmp_path / "link"
    link.symlink_to(runtime)
    other, made = channels.kernel_connection_dir(str(link))  # a symlink is not taken
    assert made and other != str(link) and channels.is_private_dir(other)
    os.rmdir(other)
    deep = tmp_path / ("y" * 60)
    deep.mkdir(mode=0o700)
    other, made = channels.kernel_connection_dir(str(deep))
    assert made and channels.fits(other, channels.KERNEL_SOCKET_NAME)
    os.rmdir(other)


def test_a_gpuhub_servers_kernel_refuses_a_tcp_connection_file(tmp_path):
    tcp, ipc = tmp_path / "tcp.json", tmp_path / "ipc.json"
    tcp.write_text(json.dumps({"transport": "tcp", "ip": "127.0.0.1"}))
    ipc.write_text(json.dumps({"transport": "ipc", "ip": str(tmp_path / "k")}))
    env = {channels.TRANSPORT_ENV: "ipc"}
    assert "TCP" in channels.tcp_refusal(["k", "-f", str(tcp)], env)
    assert channels.tcp_refusal(["k", f"--f={tcp}"], env)
    assert channels.tcp_refusal(["k", "-f", str(ipc)], env) is None
    assert channels.tcp_refusal(["k", "-f", str(tcp)], {}) is None  # not in a gpuhub server
    assert channels.kernel_transport(["k"]) is None
    # the kernel itself: ends before binding anything, saying why
    p = subprocess.run(
        [sys.executable, "-m", "gpu_magics.kernel", "-f", str(tcp)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 1 and "--KernelManager.transport=ipc" in p.stderr


def test_ipc_urls_are_the_ones_engines_and_clients_connect_to():
    assert ipc_url("ipc:///tmp/d/c-4242", "ipc:///tmp/d/c") == "ipc:///tmp/d/c:4242"
    assert ipc_url("tcp://0.0.0.0:4242", "tcp://0.0.0.0") == "tcp://0.0.0.0:4242"
    assert ipc_url("ipc:///tmp/d/c:4242", "ipc:///tmp/d/c") == "ipc:///tmp/d/c:4242"


@pytest.mark.parametrize(
    "environ, allowed",
    [
        ({"GPUHUB_KERNEL_TRANSPORT": "ipc"}, False),  # a gpuhub server: no debugpy port
        ({}, True),  # a laptop's Jupyter: ipykernel as it is
        ({"GPUHUB_KERNEL_TRANSPORT": "tcp"}, True),
    ],
)
def test_the_debugger_is_off_in_a_gpuhub_server(environ, allowed):
    from gpu_magics.kernel.launcher import debugger_allowed

    assert debugger_allowed(environ) is allowed
