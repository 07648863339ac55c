"""The ledger's tables: SQLAlchemy 2.0 typed models, in a database of their own.

The schema is what makes double-booking impossible: ``allocation_gpus`` has a partial
unique index on ``gpu_id`` over the rows still ``held``, so two live allocations can never
name the same GPU, whichever process writes them. Changes to this file need an Alembic
revision in ``spawner/ledger/migrations/versions``; ``tests/test_ledger.py`` checks that the
migrations and these models agree.

Times are naive UTC.
"""

from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
    bindparam,
    false,
    literal_column,
    text,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from spawner.policy.records import ACTIVE_STATES

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

ALLOCATION_STATES = (*ACTIVE_STATES, "released")
PURPOSES = ("server", "distributed")
SCOPES = ("default", "group", "user")
QUEUE_STATES = ("waiting", "granted", "left")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class Node(Base):
    __tablename__ = "nodes"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(255), unique=True)
    gpus: Mapped[list[GpuRow]] = relationship(back_populates="node", order_by="GpuRow.index")


class GpuRow(Base):
    """A GPU as the ledger stores it (read back as ``spawner.policy.Gpu``)."""

    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "index", name="uq_gpus_node_index"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    node_id: Mapped[int] = mapped_column(ForeignKey("nodes.id"))
    index: Mapped[int] = mapped_column(Integer)
    model: Mapped[str] = mapped_column(String(255))
    memory_mib: Mapped[int | None] = mapped_column(Integer)
    uuid: Mapped[str | None] = mapped_column(String(255))
    # False once the inventory no longer reports it; kept for history and live holders
    present: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    node: Mapped[Node] = relationship(back_populates="gpus")


