"""The ledger's core: its database and transactions, and the rows read back as records
(:mod:`spawner.policy.records`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Connection, Row, bindparam, event, exists, func, select, update
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, selectinload

from spawner import policy
from spawner.ledger.combine import CombinedWrites
from spawner.ledger.db import (
    WriterTurns,
    connection,
    ensure_schema,
    make_engine,
    make_session_factory,
)
from spawner.ledger.freeset import CHANGES, note_held, record_moves
from spawner.ledger.models import (
    Allocation,
    AllocationGpu,
    GpuRow,
    LedgerLock,
    Node,
    Preemption,
    QueueEntry,
    is_live,
)
from spawner.policy import borrowing, fairshare
from spawner.policy.budgets import BudgetRules
from spawner.policy.energy import Costing
from spawner.policy.extensions import ExtendSettings
from spawner.policy.records import AllocationInfo
from spawner.policy.slices import Offer
from spawner.policy.timelimits import TimeRules

log = logging.getLogger("gpuhub.ledger")

_LOCK = LedgerLock.__table__
# every writing transaction's first statement: the lock row, counted up at once (a row lock on
# PostgreSQL, as SELECT ... FOR UPDATE; SQLite's BEGIN IMMEDIATE has the file already), with
# what the transaction needs to know of it
# whether a lease has run out or anyone waits: almost always not, and then an admission reads
# neither
_DUE_FLAGS = (
    exists()
    .where(is_live(), Allocation.lease_expires <= bindparam("now"))
    .correlate_except(Allocation)
    .label("leases_due"),
    exists().where(QueueEntry.state == "waiting").correlate_except(QueueEntry).label("waiting"),
)
_TURN = update(_LOCK).where(_LOCK.c.id == 1).values(generation=_LOCK.c.generation + 1)
# SQLite: the flags in the same statement (its writers take turns before BEGIN IMMEDIATE, so the
# statement sees every earlier write)
TAKE_TURN = _TURN.returning(_LOCK.c.generation, _LOCK.c.inventory, _LOCK.c.moves_after, *_DUE_FLAGS)
# PostgreSQL: an UPDATE that waited for the lock row sees that row as the last writer left it,
# but its subqueries see the snapshot taken before the wait (READ COMMITTED): a queue entry or
# lease the last writer made would be missed, and an admission would pass a waiting user's turn.
# So the flags come from a statement of their own, after the lock is held.
TAKE_TURN_ONLY = _TURN.returning(_LOCK.c.generation, _LOCK.c.inventory, _LOCK.c.moves_after)
DUE_FLAGS = select(*_DUE_FLAGS)


_PIPELINED: dict[str, tuple[str, dict, str, dict]] = {}


def _pipelined_turn(conn: Connection, now: datetime) -> _Turn:
    """PostgreSQL: the transaction's start, the lock row and then the due flags in one round
    trip (the driver's pipeline: the server runs them in order, so the flags' statement, with
    a snapshot of its own, still starts after the lock is held) instead of three."""
    dialect = conn.dialect.name
    if dialect not in _PIPELINED:
        lock = TAKE_TURN_ONLY.compile(dialect=conn.dialect)
        # the live states' IN list rendered in place (the driver knows nothing of expanding lists)
        expanded = DUE_FLAGS.params(now=now).compile(
            dialect=conn.dialect, compile_kwargs={"render_postcompile": True}
        )
        flags_sql = str(expanded)
        params = DUE_FLAGS.compile(dialect=conn.dialect).params
        flags_params = {k: v for k, v in params.items() if f"%({k})s" in flags_sql}
        _PIPELINED[dialect] = (str(lock), lock.params, flags_sql, flags_params)
    lock_sql, lock_params, flags_sql, flags_params = _PIPELINED[dialect]
    raw = conn.connection.driver_connection
    with raw.pipeline():
        took = raw.execute(lock_sql, lock_params)
        due = raw.execute(flags_sql, {**flags_params, "now": now})
    return _Turn(*took.fetchone(), *due.fetchone())


@dataclass(frozen=True)
class _Turn:
    """The lock row's turn and the due flags, as one row of TAKE_TURN has them."""

    generation: int
    inventory: int
    moves_after: int | None
    leases_due: bool
    waiting: bool


