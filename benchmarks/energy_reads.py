"""The energy reads of GET usage and of the metrics at 10,000 GPUs and a year of history (goal:
each within 100 ms), on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/energy_reads.py [--postgres URL] [--runs N] [--only sqlite|postgres]
        [--suggested-indexes]

One ledger: 10,000 GPUs (1,250 nodes of 8, through ``Ledger.sync_inventory``), 1,000 users in
group ``lab`` with an energy budget (50 kWh a week by default), and a year of history written
straight into ``allocations``, ``allocation_gpus`` and ``energy_use`` (``Ledger.allocate`` would
take hours). Every day of the 365 every GPU is held: each node is split into allocations of
8, 4+4, 4+2+2 or 2+2+2+1+1 GPUs (1.6 allocations a node on average), each held by a random
user for that UTC day, so 2,000 allocations and 2,000 ``energy_use`` rows a day (an
allocation's row sums its GPUs: rows a day = allocations a day, not GPUs a day): 730,000 rows
and 3.65 M allocation GPUs over the year. Today's allocations are live and hold their GPUs.
One row per GPU-day (3.65 M rows) would not build on SQLite in a few minutes; the reads below
go by day and user, so what they touch grows with allocations a day.

Then, taking turns in rounds (the machine's noise falls on all), medians of ``--runs``:

- GET usage's energy: ``energy_totals`` and ``energy_days`` over 30 days for everyone, and
  ``energy_totals`` for one user; ``energy_totals`` over 365 days;
- against the GPU-hours read the same page makes: ``ledger.usage`` over 30 days, measured in the
  same rounds (the ratio energy / GPU-hours);
- a request's budget check: ``budget_refusal_in`` for one user inside a read session;
- the broker's start: ``energy_by_purpose`` (seeds the metrics' counters, once);
- the metrics: ``EnergyCollector.collect()`` with power readings for all 10,000 GPUs, and the
  same rendered as a scrape (``generate_latest``), against the ledger's own collector
  (``LedgerCollector``) in the same rounds.

A read over 100 ms has its statements' plans printed (``EXPLAIN QUERY PLAN`` on SQLite,
``EXPLAIN ANALYZE`` on PostgreSQL). ``--postgres URL`` (default ``$GPUHUB_TEST_POSTGRES_URL``; a
server where the user may create a schema, as ``scripts/postgres url`` prints) measures
PostgreSQL too, in a fresh schema it drops after. ``--suggested-indexes`` then adds an index by
user and purpose with the sums (what ``energy_by_purpose`` reads once at the broker's start) and,
on PostgreSQL, writes the two covering indexes with ``INCLUDE``, and measures the energy reads
again: a further fix, measured on the benchmark's own copy, not the ledger's schema. SQLite's
run takes about 2 minutes.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import datetime, timedelta
from functools import reduce
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prometheus_client import CollectorRegistry, generate_latest
from sqlalchemy import create_engine, event, insert, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from spawner.broker.energy_meter import EnergyMeter, Held
from spawner.broker.energy_metrics import EnergyCollector
from spawner.broker.metrics import LedgerCollector
from spawner.ledger import Ledger, utcnow
from spawner.ledger.models import Allocation, AllocationGpu, EnergyUse, KnownUser
from spawner.policy.budgets import BudgetRules, EnergyBudget
from spawner.policy.energy import Costing, Energy
from spawner.policy.idle import IdleRules
from spawner.policy.placement import Gpu as PGpu

NODES, GPUS_PER_NODE, USERS, DAYS = 1_250, 8, 1_000, 365
# how a node is split into allocations each day, and how often: 1.6 allocations a node
SPLITS = (((8,), 0.60), ((4, 4), 0.30), ((4, 2, 2), 0.05), ((2, 2, 2, 1, 1), 0.05))
GOAL = 0.100
BATCH = 20_000
BUDGET = BudgetRules(default=EnergyBudget(50.0, "kwh", 168.0))
COSTING = Costing(pue=1.3, price_per_kwh=0.25, currency="EUR")


def build(url: str, seed: int = 1) -> dict[str, int]:
    """The ledger at ``url``: the inventory through the ledger, the history straight into its tables."""
    rnd = random.Random(seed)
    t0 = time.perf_counter()
    ledger = Ledger(url)
    ledger.sync_inventory(
        [PGpu(f"node{n:05d}", i, "H100") for n in range(NODES) for i in range(GPUS_PER_NODE)]
    )
    ledger.close()
    engine = create_engine(url, poolclass=NullPool)
    now = utcnow()
    today = now.date()
    midnight = datetime(today.year, today.month, today.day)
    splits, weights = zip(*SPLITS, strict=True)
    counts = {"allocations": 0, "allocation_gpus": 0, "energy_use": 0}
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT id FROM gpus ORDER BY id"))]
        conn.execute(
            insert(KnownUser), [{"name": f"user{u}", "groups": "lab", "updated": now} for u in range(USERS)]
        )
        allocs, links, rows, aid = [], [], [], 0

        def flush(force: bool = False) -> None:  # all at once, allocations first (foreign keys)
            if not force and len(links) < BATCH:
                return
            for table, batch in ((Allocation, allocs), (AllocationGpu, links), (EnergyUse, rows)):
                if batch:
                    conn.execute(insert(table), batch)
                    counts[table.__tablename__] += len(batch)
                    batch.clear()

        for back in range(DAYS - 1, -1, -1):
            live = back == 0
            start = midnight - timedelta(days=back)
            end = None if live else start + timedelta(days=1)
            seconds = (now - start).total_seconds() if live else 86_400.0
            for node in range(NODES):
                first = node * GPUS_PER_NODE
                for n in rnd.choices(splits, weights)[0]:
                    aid += 1
                    user = f"user{rnd.randrange(USERS)}"
                    purpose = "distributed" if rnd.random() < 0.15 else "server"
                    allocs.append(
                        dict(
                            id=aid,
                            user=user,
                            purpose=purpose,
                            server_name="",
                            state="running" if live else "released",
                            created=start,
                            started=start,
                            ended=end,
                            backend="local",
                            gpu_count=n,
                            borrowed=0,
                            end_reason=None if live else "released",
                        )
                    )
                    links += [dict(allocation_id=aid, gpu_id=ids[first + k], held=live) for k in range(n)]
                    first += n
                    idle = rnd.uniform(0, 0.6)  # the share of the day its GPUs were idle
                    unknown = rnd.choice((0.0, 0.0, 0.0, rnd.uniform(0, 600)))
                    measured = n * seconds - unknown
                    watts = rnd.uniform(150, 650)
                    rows.append(
                        dict(
                            allocation_id=aid,
                            user=user,
                            purpose=purpose,
                            day=start.date(),
                            joules=measured * (idle * 70 + (1 - idle) * watts),
                            idle_joules=measured * idle * 70,
                            measured_seconds=measured,
                            unknown_seconds=unknown,
                            idle_seconds=measured * idle,
                        )
                    )
            flush()
        flush(force=True)
    with engine.connect() as conn:
        if url.startswith("postgresql"):
            conn.execute(text("SELECT setval('allocations_id_seq', (SELECT max(id) FROM allocations))"))
            conn.commit()
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
        else:
            conn.execute(text("ANALYZE"))
    engine.dispose()
    counts["seconds"] = round(time.perf_counter() - t0)
    return counts


class Statements:
    """The statements a ledger's reads send, to explain the slow ones."""

    def __init__(self, ledger: Ledger):
        self.ledger, self.seen = ledger, None
        for engine in (ledger.engine, ledger._reader):
            event.listen(engine, "before_cursor_execute", self._note)

    def _note(self, conn, cursor, statement, parameters, context, executemany):
        if self.seen is not None and statement.lstrip().upper().startswith("SELECT"):
            self.seen.append((statement, parameters))

    def explain(self, fn, sql: bool = True) -> list[str]:
        self.seen = []
        try:
            fn()
        finally:
            got, self.seen = self.seen, None
        pg = self.ledger.url.startswith("postgresql")
        out = []
        with self.ledger._reader.connect() as conn:
            for statement, parameters in got:
                if "ledger_lock" in statement:
                    continue
                if sql:
                    out.append("    " + " ".join(statement.split())[:150] + " ...")
                prefix = "EXPLAIN ANALYZE " if pg else "EXPLAIN QUERY PLAN "
                for row in conn.exec_driver_sql(prefix + statement, parameters):
                    out.append("      " + (row[0] if pg else row[3]))
        return out


