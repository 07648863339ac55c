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

The ledger is one class, :class:`Ledger`, made of parts, one module each. The parts call
one another through ``self``; what one part offers the others, and who owns it (a name
ending in ``_in`` works inside the caller's transaction ``s``, and is for the parts only;
the underscored ones are the transactions' and the inventory's own machinery):

- ``transactions`` (``LedgerBase``): the database, ``_tx`` (a writing transaction), ``_read``,
  ``_end``/``_end_row`` (an allocation ends), ``_active``/``_live_infos`` (the live ones);
  ``combine`` (``CombinedWrites``): ``_write`` (a write that may share its turn).
- ``admission`` (``AdmissionRecords``): ``allowance``, ``allocate``, ``request``, and for the
  other parts ``holdings_in`` (what counts against a limit), ``grant_in`` (a queue entry's
  turn) and ``book_in`` (every allocation is written there).
- ``allocations`` (``AllocationRecords``): an allocation's life after admission, and
  ``expire_in`` (leases run out; every writer calls it first).
- ``queue`` (``QueueRecords``): waiting; ``scene_in`` (the queue's order and plan),
  ``live_waiting_in``/``end_stale_in`` (entries that still wait); ``asking``
  (``QueueAsking``): a waiter's ``wait_turn`` (``wait_turns``: a hub's waiters at once),
  ``resume_waiting``, and the sweep's ``end_stale_waits``.
- ``borrowing`` (``BorrowingRecords``): ``borrow_allowance``, ``borrowed_part_in`` and
  ``borrow_now_in`` (admission beyond the limit), notices, ``preempt_reason_in``;
  ``borrowing_reads`` (``BorrowingReads``): what the pages show of it.
- ``takeback`` (``TakeBackRecords``): settling notices, ``withdraw_unwanted_in``.
- ``timeup`` (``TimeUpRecords``): time limits that ran out; ``extensions``
  (``ExtensionRecords``): time limits extended, each extension a row.
- ``limits`` (``LimitRecords``): ``_rules`` (the limits in force).
- ``gpus`` (``GpuRecords``): ``_inventory``, ``_free``, ``_present`` (the GPUs).
- ``energy`` (``EnergyRecords``): energy per allocation and day, ``energy_in`` (budgets).
- ``slices`` (``SliceRecords``): slices of GPUs (``check_slice_in``, ``place_now_in``,
  ``plan_slices_in``: the queue's plan for waiting slices).
- ``usage`` (``UsageRecords``) and ``reclaims`` (``ReclaimRecords``: ``reclaim_reason_in``,
  ``undo_if_used_in``).

The records they answer with are :mod:`spawner.policy.records`'s.
"""

from __future__ import annotations

from spawner.ledger.admission import AdmissionRecords
from spawner.ledger.allocations import AllocationRecords
from spawner.ledger.asking import QueueAsking
from spawner.ledger.borrowing import BorrowingRecords
from spawner.ledger.borrowing_reads import BorrowingReads
from spawner.ledger.energy import EnergyRecords
from spawner.ledger.extensions import ExtensionRecords
from spawner.ledger.gpus import GpuRecords
from spawner.ledger.limits import LimitRecords
from spawner.ledger.queue import QueueRecords
from spawner.ledger.reclaims import ReclaimRecords
from spawner.ledger.slices import SliceRecords
from spawner.ledger.takeback import TakeBackRecords
from spawner.ledger.timeup import TimeUpRecords
from spawner.ledger.transactions import BorrowSettings, LedgerBase, QueueSettings, utcnow
from spawner.ledger.usage import UsageRecords
from spawner.policy.records import GpuConflict

__all__ = ["BorrowSettings", "GpuConflict", "Ledger", "QueueSettings", "utcnow"]


class Ledger(
    AdmissionRecords,
    AllocationRecords,
    QueueAsking,
    QueueRecords,
    BorrowingRecords,
    BorrowingReads,
    TakeBackRecords,
    TimeUpRecords,
    ExtensionRecords,
    LimitRecords,
    GpuRecords,
    UsageRecords,
    EnergyRecords,
    ReclaimRecords,
    SliceRecords,
    LedgerBase,
):
    """One ledger database. Safe to use from several processes at once."""
