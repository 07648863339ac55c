"""SQLite-only settings of the ledger: commit durability (c.GpuHub.sqlite_synchronous) and the
writers' turns on an flock beside the file."""

import os
import stat

import pytest
from sqlalchemy import text

from spawner.ledger import Ledger
from spawner.policy.placement import Gpu
from spawner.settings import GpuHub


def synchronous(ledger: Ledger) -> int:
    with ledger.engine.connect() as conn:
        return conn.execute(text("PRAGMA synchronous")).scalar()


def test_commits_are_normal_by_default_full_when_asked_and_a_bad_value_is_refused(tmp_path):
    normal = Ledger(f"sqlite:///{tmp_path / 'a.sqlite'}")
    assert synchronous(normal) == 1  # NORMAL
    full = Ledger(f"sqlite:///{tmp_path / 'b.sqlite'}", sqlite_sync="full")
    assert synchronous(full) == 2  # FULL
    with pytest.raises(ValueError, match="sqlite_sync must be one of normal, full"):
        Ledger(f"sqlite:///{tmp_path / 'c.sqlite'}", sqlite_sync="off")
    assert GpuHub().sqlite_synchronous == "normal"
    assert GpuHub(sqlite_synchronous="FULL").sqlite_synchronous == "full"  # the trait is caseless
    normal.close()
    full.close()


def test_writers_take_turns_on_a_private_file_beside_the_ledger_and_go_without_it_when_they_cannot(
    tmp_path,
):
    path = tmp_path / "l.sqlite"
    ledger = Ledger(f"sqlite:///{path}")
    ledger.sync_inventory([Gpu("n", i) for i in range(2)])
    turns = tmp_path / "l.sqlite-writers"
    assert stat.S_IMODE(os.stat(turns).st_mode) == 0o600
    os.unlink(turns)
    os.mkdir(turns)  # a file this process cannot open (root opens any file: a directory stands in)
    other = Ledger(f"sqlite:///{path}")  # a process that cannot open it still admits, by BEGIN IMMEDIATE
    a = other.allocate("alice", [], 1)
    assert a.gpus and other._turns.path is None
    ledger.close()
    other.close()