# what the slow reads would need (a suggestion measured here, not the ledger's schema): the sums
# in the index, so that a range of days or users is read from the index alone, not the table
SUMS = ("joules", "idle_joules", "measured_seconds", "unknown_seconds", "idle_seconds")
SUGGESTED = {
    "ix_energy_use_user_day": ("user", "day"),
    "ix_energy_use_day_user": ("day", "user"),
    "ix_energy_use_user_purpose": ("user", "purpose"),
}


def add_suggested_indexes(url: str) -> float:
    """Write ``energy_use``'s covering indexes again (PostgreSQL: with ``INCLUDE``), and add one by
    user and purpose."""
    pg = url.startswith("postgresql")
    engine = create_engine(url, poolclass=NullPool)
    t = time.perf_counter()
    with engine.begin() as conn:
        for name, keys in SUGGESTED.items():
            conn.exec_driver_sql(f"DROP INDEX IF EXISTS {name}")
            quoted = ", ".join(f'"{k}"' for k in keys)
            rest = ", ".join(SUMS)
            tail = f"({quoted}) INCLUDE ({rest})" if pg else f"({quoted}, {rest})"
            conn.exec_driver_sql(f"CREATE INDEX {name} ON energy_use {tail}")
    with engine.connect() as conn:
        if pg:
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql("ANALYZE energy_use")
        else:
            conn.exec_driver_sql("ANALYZE")
    engine.dispose()
    return time.perf_counter() - t


