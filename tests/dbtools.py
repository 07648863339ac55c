"""The ledger's databases for tests: a SQLite file, or a database of its own on the real
PostgreSQL server of ``scripts/postgres``.

``scripts/test`` starts that server when run as root, exports its URL as
``GPUHUB_TEST_POSTGRES_URL`` and sets ``GPUHUB_REQUIRE_POSTGRES=1``, so in CI the PostgreSQL
variants run or fail, never skip. Elsewhere they skip with a message that says how to enable them.
"""

from __future__ import annotations

import functools
import os
import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.pool import NullPool

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "postgres"
BACKENDS = ("sqlite", "postgresql")


@functools.cache
def _server() -> tuple[str | None, str]:
    """The test server's URL, or None and why there is none."""
    url = os.environ.get("GPUHUB_TEST_POSTGRES_URL")
    if url:
        return url, ""
    if os.geteuid() != 0:
        return None, "not root"
    started = subprocess.run([str(SCRIPT), "start"], capture_output=True, text=True)
    if started.returncode != 0:
        return None, (started.stdout[-2000:] + started.stderr[-2000:]).strip()
    return subprocess.run([str(SCRIPT), "url"], capture_output=True, text=True, check=True).stdout.strip(), ""


def server_url() -> str:
    """Skip (or, with GPUHUB_REQUIRE_POSTGRES=1, fail) unless the test server answers."""
    url, why = _server()
    if url is not None:
        return url
    message = (
        "no PostgreSQL test server: start it as root with `sudo scripts/postgres start` and export "
        "GPUHUB_TEST_POSTGRES_URL=$(sudo scripts/postgres url) (or run the suite as root: "
        f"`scripts/test`). ({why})"
    )
    if os.environ.get("GPUHUB_REQUIRE_POSTGRES") == "1":
        pytest.fail(message)
    pytest.skip(message)


@functools.cache
def _admin() -> Engine:
    return create_engine(server_url(), isolation_level="AUTOCOMMIT", poolclass=NullPool)


@contextmanager
def postgres_database() -> Iterator[str]:
    """A new, empty ledger database on the test server: a schema of its own (the URL's
    search_path; ten times faster to make than a database), dropped afterwards with whatever
    still connects to it (each connection is named after it)."""
    name = f"gpuhub_t_{secrets.token_hex(6)}"
    with _admin().connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {name}")
    query = {"options": f"-csearch_path={name}", "application_name": name}
    try:
        yield make_url(server_url()).update_query_dict(query).render_as_string(hide_password=False)
    finally:
        with _admin().connect() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                {"n": name},
            )
            conn.exec_driver_sql(f"DROP SCHEMA {name} CASCADE")


def end_connections(application_name: str) -> int:
    """End every connection of a database from :func:`postgres_database` (named after it), as a
    restart of the server does to its clients; how many there were."""
    with _admin().connect() as conn:
        return len(
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                {"n": application_name},
            ).all()
        )


@contextmanager
def ledger_database(backend: str, tmp_path: Path) -> Iterator[str]:
    """The URL of a fresh, empty ledger database on ``backend`` ("sqlite" or "postgresql")."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'gpuhub.sqlite'}"
        return
    with postgres_database() as url:
        yield url


def waiting_for_a_lock(url: str) -> int:
    """How many connections to the database of ``url`` (from :func:`postgres_database`) wait
    for a lock now."""
    with _admin().connect() as conn:
        return conn.scalar(
            text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE application_name = :n AND wait_event_type = 'Lock'"
            ),
            {"n": make_url(url).query["application_name"]},
        )