_A, _AG = Allocation.__table__, AllocationGpu.__table__
END_ALLOCATION = (
    update(_A)
    .where(_A.c.id == bindparam("allocation"))
    .values(state="released", ended=bindparam("at"), end_reason=bindparam("reason"))
)
FREE_GPUS = (
    update(_AG)
    .where(_AG.c.allocation_id == bindparam("allocation"), _AG.c.held)
    .values(held=False)
    .returning(_AG.c.gpu_id, _AG.c.part, _AG.c.parts)
)
UNCOUNT = update(_LOCK).where(_LOCK.c.id == 1).values(generation=_LOCK.c.generation - 1)


@dataclass(frozen=True)
class QueueSettings:
    """The queue's settings (``c.GpuHub``'s, checked by ``GpuHub.open_ledger``)."""

    shares: fairshare.Shares = field(default_factory=fairshare.Shares)
    weights: fairshare.Weights = field(default_factory=fairshare.Weights)
    keepalive_seconds: float = 30.0
    max_wait_hours: float = 12.0
    default_run_hours: float = 2.0
    reservations: int = 1
    min_run_seconds: float = 300.0  # shorter runs (and those gpuhub ended) say nothing of a user's


@dataclass(frozen=True)
class BorrowSettings:
    """Borrowing beyond the limit (``c.GpuHub``'s, checked by ``GpuHub.open_ledger``)."""

    rules: borrowing.BorrowRules = field(default_factory=borrowing.BorrowRules)
    grace_seconds: float = 300.0
    count_borrowed_hours: bool = True


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _info(a: Allocation, booked: Iterable[policy.Gpu] | None = None) -> AllocationInfo:
    """The record of ``a``; ``booked``: the GPUs of one just written (nothing to load)."""
    gpus = tuple(sorted(booked if booked is not None else (held_gpu(ag) for ag in a.gpus)))
    preemption = None if booked is not None else a.preemption
    pending = preemption is not None and preemption.withdrawn is None
    return AllocationInfo(
        id=a.id,
        user=a.user,
        purpose=a.purpose,
        server_name=a.server_name,
        state=a.state,
        created=a.created,
        started=a.started,
        ended=a.ended,
        backend=a.backend,
        backend_job_id=a.backend_job_id,
        end_reason=a.end_reason,
        gpus=gpus,
        lease_expires=a.lease_expires,
        gpu_count=_count(a),
        idle_deadline=a.idle_deadline,
        borrowed=a.borrowed or 0,
        preempt_due=preemption.due if pending else None,
        preempt_reason=preemption.reason if pending else None,
        withdrawn=preemption.withdrawn if preemption is not None else None,
        withdrawn_reason=preemption.withdrawn_reason if preemption is not None else None,
        backfill=a.backfill_for is not None,
        of_server=bool(a.of_server),
        time_limit_seconds=a.time_limit_seconds,
        slice_parts=a.slice_parts,
    )


def gpus_of(allocation_id):
    """A scalar subquery: how many GPUs the allocation ``allocation_id`` (a column) names."""
    return (
        select(func.count())
        .select_from(AllocationGpu)
        .where(AllocationGpu.allocation_id == allocation_id)
        .correlate_except(AllocationGpu)
        .scalar_subquery()
    )


def _count(a: Allocation) -> int:
    return max(a.gpu_count or 0, len(a.gpus))


# what a policy.Gpu is made of, in its order
_GPU_COLUMNS = (GpuRow.index, GpuRow.model, GpuRow.memory_mib, GpuRow.uuid)
_PART_COLUMNS = (AllocationGpu.part, AllocationGpu.parts)  # ... and of a slice


def _gpu(g: GpuRow) -> policy.Gpu:
    return policy.Gpu(g.node.name, g.index, g.model, g.memory_mib, g.uuid)


def slice_of(node, index, model, memory_mib, uuid, part=0, parts=0) -> policy.Gpu:
    """The GPU an allocation holds: the whole GPU, or its ``part`` of ``parts`` (with that
    share of its memory)."""
    if part and memory_mib is not None:
        memory_mib //= parts
    return policy.Gpu(node, index, model, memory_mib, uuid, part, parts)


def held_gpu(ag: AllocationGpu) -> policy.Gpu:
    """What the allocation-GPU row ``ag`` holds: its GPU, or a slice of it."""
    g = ag.gpu
    return slice_of(g.node.name, g.index, g.model, g.memory_mib, g.uuid, ag.part or 0, ag.parts or 0)