def measure(checks: dict, runs: int) -> dict[str, list[float]]:
    """Each read ``runs`` times, taking turns in rounds, after one warm-up each."""
    for fn in checks.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in checks}
    for _ in range(runs):
        for name, fn in checks.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def energy_checks(ledger: Ledger) -> dict:
    now = utcnow()
    month, year = now - timedelta(days=30), now - timedelta(days=365)
    user = "user7"

    def budget():
        with ledger._read() as s:
            return ledger.budget_refusal_in(s, user, ["lab"])

    def totals_from_days():  # one query for both: the totals added up from the days
        days = ledger.energy_days(month, now)
        return days, {u: reduce(Energy.plus, d.values(), Energy()) for u, d in days.items()}

    return {
        "energy_totals, 30 days, everyone": lambda: ledger.energy_totals(month, now),
        "energy_days, 30 days, everyone": lambda: ledger.energy_days(month, now),
        "GET usage energy (totals + days), 30 d": lambda: (
            ledger.energy_totals(month, now),
            ledger.energy_days(month, now),
        ),
        "  same, totals summed from the days": totals_from_days,
        "energy_totals, 30 days, one user": lambda: ledger.energy_totals(month, now, user),
        "energy_days, 30 days, one user": lambda: ledger.energy_days(month, now, user),
        "energy_totals, 365 days, everyone": lambda: ledger.energy_totals(year, now),
        "budget check (budget_refusal_in), 1 user": budget,
        "energy_by_purpose (broker start, once)": lambda: ledger.energy_by_purpose(),
    }


