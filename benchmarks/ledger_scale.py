"""How an admission and the broker's reads grow with the cluster, on SQLite and PostgreSQL.

    .venv/bin/python benchmarks/ledger_scale.py [--postgres URL] [--cycles N] [--procs P] [--threads T]

Two ledgers are built with the same shape at two sizes: 100 GPUs / 50 users and 10,000
GPUs / 5,000 users, each with a year of history (every user runs a job every other day on
average, 1-8 GPUs, 1-8 hours) and the cluster half full now. Then, in one run:

- one admission (``request`` of 1-2 GPUs by a random user, with a GPU-hours budget, then
  ``release``): median time at each size, and the ratio large / small;
- several processes admitting and releasing at once: admissions per second, against one
  process alone; then again with several threads asking in each process (a hub's or broker's
  thread pool, whose writes waiting at once share one transaction); and two ledgers taking
  turns in one process (what catching up on another writer's moves costs, without the
  scheduler's hand-overs between processes);
- the broker's reads at the large size: My GPUs (``allowance`` + ``active``), GPU admin
  (``gpu_table`` + ``limit_entries`` + ``queue``), the metrics scrape, the idle pass.

``--postgres URL`` (a SQLAlchemy URL of a server where the user may CREATE DATABASE, as
``scripts/postgres url`` prints) measures PostgreSQL too, in fresh databases it drops after.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import create_engine, insert, text
from sqlalchemy.engine import make_url

from spawner.ledger import Ledger, utcnow
from spawner.ledger.models import Allocation, AllocationGpu, KnownUser
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu as PGpu

SIZES = {"small": (100, 50), "large": (10_000, 5_000)}
GPUS_PER_NODE = 8
HISTORY_DAYS = 365
WARM = 5  # admissions each process makes before a throughput run is timed
RULES = LimitRules(default=Limit(max_gpus=16, gpu_hours=2000, window_hours=24 * 30))


def build(url: str, gpus: int, users: int, seed: int = 1) -> None:
    """A ledger at ``url`` with ``gpus`` GPUs, ``users`` users, a year of history, half full."""
    rnd = random.Random(seed)
    ledger = Ledger(url, config_rules=RULES)
    nodes = gpus // GPUS_PER_NODE
    ledger.sync_inventory(
        [PGpu(f"node{n:05d}", i, "A100") for n in range(nodes) for i in range(GPUS_PER_NODE)]
    )
    ledger.close()
    engine = create_engine(url)
    now = utcnow()
    with engine.begin() as conn:
        ids = [r[0] for r in conn.execute(text("SELECT id FROM gpus ORDER BY id"))]
        conn.execute(
            insert(KnownUser), [{"name": f"user{u}", "groups": "lab", "updated": now} for u in range(users)]
        )
        allocs, links, aid = [], [], 0
        for u in range(users):
            t = now - timedelta(days=HISTORY_DAYS)
            while True:
                t += timedelta(hours=rnd.expovariate(1 / 48))
                hours = rnd.uniform(1, 8)
                if t + timedelta(hours=hours) >= now:
                    break
                aid += 1
                n = rnd.choice((1, 1, 2, 2, 4, 8))
                allocs.append(
                    dict(
                        id=aid,
                        user=f"user{u}",
                        purpose="server",
                        server_name="",
                        state="released",
                        created=t,
                        started=t,
                        ended=t + timedelta(hours=hours),
                        backend="local",
                        gpu_count=n,
                        borrowed=0,
                        end_reason="released",
                    )
                )
                first = rnd.randrange(0, len(ids) - n)
                links += [dict(allocation_id=aid, gpu_id=ids[first + k], held=False) for k in range(n)]
        # the cluster half full now: one live 4-GPU server per node on every other node
        for n in range(0, nodes, 2):
            aid += 1
            t = now - timedelta(hours=rnd.uniform(0, 6))
            allocs.append(
                dict(
                    id=aid,
                    user=f"user{rnd.randrange(users)}",
                    purpose="server",
                    server_name="",
                    state="running",
                    created=t,
                    started=t,
                    ended=None,
                    backend="local",
                    gpu_count=4,
                    borrowed=0,
                    end_reason=None,
                )
            )
            links += [dict(allocation_id=aid, gpu_id=ids[n * GPUS_PER_NODE + k], held=True) for k in range(4)]
        for i in range(0, len(allocs), 20_000):
            conn.execute(insert(Allocation), allocs[i : i + 20_000])
        for i in range(0, len(links), 20_000):
            conn.execute(insert(AllocationGpu), links[i : i + 20_000])
    if url.startswith("postgresql"):
        with engine.connect() as conn:
            conn.execute(text("SELECT setval('allocations_id_seq', (SELECT max(id) FROM allocations))"))
            conn.commit()
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE"))
    else:
        with engine.connect() as conn:
            conn.execute(text("ANALYZE"))
    engine.dispose()
    print(f"  built {gpus} GPUs, {users} users, {len(allocs)} allocations", file=sys.stderr)


def admissions(url: str, users: int, cycles: int, seed: int) -> list[float]:
    return interleaved({"one": (url, users)}, cycles, seed)["one"]


def interleaved(
    ledgers: dict[str, tuple[str, int]], cycles: int, seed: int, start=None
) -> dict[str, list[float]]:
    """Admission + release times on each ledger, taking turns (the machine's noise falls on
    all). ``start``: a barrier to wait at once the ledgers are open and warm (several processes)."""
    rnd = random.Random(seed)
    opened = {name: (Ledger(url, config_rules=RULES), users) for name, (url, users) in ledgers.items()}
    warm = WARM if start is not None else 0  # a process reads the inventory once before the clock starts
    times: dict[str, list[float]] = {name: [] for name in ledgers}
    for k in range(warm + cycles):
        if k == warm and start is not None:
            start.wait()
            times = {name: [] for name in ledgers}
        for name, (ledger, users) in opened.items():
            user, count = f"user{rnd.randrange(users)}", rnd.choice((1, 2))
            t = time.perf_counter()
            got = ledger.request(user, ["lab"], count)
            if got.allocation is not None:
                ledger.release(got.allocation.id)
            else:
                ledger.leave_queue(got.entry.id)
            times[name].append(time.perf_counter() - t)
    for ledger, _ in opened.values():
        ledger.close()
    return times


def _worker(url, users, cycles, seed, start, done, threads=1):
    if threads == 1:
        interleaved({"one": (url, users)}, cycles, seed, start)
        done.put(time.perf_counter())
        return
    # one ledger shared by the threads, as a hub's or broker's thread pool shares its own
    ledger = Ledger(url, config_rules=RULES)
    ready = threading.Barrier(threads + 1)

    def requester(k: int) -> None:
        rnd = random.Random(seed * 1000 + k)
        for i in range(WARM + cycles):
            if i == WARM:
                ready.wait()
            got = ledger.request(f"user{rnd.randrange(users)}", ["lab"], rnd.choice((1, 2)))
            if got.allocation is not None:
                ledger.release(got.allocation.id)
            else:
                ledger.leave_queue(got.entry.id)

    ts = [threading.Thread(target=requester, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    ready.wait()
    start.wait()
    for t in ts:
        t.join()
    done.put(time.perf_counter())
    ledger.close()


def throughput(url: str, users: int, procs: int, cycles: int, threads: int = 1) -> float:
    """Admissions (each with its release) per second from ``procs`` processes at once (each
    with ``threads`` threads asking, sharing the process's ledger), timed from the moment all
    have their ledger open and warm to the moment the last is done."""
    ctx = mp.get_context("fork")
    start, done = ctx.Barrier(procs + 1), ctx.Queue()
    ps = [
        ctx.Process(target=_worker, args=(url, users, cycles, 100 + k, start, done, threads))
        for k in range(procs)
    ]
    for p in ps:
        p.start()
    start.wait()
    t = time.perf_counter()
    ends = [done.get() for _ in ps]
    for p in ps:
        p.join()
    return procs * threads * cycles / (max(ends) - t)


def taking_turns(url: str, users: int, cycles: int) -> tuple[float, float]:
    """Median admission + release of one ledger alone, and of two ledgers (as two processes
    would have) taking turns, each cycle after the other's: what catching up on another
    writer costs, without the scheduler's hand-overs. Rounds of both interleave."""
    rnd = random.Random(5)
    a, b = Ledger(url, config_rules=RULES), Ledger(url, config_rules=RULES)

    def cycle(ledger: Ledger) -> float:
        t = time.perf_counter()
        got = ledger.request(f"user{rnd.randrange(users)}", ["lab"], rnd.choice((1, 2)))
        if got.allocation is not None:
            ledger.release(got.allocation.id)
        else:
            ledger.leave_queue(got.entry.id)
        return time.perf_counter() - t

    for ledger in (a, b):
        for _ in range(WARM):
            cycle(ledger)
    alone, turns = [], []
    for _ in range(5):
        alone += [cycle(a) for _ in range(cycles // 5)]
        turns += [cycle(a if k % 2 else b) for k in range(cycles // 5)]
    a.close()
    b.close()
    return statistics.median(alone), statistics.median(turns)


def reads(url: str) -> dict[str, float]:
    from spawner.broker.metrics import LedgerCollector

    ledger = Ledger(url, config_rules=RULES)
    user = "user7"
    checks = {
        "My GPUs (allowance + active)": lambda: (ledger.allowance(user, ["lab"]), ledger.active(user=user)),
        "GPU admin (gpu_table + limits + queue)": lambda: (
            ledger.gpu_table(),
            ledger.limit_entries(),
            ledger.queue(),
        ),
        "metrics scrape": lambda: list(LedgerCollector(ledger).collect()),
        "idle pass (active)": lambda: ledger.active(),
    }
    out = {}
    for name, fn in checks.items():
        fn()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    ledger.close()
    return out


class Postgres:
    """Fresh databases on a PostgreSQL server, dropped at the end."""

    def __init__(self, url: str):
        self.url = make_url(url)
        self.made: list[str] = []
        self.admin = create_engine(self.url, isolation_level="AUTOCOMMIT")

    def fresh(self, name: str) -> str:
        db = f"gpuhub_bench_{name}"
        with self.admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
            conn.execute(text(f'CREATE DATABASE "{db}"'))
        self.made.append(db)
        return self.url.set(database=db).render_as_string(hide_password=False)

    def drop(self, tries: int = 30) -> None:
        """Drop the databases made. ``FORCE`` ends this user's sessions in them, not the
        server's own autovacuum worker (a non-superuser may not signal it), which a large
        database just written often has: such a drop is tried again each second until the
        worker is done, for ``tries`` seconds, then left to drop by hand."""
        with self.admin.connect() as conn:
            for db in self.made:
                for attempt in range(tries):
                    try:
                        conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
                        break
                    except Exception as e:  # still in use
                        if attempt == tries - 1:
                            why = type(e).__name__
                            print(f"  could not drop {db} ({why}): drop it by hand", file=sys.stderr)
                        else:
                            time.sleep(1)
        self.admin.dispose()


def run_backend(label: str, urls: dict[str, str], args) -> None:
    for size, url in urls.items():
        build(url, *SIZES[size])
    shapes = {size: (url, SIZES[size][1]) for size, url in urls.items()}
    interleaved(shapes, 10, 0)  # warm
    med = {size: statistics.median(t) for size, t in interleaved(shapes, args.cycles, 1).items()}
    print(f"{label}: one admission + release, median of {args.cycles}")
    for size, m in med.items():
        g, u = SIZES[size]
        print(f"  {g:>6} GPUs {u:>5} users, a year of history  {m * 1e3:7.2f} ms")
    print(f"  ratio large / small: {med['large'] / med['small']:.2f}x (goal: at most 1.5x)")
    rate = throughput(urls["large"], SIZES["large"][1], args.procs, args.cycles)
    alone = throughput(urls["large"], SIZES["large"][1], 1, args.cycles)
    print(f"  {args.procs} processes at once, large: {rate:.0f} admissions/s (each with its release)")
    print(f"  one process, large: {alone:.0f} admissions/s ({args.procs} processes: {rate / alone:.2f}x)")
    if args.threads > 1:  # a hub's or broker's thread pool: writes waiting together share a commit
        both = throughput(urls["large"], SIZES["large"][1], args.procs, args.cycles // 2, args.threads)
        one = throughput(urls["large"], SIZES["large"][1], 1, args.cycles // 2, args.threads)
        print(
            f"  {args.procs} processes of {args.threads} threads each, large: {both:.0f} admissions/s "
            f"({both / rate:.2f}x of {args.procs} single-threaded); one such process: {one:.0f}/s "
            f"({one / alone:.2f}x of one single-threaded)"
        )
    one, two = taking_turns(urls["large"], SIZES["large"][1], args.cycles)
    print(
        f"  two ledgers taking turns in one process (each write after the other's): {two * 1e3:.2f} ms "
        f"against one ledger's {one * 1e3:.2f} ms ({two / one:.2f}x)"
    )
    print(f"{label}: the broker's reads at the large size (goal: each within 100 ms)")
    for name, t in reads(urls["large"]).items():
        print(f"  {name:40s} {t * 1e3:7.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--postgres", help="SQLAlchemy URL of a PostgreSQL server (CREATE DATABASE allowed)")
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4, help="threads per process in the threaded run")
    ap.add_argument("--only", choices=("sqlite", "postgres"))
    args = ap.parse_args()
    if args.only != "postgres":
        with tempfile.TemporaryDirectory() as d:
            run_backend("SQLite", {s: f"sqlite:///{d}/{s}.sqlite" for s in SIZES}, args)
    if args.postgres and args.only != "sqlite":
        pg = Postgres(args.postgres)
        try:
            run_backend("PostgreSQL", {s: pg.fresh(s) for s in SIZES}, args)
        finally:
            pg.drop()


if __name__ == "__main__":
    main()