class LedgerBase(CombinedWrites):
    """The database and its transactions; the other parts of :class:`Ledger` build on these."""

    def __init__(
        self,
        url: str,
        *,
        config_rules: policy.LimitRules | None = None,
        clock: Callable[[], datetime] = utcnow,
        queue: QueueSettings | None = None,
        borrow: BorrowSettings | None = None,
        time_rules: TimeRules | None = None,
        time_warnings: tuple[float, ...] = (),
        extend: ExtendSettings | None = None,
        costing: Costing | None = None,
        budgets: BudgetRules | None = None,
        sqlite_sync: str = "normal",
        slice_offers: Mapping[str, Offer] | None = None,
        slice_groups: Iterable[str] = (),
    ):
        self.url = url
        self.slice_offers = dict(slice_offers or {})  # c.GpuHub.gpu_slices, by model (ledger/slices.py)
        self.slice_groups = frozenset(slice_groups)  # c.GpuHub.slice_groups
        self.config_rules = config_rules or policy.LimitRules()
        self.queue_settings = queue or QueueSettings()
        self.borrow_settings = borrow or BorrowSettings()
        self.time_rules = time_rules or TimeRules()  # the longest sessions (c.GpuHub.*_max_hours)
        self.time_warnings = tuple(time_warnings)  # minutes before a time limit's end (c.GpuHub)
        self.extend_settings = extend or ExtendSettings()  # c.GpuHub.extension_*
        self.costing = costing or Costing()  # c.GpuHub.pue, energy_price, energy_currency
        self.budgets = budgets or BudgetRules()  # c.GpuHub.*_energy_budget(s)
        self.clock = clock
        self.engine = make_engine(url, sqlite_sync=sqlite_sync)
        ensure_schema(self.engine, url)
        self._sessions = make_session_factory(self.engine)
        self._reader = make_engine(url, writer=False, sqlite_sync=sqlite_sync)
        self._read_sessions = make_session_factory(self._reader)
        self._turns = WriterTurns(url)
        self._init_combined()
        event.listen(self._sessions, "after_flush", note_held)
        with self._sessions.begin() as s:
            if s.get(LedgerLock, 1) is None:
                s.add(LedgerLock(id=1, generation=0))

    def close(self) -> None:
        self.engine.dispose()
        self._reader.dispose()
        self._turns.close()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """A writing transaction, holding the ledger's write lock. It counts up the lock's
        ``generation`` (what readers compare to know nothing changed) unless it sets
        ``s.info["changed"] = False`` (a waiter's keepalive, which changes no decision).

        The count is taken with the lock, in the same statement; a transaction that changed
        nothing gives it back before it commits (one statement more, for keepalives only)."""
        with self._turns.turn():
            s, conn, turn = self._begin_write()
            with s:  # closing it rolls back whatever did not commit
                after, before = turn.generation, turn.generation - 1
                s.info["connection"], s.info["generation"] = conn, before
                s.info["inventory"] = turn.inventory  # read under the lock: what _present compares
                s.info["moves_after"] = turn.moves_after or 0
                s.info["leases_due"], s.info["waiting"] = bool(turn.leases_due), bool(turn.waiting)
                yield s
                s.flush()
                if s.info.get("changed", True) or s.info.get(CHANGES):  # a GPU that moved always counts
                    record_moves(conn, s.info, after)
                else:
                    conn.execute(UNCOUNT)
                    after = before
                s.commit()
        self._committed(s, before, after)

    def _begin_write(self) -> tuple[Session, Connection, Row]:
        """A session in a writing transaction, its connection, and the lock row's turn.

        The writer's pool does not ping a connection before each use (a round trip per
        transaction): a connection the server dropped (a restart) fails at this first
        statement, before anything is decided, and the transaction starts on a fresh one."""
        for attempt in (1, 2):
            s = self._sessions()
            try:
                conn = s.connection()
                if conn.dialect.name != "postgresql":
                    return s, conn, conn.execute(TAKE_TURN, {"now": self.clock()}).one()
                return s, conn, _pipelined_turn(conn, self.clock())
            except DBAPIError as e:
                s.close()
                if attempt == 2 or not e.connection_invalidated:
                    raise
            except self.engine.dialect.dbapi.OperationalError:  # the pipeline's: the driver's own
                conn.invalidate()
                s.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _committed(self, s: Session, before: int, after: int) -> None:
        """Called after a writing transaction committed (``GpuRecords`` keeps the
        free GPUs with it)."""

    def _generation(self, s: Session) -> int:
        return s.scalar(select(LedgerLock.generation).where(LedgerLock.id == 1)) or 0

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """A reading transaction: a consistent snapshot that blocks no writer."""
        with self._read_sessions.begin() as s:
            yield s

    def _end(self, a: Allocation, reason: str, when: datetime | None = None) -> None:
        a.state = "released"
        a.ended = when or self.clock()
        a.end_reason = reason[:255]
        for ag in a.gpus:
            ag.held = False

    def _end_row(self, s: Session, allocation_id: int, reason: str) -> None:
        """``_end`` in two statements, for an allocation not loaded as an object (a release)."""
        conn, at = connection(s), self.clock()
        conn.execute(END_ALLOCATION, {"allocation": allocation_id, "at": at, "reason": reason[:255]})
        freed = conn.execute(FREE_GPUS, {"allocation": allocation_id})
        s.info.setdefault(CHANGES, []).extend((gpu_id, False, part, parts) for gpu_id, part, parts in freed)

    def _live_infos(self, s: Session, **where) -> list[AllocationInfo]:
        """The records of the live allocations (filtered by column values), in id order: read
        in three queries of plain rows, not as objects (thousands on a large cluster)."""
        rows = select(Allocation.__table__).where(is_live())
        for key, value in where.items():
            rows = rows.where(getattr(Allocation, key) == value)
        live = rows.subquery()
        gpus: dict[int, list[policy.Gpu]] = {}
        q = (
            select(AllocationGpu.allocation_id, Node.name, *_GPU_COLUMNS, *_PART_COLUMNS)
            .join(live, live.c.id == AllocationGpu.allocation_id)
            .join(GpuRow, GpuRow.id == AllocationGpu.gpu_id)
            .join(Node, Node.id == GpuRow.node_id)
        )
        for aid, *g in s.execute(q):
            gpus.setdefault(aid, []).append(slice_of(*g))
        notices = {
            aid: rest
            for aid, *rest in s.execute(
                select(
                    Preemption.allocation_id,
                    Preemption.due,
                    Preemption.reason,
                    Preemption.withdrawn,
                    Preemption.withdrawn_reason,
                ).join(live, live.c.id == Preemption.allocation_id)
            )
        }
        out = []
        # sorted here: an ORDER BY id makes SQLite walk every allocation ever made in id order
        for a in sorted(s.execute(rows).mappings(), key=lambda a: a["id"]):
            held = tuple(sorted(gpus.get(a["id"], ())))
            due, reason, withdrawn, withdrawn_reason = notices.get(a["id"], (None,) * 4)
            if withdrawn is not None:  # no notice stands
                due = reason = None
            out.append(
                AllocationInfo(
                    id=a["id"],
                    user=a["user"],
                    purpose=a["purpose"],
                    server_name=a["server_name"],
                    state=a["state"],
                    created=a["created"],
                    started=a["started"],
                    ended=a["ended"],
                    backend=a["backend"],
                    backend_job_id=a["backend_job_id"],
                    end_reason=a["end_reason"],
                    gpus=held,
                    lease_expires=a["lease_expires"],
                    gpu_count=max(a["gpu_count"] or 0, len(held)),
                    idle_deadline=a["idle_deadline"],
                    borrowed=a["borrowed"] or 0,
                    preempt_due=due,
                    preempt_reason=reason,
                    withdrawn=withdrawn,
                    withdrawn_reason=withdrawn_reason,
                    backfill=a["backfill_for"] is not None,
                    of_server=bool(a["of_server"]),
                    time_limit_seconds=a["time_limit_seconds"],
                    slice_parts=a["slice_parts"],
                )
            )
        return out

    def _active(self, s: Session, **where) -> list[Allocation]:
        q = (
            select(Allocation)
            .where(is_live())
            .options(
                selectinload(Allocation.gpus).selectinload(AllocationGpu.gpu).selectinload(GpuRow.node),
                selectinload(Allocation.preemption),
            )
            .order_by(Allocation.id)
        )
        for key, value in where.items():
            q = q.where(getattr(Allocation, key) == value)
        return list(s.scalars(q))
