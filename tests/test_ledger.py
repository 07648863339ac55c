"""The ledger on a real SQLite file and a real PostgreSQL database: admission, release, limits,
inventory sync, schema."""

import os
import threading
from datetime import datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, func, insert, inspect, select, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from spawner import cli
from spawner.ledger import Ledger, db
from spawner.ledger.models import Allocation, AllocationGpu, Base
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu

from . import dbtools
from .hubtools import wait_for
from .ledgertools import Clock

INV = [Gpu("n1", i, "A100", 40960) for i in range(4)] + [Gpu("n2", i, "V100") for i in range(2)]


@pytest.fixture
def clock():
    return Clock(datetime(2026, 11, 1, 9, 0))


@pytest.fixture
def url(db_url):
    return db_url


@pytest.fixture
def ledger(url, clock):
    rules = LimitRules(default=Limit(max_gpus=2), groups={"staff": Limit(max_gpus=5)})
    led = Ledger(url, config_rules=rules, clock=clock)
    led.sync_inventory(INV)
    yield led
    led.close()


def held(ledger):
    return sorted(st.gpu.label for st in ledger.gpu_table() if st.holder)


def test_allocate_gives_disjoint_gpus_and_release_frees_them(ledger):
    a = ledger.allocate("alice", [], 2)
    b = ledger.allocate("bob", [], 2)
    assert not set(a.gpus) & set(b.gpus)
    # best fit: the 2-GPU node first, which keeps n1 whole for as long as possible
    assert [g.label for g in a.gpus] == ["n2:0", "n2:1"] and a.cuda_visible_devices == "0,1"
    assert held(ledger) == ["n1:0", "n1:1", "n2:0", "n2:1"]
    assert ledger.release(a.id, "done") is True
    assert ledger.release(a.id, "again") is False  # idempotent
    assert held(ledger) == ["n1:0", "n1:1"]
    assert ledger.get(a.id).state == "released" and ledger.get(a.id).end_reason == "done"


def test_refusal_leaves_nothing_behind(ledger):
    ledger.allocate("alice", [], 2)
    before = held(ledger)
    with pytest.raises(Refusal) as err:
        ledger.allocate("alice", [], 1)
    assert err.value.reason == "over_limit"
    assert "hold 2 of a limit of 2 (default)" in err.value.message
    assert held(ledger) == before
    assert len(ledger.active(user="alice")) == 1


def test_group_limit_and_capacity(ledger):
    ledger.allocate("carol", ["staff"], 4)  # all of n1
    with pytest.raises(Refusal) as err:
        ledger.allocate("dave", [], 2, model="A100")
    assert err.value.reason == "no_capacity"
    assert "only 0 are free" in err.value.message


def test_ledger_limits_win_over_config_and_unset_returns_to_config(ledger):
    assert ledger.allowance("erin", ["staff"]).effective.limit.max_gpus == 5
    ledger.set_limit("group", "staff", Limit(max_gpus=1))
    assert ledger.allowance("erin", ["staff"]).effective.source == "group staff"
    with pytest.raises(Refusal):
        ledger.allocate("erin", ["staff"], 2)
    ledger.set_limit("user", "erin", Limit(max_gpus=3))
    assert ledger.allocate("erin", ["staff"], 3).gpus
    assert ledger.unset_limit("group", "staff") is True
    assert ledger.unset_limit("group", "staff") is False
    origins = {(e.scope, e.name): e.origin for e in ledger.limit_entries()}
    assert origins == {("default", ""): "config", ("group", "staff"): "config", ("user", "erin"): "ledger"}


@pytest.mark.parametrize(
    "scope, name, limit",
    [
        ("planet", "x", Limit(max_gpus=1)),
        ("user", "", Limit(max_gpus=1)),
        ("user", "a", Limit(max_gpus=-1)),
        ("user", "a", Limit(max_gpus=1, gpu_hours=-5)),
        ("user", "a", Limit(max_gpus=1, window_hours=0)),
    ],
)
def test_bad_limits_are_refused(ledger, scope, name, limit):
    with pytest.raises(ValueError):
        ledger.set_limit(scope, name, limit)
    assert all(e.origin == "config" for e in ledger.limit_entries())