def reads(url: str, runs: int, suggested: bool) -> None:
    ledger = Ledger(url, costing=COSTING, budgets=BUDGET)
    now = utcnow()
    month = now - timedelta(days=30)
    user = "user7"
    meter = EnergyMeter()
    meter.seed(ledger.energy_by_purpose())
    t = time.time()
    rnd = random.Random(3)
    table = ledger.gpu_table()  # what the sampler reads each tick anyway
    meter.note_models(table)
    for st in table:
        key = (st.gpu.node, st.gpu.index)
        meter.power[key] = (t, rnd.uniform(60, 700))
        if st.holder is not None:  # who held it at the last reading
            meter.held[key] = Held(st.holder.id, 0.0)
            meter.owners[st.holder.id] = (st.holder.user, st.holder.purpose)
    meter.clock = lambda: t + 30.0  # every reading fresh at the scrape
    broker = SimpleNamespace(ledger=ledger, energy=meter, reclaim_rules=IdleRules(), refused_readings={})
    collector = EnergyCollector(broker)
    registry = CollectorRegistry()
    registry.register(collector)

    checks = {
        "GPU-hours: usage, 30 days, everyone": lambda: ledger.usage(month, now),
        "GPU-hours: usage, 30 days, one user": lambda: ledger.usage(month, now, user),
        **energy_checks(ledger),
        "EnergyCollector.collect()": lambda: list(collector.collect()),
        "  for comparison: ledger.gpu_table() (not read by a scrape)": ledger.gpu_table,
        "  same, rendered (generate_latest)": lambda: generate_latest(registry),
        "LedgerCollector.collect() (existing)": lambda: list(LedgerCollector(ledger).collect()),
    }
    times = measure(checks, runs)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    gpu_hours = med["GPU-hours: usage, 30 days, everyone"]
    print(f"  {'read':42s} {'median':>9s} {'min':>9s} {'/ usage':>8s}  within 100 ms")
    for name, ts in times.items():
        ratio = "" if name.startswith("GPU-hours") else f"{med[name] / gpu_hours:7.3f}x"
        ok = "yes" if med[name] <= GOAL else "NO"
        print(f"  {name:42s} {med[name] * 1e3:7.1f}ms {min(ts) * 1e3:7.1f}ms {ratio:>8s}  {ok}")
    print("  (/ usage: against the GPU-hours read, ledger.usage over 30 days, everyone, same rounds)")
    print(
        f"  sizes: energy_totals 30 d {len(ledger.energy_totals(month, now))} users; energy_days 30 d "
        f"{sum(map(len, ledger.energy_days(month, now).values()))} user-days; energy_by_purpose "
        f"{len(meter.totals)} counters; power gauge {len(meter.power)} GPUs"
    )
    slow = [name for name in checks if med[name] > GOAL and not name.startswith(("GPU-hours", "  "))]
    if slow:
        statements = Statements(ledger)
        print("  plans of the energy reads over 100 ms:")
        for name in slow:
            print(f"  {name}:")
            print("\n".join(statements.explain(checks[name])))
    ledger.close()
    if not suggested:
        return
    took = add_suggested_indexes(url)
    print(f"  with the suggested covering indexes (made in {took:.1f} s), medians of {runs} rounds:")
    ledger = Ledger(url, costing=COSTING, budgets=BUDGET)
    again = energy_checks(ledger)
    after = measure(again, runs)
    statements = Statements(ledger)
    for name, ts in after.items():
        m = statistics.median(ts)
        ok = "yes" if m <= GOAL else "NO"
        print(f"  {name:42s} {m * 1e3:7.1f}ms  before {med[name] * 1e3:7.1f}ms  {m / med[name]:5.2f}x  {ok}")
        if med[name] > GOAL and not name.startswith("  "):
            print("\n".join(statements.explain(again[name], sql=False)))
    ledger.close()


@contextmanager
def postgres_schema(url: str):
    """A fresh schema on the server at ``url`` (the URL's search_path), dropped after."""
    admin = create_engine(url, isolation_level="AUTOCOMMIT", poolclass=NullPool)
    name = f"gpuhub_bench_{secrets.token_hex(4)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {name}")
    query = {"options": f"-csearch_path={name}", "application_name": name}
    try:
        yield make_url(url).update_query_dict(query).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                {"n": name},
            )
            conn.exec_driver_sql(f"DROP SCHEMA {name} CASCADE")
        admin.dispose()


def run_backend(label: str, url: str, runs: int, suggested: bool) -> None:
    counts = build(url)
    print(
        f"{label}: {NODES * GPUS_PER_NODE} GPUs, {USERS} users, {DAYS} days: {counts['allocations']} "
        f"allocations ({counts['allocations'] // DAYS} a day), {counts['allocation_gpus']} allocation GPUs, "
        f"{counts['energy_use']} energy_use rows (built in {counts['seconds']} s)"
    )
    print(f"{label}: medians of {runs} rounds (goal: each within 100 ms)")
    reads(url, runs, suggested)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--postgres", default=os.environ.get("GPUHUB_TEST_POSTGRES_URL"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", choices=("sqlite", "postgres"))
    ap.add_argument(
        "--suggested-indexes",
        action="store_true",
        help="then replace energy_use's indexes by covering ones (a suggested fix) and measure again",
    )
    args = ap.parse_args()
    if args.only != "postgres":
        with tempfile.TemporaryDirectory() as d:
            run_backend("SQLite", f"sqlite:///{d}/energy.sqlite", args.runs, args.suggested_indexes)
    if args.postgres and args.only != "sqlite":
        with postgres_schema(args.postgres) as url:
            run_backend("PostgreSQL", url, args.runs, args.suggested_indexes)


if __name__ == "__main__":
    main()