class LimitRow(Base):
    __tablename__ = "limits"
    __table_args__ = (
        UniqueConstraint("scope", "name", name="uq_limits_scope_name"),
        CheckConstraint("scope IN ('default', 'group', 'user')", name="scope"),
        CheckConstraint("max_gpus IS NULL OR max_gpus >= 0", name="max_gpus"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    scope: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(255))  # "" for the default
    max_gpus: Mapped[int | None] = mapped_column(Integer)
    gpu_hours: Mapped[float | None] = mapped_column(Float)
    window_hours: Mapped[float | None] = mapped_column(Float)
    updated: Mapped[datetime] = mapped_column(DateTime)


class Allocation(Base):
    __tablename__ = "allocations"
    __table_args__ = (
        CheckConstraint("state IN ('starting', 'running', 'released')", name="state"),
        CheckConstraint("purpose IN ('server', 'distributed')", name="purpose"),
        Index("ix_allocations_user_state", "user", "state"),
        Index(
            "ix_allocations_live",
            "lease_expires",
            sqlite_where=text("state IN ('starting', 'running')"),
            postgresql_where=text("state IN ('starting', 'running')"),
        ),
        Index("ix_allocations_user_ended", "user", "ended"),
        Index("ix_allocations_ended", "ended"),
        Index(
            "ix_allocations_borrowed",
            "user",
            sqlite_where=text("borrowed > 0"),
            postgresql_where=text("borrowed > 0"),
        ),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    user: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(16))
    server_name: Mapped[str] = mapped_column(String(255), default="")
    state: Mapped[str] = mapped_column(String(16))
    created: Mapped[datetime] = mapped_column(DateTime)
    started: Mapped[datetime | None] = mapped_column(DateTime)
    ended: Mapped[datetime | None] = mapped_column(DateTime)
    backend: Mapped[str] = mapped_column(String(32), default="local")
    backend_job_id: Mapped[str | None] = mapped_column(String(64))
    end_reason: Mapped[str | None] = mapped_column(String(255))
    # burst allocations live only while renewed; None for servers (the backend tracks them)
    lease_expires: Mapped[datetime | None] = mapped_column(DateTime)
    # GPUs asked for; counts against the limit even before the backend has placed them
    # (a queued Slurm job). None on rows older than migration 0003: len(gpus) then.
    gpu_count: Mapped[int | None] = mapped_column(Integer)
    # when the idle reclaim will take it back unless it is used (the owner was warned): the
    # queue's firmest expected end; written by the broker's idle check (migration 0005)
    idle_deadline: Mapped[datetime | None] = mapped_column(DateTime)
    # GPUs of it beyond the user's limit when admitted (borrowed; 0: all within the limit):
    # only such allocations are ever preempted (migration 0006)
    borrowed: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # queue entries (ids, comma-separated) whose reservation it started ahead of (backfill):
    # until every one of them has started or left, it may be taken back for them with notice,
    # as borrowed GPUs are (migration 0009); None: it went ahead of nobody
    backfill_for: Mapped[str | None] = mapped_column(String(4000))
    # a burst asked for by a kernel of the server ``server_name``: released when that server
    # stops or dies, whoever stops it (migration 0010); False for servers and other bursts
    of_server: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # how long it may run from its start (c.GpuHub.*_max_hours, or less as asked); NULL: no limit
    time_limit_seconds: Mapped[float | None] = mapped_column(Float)
    # a slice of a GPU split in this many parts (c.GpuHub.gpu_slices): each of its GPUs counts
    # as 1/slice_parts of one against limits and in GPU-hours; NULL: whole GPUs (migration 0014)
    slice_parts: Mapped[int | None] = mapped_column(Integer)
    gpus: Mapped[list[AllocationGpu]] = relationship(
        back_populates="allocation", cascade="all, delete-orphan"
    )
    preemption: Mapped[Preemption | None] = relationship(viewonly=True, uselist=False)


class AllocationGpu(Base):
    __tablename__ = "allocation_gpus"
    __table_args__ = (
        # The guarantee: a GPU is held by at most one allocation at a time.
        Index(
            "uq_allocation_gpus_held_gpu",
            "gpu_id",
            unique=True,
            sqlite_where=text("held = 1 AND part = 0"),
            postgresql_where=text("held AND part = 0"),
        ),
        # ... and each slice of a GPU by at most one (a slice holder holds the GPU's row with
        # its part): that a GPU is never held whole and in slices at once, the ledger's write
        # lock keeps (spawner/ledger/slices.py), as it keeps the limits (migration 0014)
        Index(
            "uq_allocation_gpus_held_part",
            "gpu_id",
            "part",
            unique=True,
            sqlite_where=text("held = 1 AND part > 0"),
            postgresql_where=text("held AND part > 0"),
        ),
        CheckConstraint("part >= 0 AND parts >= 0 AND part <= parts", name="part"),
    )

    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id"), primary_key=True)
    gpu_id: Mapped[int] = mapped_column(ForeignKey("gpus.id"), primary_key=True)
    held: Mapped[bool] = mapped_column(Boolean, default=True)
    # a slice: ``part`` (1 to ``parts``) of the GPU split in ``parts``; 0 and 0: the whole GPU
    part: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    parts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    allocation: Mapped[Allocation] = relationship(back_populates="gpus")
    gpu: Mapped[GpuRow] = relationship()


class KnownUser(Base):
    """A user a spawner has seen, with their JupyterHub groups at that time: what lets any
    process (the CLI too) work out everyone's effective limit, e.g. for Slurm accounting."""

    __tablename__ = "known_users"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    groups: Mapped[str] = mapped_column(String(4000), default="")  # comma-separated
    updated: Mapped[datetime] = mapped_column(DateTime)


class Reclaim(Base):
    """An allocation taken back because its GPUs sat idle: what, whose, why, and the idle
    GPU-hours it had run up (GPUs x idle time when reclaimed)."""

    __tablename__ = "reclaims"

    id: Mapped[int] = mapped_column(primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id"), unique=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    purpose: Mapped[str] = mapped_column(String(16))
    server_name: Mapped[str] = mapped_column(String(255), default="")
    gpus: Mapped[int] = mapped_column(Integer)
    idle_seconds: Mapped[float] = mapped_column(Float)
    gpu_hours: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(String(500))
    created: Mapped[datetime] = mapped_column(DateTime)


class QueueEntry(Base):
    """A request that fits its user's limit but not the free GPUs, waiting its turn.

    ``seen`` is when its waiter (the hub's spawn, a kernel's magic) last asked about it: an
    entry nobody asks about for ``c.GpuHub.queue_keepalive_seconds`` leaves the queue. A
    granted entry names the allocation it became."""

    __tablename__ = "queue_entries"
    __table_args__ = (
        CheckConstraint("state IN ('waiting', 'granted', 'left')", name="state"),
        CheckConstraint("purpose IN ('server', 'distributed')", name="purpose"),
        CheckConstraint("gpu_count >= 1", name="gpu_count"),
        Index("ix_queue_entries_state_user", "state", "user"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    user: Mapped[str] = mapped_column(String(255))
    groups: Mapped[str] = mapped_column(String(4000), default="")  # comma-separated, at request time
    purpose: Mapped[str] = mapped_column(String(16))
    server_name: Mapped[str] = mapped_column(String(255), default="")
    backend: Mapped[str] = mapped_column(String(32), default="local")
    gpu_count: Mapped[int] = mapped_column(Integer)
    model: Mapped[str | None] = mapped_column(String(255))
    max_nodes: Mapped[int | None] = mapped_column(Integer)
    gpus_per_node: Mapped[int | None] = mapped_column(Integer)
    on_nodes: Mapped[str | None] = mapped_column(String(4000))  # comma-separated; None: anywhere
    lease_seconds: Mapped[float | None] = mapped_column(Float)
    state: Mapped[str] = mapped_column(String(16))
    created: Mapped[datetime] = mapped_column(DateTime)
    seen: Mapped[datetime] = mapped_column(DateTime)
    front: Mapped[datetime | None] = mapped_column(DateTime)  # an admin moved it to the front
    ended: Mapped[datetime | None] = mapped_column(DateTime)
    end_reason: Mapped[str | None] = mapped_column(String(255))
    allocation_id: Mapped[int | None] = mapped_column(ForeignKey("allocations.id"))
    of_server: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())  # as allocations'
    time_limit_seconds: Mapped[float | None] = mapped_column(Float)  # as allocations'
    slice_parts: Mapped[int | None] = mapped_column(Integer)  # as allocations'


class Preemption(Base):
    """Borrowed GPUs taken back for a request within its limit: the owner's notice, when the
    allocation ends (``due``, after ``c.GpuHub.preempt_grace_seconds``), and for whom."""

    __tablename__ = "preemptions"

    id: Mapped[int] = mapped_column(primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id"), unique=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    purpose: Mapped[str] = mapped_column(String(16))
    server_name: Mapped[str] = mapped_column(String(255), default="")
    gpus: Mapped[int] = mapped_column(Integer)
    borrowed: Mapped[int] = mapped_column(Integer)
    for_user: Mapped[str] = mapped_column(String(255))
    entry_id: Mapped[int | None] = mapped_column(ForeignKey("queue_entries.id"))
    reason: Mapped[str] = mapped_column(String(500))
    created: Mapped[datetime] = mapped_column(DateTime)
    due: Mapped[datetime] = mapped_column(DateTime)
    # the notice taken back before it was due: the request it was for no longer waits (served
    # otherwise, cancelled, left); the allocation lives on (migration 0009)
    withdrawn: Mapped[datetime | None] = mapped_column(DateTime)
    withdrawn_reason: Mapped[str | None] = mapped_column(String(255))


class TimeExtension(Base):
    """One extension of an allocation's time limit (``policy.extensions``): whose allocation,
    who asked (its user, or an admin), when, and by how much; ``allocations.time_limit_seconds``
    already holds it (migration 0012)."""

    __tablename__ = "time_extensions"

    id: Mapped[int] = mapped_column(primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id"), index=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    by: Mapped[str] = mapped_column(String(255))
    at: Mapped[datetime] = mapped_column(DateTime)
    seconds: Mapped[float] = mapped_column(Float)
    # the time limit before it, and after it (what the allocation's end moved between)
    before_seconds: Mapped[float] = mapped_column(Float)
    after_seconds: Mapped[float] = mapped_column(Float)


ENERGY_SUMS = ("joules", "idle_joules", "measured_seconds", "unknown_seconds", "idle_seconds")


class EnergyUse(Base):
    """The energy one allocation used on one UTC day, added up from gpuhub's own readings of
    its GPUs (``policy.energy``; written by the broker): joules, the part while idle, and the
    GPU-seconds measured and not (migration 0013). ``user`` is the allocation's, kept here so
    that a year of days is read without a join."""

    __tablename__ = "energy_use"
    __table_args__ = (
        UniqueConstraint("allocation_id", "day", name="uq_energy_use_allocation_day"),
        # covering: a period's sums are read from the index alone (docs/benchmarks.md)
        Index("ix_energy_use_day_user", "day", "user", *ENERGY_SUMS),
        Index("ix_energy_use_user_day", "user", "day", *ENERGY_SUMS),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    allocation_id: Mapped[int] = mapped_column(ForeignKey("allocations.id"))
    user: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(16))
    day: Mapped[date] = mapped_column(Date)
    joules: Mapped[float] = mapped_column(Float, default=0.0)
    idle_joules: Mapped[float] = mapped_column(Float, default=0.0)
    measured_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    unknown_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    idle_seconds: Mapped[float] = mapped_column(Float, default=0.0)


def is_live(state=None):
    """``allocations.state IN ('starting', 'running')`` with the states written into the SQL,
    so that the database can use the partial index of live allocations (a bound parameter
    does not prove a partial index's condition to SQLite's planner)."""
    column = Allocation.state if state is None else state
    return column.in_(bindparam("live_states", list(ACTIVE_STATES), expanding=True, literal_execute=True))


def has_borrowed():
    """``allocations.borrowed > 0`` written out, for the partial index of those that borrowed."""
    return Allocation.borrowed > literal_column("0")


class GpuMove(Base):
    """A GPU that a write took (``held``) or gave back, at the ledger's ``generation`` then:
    what lets a process bring the free GPUs it keeps up to date after another process wrote
    (``spawner/ledger/freeset.py``). Only the newest generations are kept."""

    __tablename__ = "gpu_moves"

    id: Mapped[int] = mapped_column(primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, index=True)
    gpu_id: Mapped[int] = mapped_column(Integer)
    held: Mapped[bool] = mapped_column(Boolean)
    part: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))  # as allocation_gpus'
    parts: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))


class LedgerLock(Base):
    """One row that every writing transaction locks first (its first statement counts up
    ``generation``: an ``UPDATE`` takes the row lock as ``SELECT ... FOR UPDATE`` would).

    It serialises admission on databases with row locks (PostgreSQL); SQLite gets the
    same from ``BEGIN IMMEDIATE``.
    """

    __tablename__ = "ledger_lock"

    id: Mapped[int] = mapped_column(primary_key=True)
    generation: Mapped[int] = mapped_column(Integer, default=0)
    # counted up when the GPUs or nodes change (``sync_inventory``): processes keep the
    # inventory in memory while it stays the same (migration 0007)
    inventory: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    # every GPU move of a generation after this one is in gpu_moves (older ones are pruned)
    moves_after: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