def test_gpu_hours_quota_and_usage(ledger, clock):
    ledger.set_limit("user", "frank", Limit(max_gpus=4, gpu_hours=3, window_hours=24))
    a = ledger.allocate("frank", [], 2)
    ledger.mark_running(a.id, "123")
    clock.advance(hours=1)
    ledger.release(a.id)
    b = ledger.allocate("frank", [], 1)  # 2 GPU-hours used of 3
    ledger.mark_running(b.id)
    clock.advance(hours=1)  # 3 used
    with pytest.raises(Refusal) as err:
        ledger.allocate("frank", [], 1)
    assert err.value.reason == "quota_exhausted"
    assert ledger.usage(clock.now - timedelta(days=1))["frank"] == pytest.approx(3.0)
    ledger.release(b.id)
    clock.advance(hours=30)  # the window has moved past both
    assert ledger.usage(clock.now - timedelta(hours=24)) == {"frank": 0.0}
    assert ledger.allocate("frank", [], 1)


def test_sync_inventory_keeps_allocations(ledger):
    a = ledger.allocate("alice", [], 2, model="V100")
    # n2 disappears from the inventory that speaks for n1-n3, n3 appears
    ledger.sync_inventory(
        [g for g in INV if g.node == "n1"] + [Gpu("n3", 0, "H100")], nodes=["n1", "n2", "n3"]
    )
    table = {st.gpu.label: st for st in ledger.gpu_table()}
    assert table["n2:0"].present is False and table["n2:0"].holder.id == a.id
    assert table["n3:0"].present and table["n3:0"].holder is None
    assert ledger.active(user="alice")[0].gpus == a.gpus
    ledger.release(a.id)
    with pytest.raises(Refusal) as err:  # absent GPUs are never handed out
        ledger.allocate("bob", [], 1, model="V100")
    assert err.value.reason == "unknown_model"


def test_a_sync_leaves_nodes_it_does_not_speak_for_alone(ledger):
    a = ledger.allocate("alice", [], 2, model="V100")
    ledger.sync_inventory([Gpu("elsewhere", 0, "T4")])  # another machine's partial view
    table = {st.gpu.label: st for st in ledger.gpu_table()}
    assert all(table[g.label].present for g in INV)
    assert table["n2:0"].holder.id == a.id and table["elsewhere:0"].present


def test_allocate_on_nodes_restricts_the_placement(ledger):
    a = ledger.allocate("alice", [], 1, on_nodes=["n2"])
    assert [g.node for g in a.gpus] == ["n2"]
    with pytest.raises(Refusal) as err:
        ledger.allocate("bob", [], 2, on_nodes=["n2"])
    assert err.value.reason == "no_capacity"


def test_database_refuses_double_booking_even_without_the_policy(ledger, url):
    a = ledger.allocate("alice", [], 1)
    engine = create_engine(url)
    with pytest.raises(IntegrityError), engine.begin() as conn:
        row = {"user": "mallory", "purpose": "server", "server_name": "", "state": "running"}
        row |= {"created": datetime(2026, 1, 1), "backend": "local"}
        forged = conn.execute(insert(Allocation).values(row).returning(Allocation.id)).scalar_one()
        gpu_id = conn.scalar(select(AllocationGpu.gpu_id).where(AllocationGpu.allocation_id == a.id))
        conn.execute(insert(AllocationGpu).values(allocation_id=forged, gpu_id=gpu_id, held=True))
    engine.dispose()


def test_a_read_sees_one_snapshot_while_a_writer_commits(ledger):
    def count(s):
        return s.scalar(select(func.count()).select_from(Allocation))

    with ledger._read() as s:
        before = count(s)
        ledger.allocate("alice", [], 1)  # committed meanwhile, through the writer's connection
        assert count(s) == before
    with ledger._read() as s:
        assert count(s) == before + 1


