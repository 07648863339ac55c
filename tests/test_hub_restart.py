"""A hub restart with cleanup_servers = False: live servers keep their GPUs, dead ones give them back."""

import os
import signal

import pytest

from spawner.ledger import Ledger
from spawner.spawners.local import pid_alive

from .hubtools import Hub, wait_for

pytestmark = pytest.mark.hub


def test_restart_reconciles_the_ledger_with_reality(tmp_path):
    hub = Hub(tmp_path, extra_config="c.JupyterHub.cleanup_servers = False").start()
    ledger = Ledger(hub.ledger_url)
    pids = []
    try:
        for user in ("alice", "bob"):
            assert hub.spawn(user, {"gpus": 2}).status_code in (201, 202)
        for user in ("alice", "bob"):
            hub.wait_ready(user)
        alice_pid, bob_pid = pids[:] = hub.server_pid("alice"), hub.server_pid("bob")
        [alice_alloc] = ledger.active(user="alice")
        [bob_alloc] = ledger.active(user="bob")

        hub.stop()
        # the servers outlive the hub; one of them dies while it is down
        assert os.kill(alice_pid, 0) is None
        os.kill(bob_pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(bob_pid), 10, "bob's server to die")
        assert {a.user for a in ledger.active()} == {"alice", "bob"}  # nobody told the ledger yet

        hub.start()
        wait_for(lambda: ledger.get(bob_alloc.id).state == "released", 60, "bob's GPUs to come back")
        assert ledger.get(bob_alloc.id).end_reason in ("server died while the hub was down", "server exited")
        kept = ledger.get(alice_alloc.id)
        assert kept.state == "running" and kept.gpus == alice_alloc.gpus
        assert hub.server("alice")["ready"] and hub.server_pid("alice") == alice_pid
        assert hub.server("bob") is None
        # the freed GPUs can be taken again, and alice's stay hers
        assert hub.spawn("bob", {"gpus": 2}).status_code in (201, 202)
        hub.wait_ready("bob")
        new_bob = set(hub.server_env("bob")["CUDA_VISIBLE_DEVICES"].split(","))
        assert not new_bob & set(alice_alloc.cuda_visible_devices.split(","))
        hub.stop_server("alice")
        hub.stop_server("bob")
        assert ledger.active() == []
    finally:
        hub.stop()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        ledger.close()
