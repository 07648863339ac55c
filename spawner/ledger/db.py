"""Engine, sessions and schema version of the ledger database.

- SQLite: WAL journal, a busy timeout, foreign keys on, and every transaction opened with
  ``BEGIN IMMEDIATE`` so that a read-check-write admission is one atomic step across
  processes (a deferred transaction would read, then fail to upgrade its lock).
- Any other SQLAlchemy URL (PostgreSQL in production) relies on the ``ledger_lock`` row:
  writers run at READ COMMITTED (each statement after the lock sees the last writer's
  commit); on PostgreSQL a reader engine's transactions are REPEATABLE READ and read-only,
  one snapshot for all their statements, as a WAL reader's on SQLite.
- The schema is owned by Alembic (``spawner/ledger/migrations``). A new, empty database is
  created at head; a database behind head is refused with the command that upgrades it.
  Opening a ledger already at head (every open but the first) reads its version with one
  query against ``SCHEMA_HEAD``, without importing Alembic (tens of milliseconds of every
  ``gpuhub`` command).
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, event, inspect, text
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from alembic.config import Config

MIGRATIONS = Path(__file__).with_name("migrations")
SCHEMA_HEAD = "0014"  # the newest migration's revision (tests/test_ledger.py holds it to Alembic's)
SQLITE_BUSY_TIMEOUT_MS = 30_000


class SchemaError(RuntimeError):
    """The ledger database is not at the schema this gpuhub needs."""


def _create_private(path: str) -> None:
    """Create a new SQLite file readable by its owner only (the -wal and -shm files SQLite
    makes beside it copy these permissions): users reach the ledger through the hub."""
    if path and path != ":memory:" and not os.path.exists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


SQLITE_SYNC = ("normal", "full")


def make_engine(url: str, *, writer: bool = True, sqlite_sync: str = "normal") -> Engine:
    """An engine for the ledger. On SQLite a ``writer`` engine opens every transaction with
    ``BEGIN IMMEDIATE``; a reader engine with a plain ``BEGIN`` (WAL readers never block).

    ``sqlite_sync`` (``c.GpuHub.sqlite_synchronous``): SQLite's ``synchronous`` in WAL mode.
    ``"normal"`` writes each commit to the operating system and syncs the disk at
    checkpoints: a crash of any process loses nothing and never corrupts the file; a power
    cut or kernel crash may undo the last commits. ``"full"`` syncs the disk at every commit
    (milliseconds each on many disks: it bounds admissions per second)."""
    if sqlite_sync not in SQLITE_SYNC:
        raise ValueError(f"sqlite_sync must be one of {', '.join(SQLITE_SYNC)}; got {sqlite_sync!r}")
    if url.startswith("sqlite"):
        _create_private(make_url(url).database or "")
        engine = create_engine(url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):
            # take transaction control away from the driver so BEGIN IMMEDIATE is ours
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA synchronous={sqlite_sync.upper()}")
            cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            conn.exec_driver_sql("BEGIN IMMEDIATE" if writer else "BEGIN")

        return engine
    if writer:  # the ledger's writing transaction finds a dropped connection itself
        return create_engine(url)
    if make_url(url).get_backend_name() != "postgresql":
        return create_engine(url, pool_pre_ping=True)
    return create_engine(
        url,
        pool_pre_ping=True,
        isolation_level="REPEATABLE READ",
        execution_options={"postgresql_readonly": True},
    )


class WriterTurns:
    """Writers of one SQLite ledger file wait for their turn on an ``flock`` of a file beside
    it (``<ledger>-writers``) before ``BEGIN IMMEDIATE``.

    SQLite alone makes a writer that finds the database locked sleep and retry (1, 2, 5, 10...
    ms): with several processes admitting at once most of their time goes to those sleeps.
    A kernel lock hands the turn over the moment it is released. It is only a queue: the
    ``BEGIN IMMEDIATE`` behind it is what keeps a decision and its write one step, so a
    process that cannot open the file (another Unix user's) simply goes without it."""

    def __init__(self, url: str):
        database = make_url(url).database if url.startswith("sqlite") else None
        self.path = f"{database}-writers" if database and database != ":memory:" else None
        self._threads = threading.Lock()  # an flock is the process's: its threads take turns here
        self._fd: int | None = None
        self._pid = 0

    def _file(self) -> int | None:
        if self.path is None:
            return None
        if self._fd is None or self._pid != os.getpid():  # a forked child needs its own
            try:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError:
                self.path = None
                return None
            self._pid = os.getpid()
        return self._fd

    @contextmanager
    def turn(self) -> Iterator[None]:
        with self._threads:
            fd = self._file()
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None and self._pid == os.getpid():
            os.close(self._fd)
        self._fd = None


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None  # the package always ships migrations
    return head


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(url: str, engine: Engine | None = None) -> None:
    """Bring the database at ``url`` to the newest schema (what ``gpuhub db upgrade`` runs)."""
    from alembic import command

    cfg = alembic_config(url)
    if engine is not None:
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
    else:
        command.upgrade(cfg, "head")


def ensure_schema(engine: Engine, url: str) -> None:
    """Create a new database at head; refuse one that is behind or unknown."""
    if _stored_revision(engine) == SCHEMA_HEAD:
        return  # the usual case, answered without Alembic
    from alembic.script import ScriptDirectory

    current = current_revision(engine)
    head = head_revision()
    if current == head:
        return
    if current is None:
        tables = set(inspect(engine).get_table_names())
        if tables:
            raise SchemaError(
                f"The gpuhub ledger database {safe_url(url)} has tables ({', '.join(sorted(tables))}) "
                "but no schema version. Point c.GpuHub.db_url at a database of its own."
            )
        upgrade(url, engine)
        return
    scripts = ScriptDirectory.from_config(alembic_config(url))
    known = {rev.revision for rev in scripts.walk_revisions()}
    if current not in known:
        raise SchemaError(
            f"The gpuhub ledger database {safe_url(url)} is at schema {current}, newer than this "
            f"gpuhub knows (head {head}). Upgrade the jupyterhub-gpuhub package."
        )
    raise SchemaError(
        f"The gpuhub ledger database {safe_url(url)} is at schema {current}; this gpuhub needs "
        f"{head}. Back it up, then run: gpuhub db upgrade --db-url '{safe_url(url)}'"
    )


def _stored_revision(engine: Engine) -> str | None:
    """The version Alembic recorded in the database, read directly (None: none recorded)."""
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    except DBAPIError:  # no such table: a new database, or not one of gpuhub's
        return None


def safe_url(url: str) -> str:
    """The URL with any password hidden, for messages and logs (never the text of one that
    does not parse: it might hold a password in a place no parser finds)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # e.g. a port that is not a number
        return "(a URL that does not parse)"


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


def connection(s: Session) -> Connection:
    """The session's connection, for Core statements: the ledger's writing transaction keeps
    it in ``s.info`` (``Session.connection()`` costs about as much as a small statement)."""
    return s.info.get("connection") or s.connection()