def test_migrations_match_the_models(url):
    engine = db.make_engine(url)
    db.ensure_schema(engine, url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    assert db.current_revision(engine) == db.head_revision() == db.SCHEMA_HEAD  # a new migration: update it
    engine.dispose()


def test_every_migration_runs_up_one_by_one_then_down_to_nothing(url):
    from alembic import command
    from alembic.script import ScriptDirectory

    cfg = db.alembic_config(url)
    engine = create_engine(url)
    for rev in reversed(list(ScriptDirectory.from_config(cfg).walk_revisions())):
        command.upgrade(cfg, rev.revision)
        assert db.current_revision(engine) == rev.revision
    command.downgrade(cfg, "base")
    assert inspect(engine).get_table_names() == ["alembic_version"]
    engine.dispose()
    db.upgrade(url)
    led = Ledger(url)
    led.sync_inventory(INV)
    assert led.allocate("alice", [], 1).gpus
    led.close()


def test_schema_from_a_newer_gpuhub_is_refused(url):
    engine = db.make_engine(url)
    db.ensure_schema(engine, url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '0000'"))
    with pytest.raises(db.SchemaError, match="newer than this gpuhub knows"):
        Ledger(url)
    engine.dispose()


def test_foreign_tables_are_not_adopted(url):
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE users (id INTEGER)"))
    engine.dispose()
    with pytest.raises(db.SchemaError, match="database of its own"):
        Ledger(url)


@pytest.fixture
def sqlite_ledger(tmp_path, clock):
    led = Ledger(f"sqlite:///{tmp_path / 'gpuhub.sqlite'}", clock=clock)
    led.sync_inventory(INV)
    yield led
    led.close()


def test_sqlite_runs_in_wal_mode(sqlite_ledger):
    with sqlite_ledger.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_a_new_sqlite_ledger_is_private_to_the_hubs_account(sqlite_ledger):
    sqlite_ledger.allocate("alice", [], 1)  # forces the WAL files into being
    path = sqlite_ledger.url.removeprefix("sqlite:///")
    for f in (path, path + "-wal", path + "-shm"):
        assert os.stat(f).st_mode & 0o077 == 0, f


def test_a_ledger_at_the_first_schema_is_refused_then_upgraded_with_its_data(url):
    from alembic import command

    command.upgrade(db.alembic_config(url), "0001")
    engine = create_engine(url)
    with engine.begin() as conn:  # a server allocation written by the first gpuhub release
        conn.execute(text("INSERT INTO nodes (id, name) VALUES (1, 'n1')"))
        conn.execute(
            text("INSERT INTO gpus (id, node_id, \"index\", model, present) VALUES (1, 1, 0, 'A100', true)")
        )
        conn.execute(
            text(
                'INSERT INTO allocations (id, "user", purpose, server_name, state, created, backend) '
                "VALUES (1, 'alice', 'server', '', 'running', '2026-11-01 10:00:00', 'local')"
            )
        )
        conn.execute(text("INSERT INTO allocation_gpus (allocation_id, gpu_id, held) VALUES (1, 1, true)"))
    engine.dispose()
    with pytest.raises(db.SchemaError, match="gpuhub db upgrade"):
        Ledger(url)
    assert cli.main(["--db-url", url, "db", "upgrade"]) == 0  # every migration, 0002 to head
    led = Ledger(url)
    [a] = led.active(user="alice")
    assert [g.label for g in a.gpus] == ["n1:0"] and a.lease_expires is None
    led.close()


def test_a_new_postgresql_ledger_opened_twice_at_once_is_made_once():
    """The hub and its broker open a new ledger at the same moment: the second waits for the
    first's migrations (an advisory lock), then finds the schema at head and the lock row
    made (two inserting it would clash)."""
    from alembic import command

    with dbtools.postgres_database() as url:
        engine = db.make_engine(url)
        opened = {}

        def open_second():
            try:
                opened["ledger"] = Ledger(url)
            except Exception as e:
                opened["error"] = e

        with engine.begin() as conn:
            cfg = db.alembic_config(url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")  # the first, not committed yet
            assert conn.exec_driver_sql("SELECT count(*) FROM ledger_lock").scalar() == 1  # made with it
            second = threading.Thread(target=open_second)
            second.start()
            wait_for(lambda: dbtools.waiting_for_a_lock(url), 30, "the second to wait for the first")
        second.join(60)
        assert "error" not in opened, opened
        assert db.current_revision(engine) == db.head_revision()
        opened["ledger"].close()
        engine.dispose()


def test_leases_expire_and_renew(ledger, clock):
    a = ledger.allocate("alice", [], 2, purpose="distributed", lease_seconds=60)
    assert a.state == "running" and a.lease_expires == clock.now + timedelta(seconds=60)
    clock.advance(seconds=50)
    assert ledger.renew(a.id, 60).lease_expires == clock.now + timedelta(seconds=60)
    clock.advance(seconds=59)
    assert ledger.expire_leases() == []
    clock.advance(seconds=2)
    assert ledger.expire_leases() == [a.id]
    gone = ledger.get(a.id)
    assert gone.state == "released" and gone.end_reason == "lease expired"
    assert gone.ended == a.lease_expires + timedelta(seconds=50)  # usage ends with the lease
    with pytest.raises(LookupError):
        ledger.renew(a.id, 60)
    server = ledger.allocate("alice", [], 1)
    with pytest.raises(ValueError, match="no lease"):
        ledger.renew(server.id, 60)


def test_an_expired_lease_never_blocks_admission(ledger, clock):
    ledger.allocate("alice", [], 2, purpose="distributed", lease_seconds=10)
    clock.advance(seconds=11)  # nobody swept it
    assert len(ledger.allocate("alice", [], 2).gpus) == 2


def test_a_writer_whose_connection_the_server_dropped_admits_on_a_fresh_one():
    """The writer's pool does not ping before each transaction: a connection the server has
    dropped (a restart) fails at the transaction's first statement, and the transaction
    starts again on a fresh connection, so the admission neither fails nor half happens."""
    with dbtools.postgres_database() as url:
        ledger = Ledger(url, config_rules=LimitRules(default=Limit(max_gpus=2)))
        ledger.sync_inventory(INV)
        first = ledger.allocate("alice", [], 1)
        admin = create_engine(dbtools.server_url(), isolation_level="AUTOCOMMIT")
        with admin.connect() as conn:
            dropped = conn.scalar(
                text(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = :n"
                ),
                {"n": make_url(url).query["application_name"]},
            )
        admin.dispose()
        assert dropped >= 1  # the writer's pooled connection among them
        second = ledger.allocate("alice", [], 1)
        assert not set(first.gpus) & set(second.gpus)
        assert ledger.release(second.id) and ledger.release(first.id)
        assert [a.id for a in ledger.active()] == []
        ledger.close()


def test_usage_reads_only_the_period_and_agrees_with_the_policys_gpu_hours(ledger, clock):
    """GPU-hours per user and per bucket, read over the allocations that overlap the period
    only, against ``policy.gpu_hours_used`` over every allocation, for random histories."""
    import random

    from spawner.policy import gpu_hours_used

    rnd = random.Random(11)
    start = clock.now
    live, made = [], []
    for _ in range(40):
        clock.advance(minutes=rnd.randint(1, 90))
        if live and rnd.random() < 0.5:
            ledger.release(live.pop(rnd.randrange(len(live))).id, "done")
        try:
            a = ledger.allocate(rnd.choice(["alice", "bob", "carol"]), ["staff"], rnd.randint(1, 2))
        except Refusal:
            continue
        live.append(a)
        made.append(a.id)
    clock.advance(minutes=30)
    rows = {name: [] for name in ("alice", "bob", "carol")}
    for a in map(ledger.get, made):
        rows[a.user].append((a.started or a.created, a.ended, len(a.gpus)))
    since, until = start + timedelta(hours=3), clock.now - timedelta(hours=2)
    window = (until - since).total_seconds() / 3600
    assert ledger.usage(since, until) == pytest.approx(
        {u: gpu_hours_used(r, until, window) for u, r in rows.items()}
    )
    starts, series = ledger.usage_series(since, until, bucket_hours=1.5)
    for u, r in rows.items():
        ends = [min(b + timedelta(hours=1.5), until) for b in starts]
        spans = zip(starts, ends, strict=True)
        expected = [gpu_hours_used(r, e, (e - b).total_seconds() / 3600) for b, e in spans]
        assert series[u] == pytest.approx(expected), u
    assert sum(ledger.usage(start, clock.now).values()) > 0
