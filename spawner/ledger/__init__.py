"""The GPU ledger: the single source of truth for who holds which GPU.

Every method is one short transaction (admissions and releases of one process's threads that
wait for the writer's turn at once share one: ``combine``). Admission (``allocate``) reads
what exists, what is free and what the user holds, asks :mod:`spawner.policy.limits`, and writes
the answer, all under the database's write lock (``BEGIN IMMEDIATE`` on SQLite, the
``ledger_lock`` row elsewhere), so several processes can allocate against one database without exceeding a
limit; the partial unique index on held GPUs makes double-booking impossible even if
that lock were bypassed.

Limits come from two places: the ``c.GpuHub.*_limit(s)`` traits and the rows an admin
writes with ``gpuhub limits set``. A row in the database wins over the trait for the same
key (default, one group, one user); ``gpuhub limits unset`` returns that key to the trait.

The ledger is one class, :class:`Ledger`, made of parts, one module each: ``base`` (the
database and transactions), ``combine``, ``inventory``, ``limits``, ``allocations`` (admission),
``queue`` (waiting for GPUs), ``lending`` and ``takeback`` (borrowing, notices), ``usage`` and
``spawner.ledger.reclaims``.
"""

from __future__ import annotations

from spawner.ledger.allocations import AllocationRecords
from spawner.ledger.borrowing import LendingRecords
from spawner.ledger.borrowing_reads import LendingReads
from spawner.ledger.gpus import InventoryRecords
from spawner.ledger.limits import LimitRecords
from spawner.ledger.queue import QueueRecords
from spawner.ledger.reclaims import ReclaimRecords
from spawner.ledger.takeback import TakeBackRecords
from spawner.ledger.transactions import BorrowSettings, LedgerBase, QueueSettings, utcnow
from spawner.ledger.usage import UsageRecords

__all__ = ["BorrowSettings", "Ledger", "QueueSettings", "utcnow"]


class Ledger(
    AllocationRecords,
    QueueRecords,
    LendingRecords,
    LendingReads,
    TakeBackRecords,
    LimitRecords,
    InventoryRecords,
    UsageRecords,
    ReclaimRecords,
    LedgerBase,
):
    """One ledger database. Safe to use from several processes at once."""
