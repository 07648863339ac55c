"""What admitting costs with nothing of gpuhub's around it: the floor under ``ledger_scale.py``.

    .venv/bin/python benchmarks/ledger_floor.py [--postgres URL] [--cycles N] [--procs 1,4,8] [--rounds R]

On the large ledger of ``ledger_scale.py`` (10,000 GPUs, 5,000 users, a year of history,
half full), the least that any design deciding each request in a transaction of its own has
to do, written on the bare driver (``sqlite3``, ``psycopg``) with no SQLAlchemy, no policy and
no record of moves:

- an admission: take the writer's turn (SQLite: an ``flock`` then ``BEGIN IMMEDIATE``, as
  gpuhub's ``WriterTurns``; PostgreSQL: count up the lock row, as gpuhub does), count the
  user's live GPUs (the limit check, nothing else: no GPU-hours, no queue, no groups), find a
  free GPU by its id, insert the allocation and its GPU, commit;
- its release: the turn, the allocation and its GPU marked given back, commit.

On PostgreSQL the statements go in psycopg's pipeline mode: an admission waits for the server
twice (the turn with the reads, then the writes with the commit) and a release once, the
fewest round trips a decision made in the client can have.

Against it, in the same run and on the same database:

- gpuhub's ``Ledger.request`` and ``release`` (limits with a GPU-hours window, placement, the
  queue, the moves other processes read);
- "one writer": the design that can pass the floor, as a prototype with the floor's rules. The
  processes send their requests to one process (a pipe each), which decides them in memory
  and writes all the requests waiting at once in one transaction before it answers them.

Rounds alternate between the three, for each number of processes in ``--procs``; the medians
of the rounds are printed with gpuhub's ratio to the floor. Where the floor itself stays
under a rate, no design that decides each request in its own transaction reaches that rate
on this machine.
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing as mp
import random
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ledger_scale as ls
from sqlalchemy.engine import make_url

USERS = ls.SIZES["large"][1]


LIVE = "state IN ('starting', 'running')"


class Statements:
    """The floor's statements, once, for a driver's placeholder (``?`` or ``%s``)."""

    def __init__(self, m: str, held: str):
        self.held_count = f'SELECT count(*) FROM allocations WHERE "user" = {m} AND {LIVE}'
        self.is_held = f"SELECT 1 FROM allocation_gpus WHERE gpu_id = {m} AND {held}"
        self.one_free = (  # PostgreSQL's: the first free one of several candidates
            f"SELECT g FROM unnest({m}::int[]) AS g WHERE NOT EXISTS "
            "(SELECT 1 FROM allocation_gpus WHERE gpu_id = g AND held) LIMIT 1"
        )
        self.insert = (
            'INSERT INTO allocations ("user", purpose, server_name, state, created, started, backend,'
            f" gpu_count, borrowed) VALUES ({m}, 'server', '', 'running', {m}, {m}, 'local', 1, 0)"
            " RETURNING id"
        )
        self.link = f"INSERT INTO allocation_gpus (allocation_id, gpu_id, held) VALUES ({m}, {m}, {m})"
        self.insert_with_link = (  # PostgreSQL's: both in one statement
            f"WITH a AS ({self.insert}) INSERT INTO allocation_gpus (allocation_id, gpu_id, held)"
            f" SELECT id, {m}, true FROM a RETURNING allocation_id"
        )
        self.end = f"UPDATE allocations SET state = 'released', ended = {m}, end_reason = 'released'"
        self.end += f" WHERE id = {m}"
        self.give = f"UPDATE allocation_gpus SET held = {m} WHERE allocation_id = {m}"


class Bare:
    """One process's connection and its admission + release on the bare driver."""

    def __init__(self, url: str):
        self.pg = url.startswith("postgresql")
        if self.pg:
            import psycopg

            u = make_url(url)
            self.conn = psycopg.connect(
                host=u.host, port=u.port, user=u.username, password=u.password, dbname=u.database
            )
            self.held = "held"
            self.turns = None
        else:
            path = make_url(url).database
            self.conn = sqlite3.connect(path, isolation_level=None, timeout=30)
            for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=30000"):
                self.conn.execute(f"PRAGMA {pragma}")
            self.held = "held = 1"
            self.turns = open(f"{path}-floor-writers", "a")
        self.gpus = [r[0] for r in self.conn.execute("SELECT id FROM gpus").fetchall()]
        if self.pg:
            self.conn.rollback()  # the read above began a transaction
        self.sql = Statements("%s" if self.pg else "?", self.held)

    def _begin(self) -> None:
        if self.pg:
            self.conn.execute("UPDATE ledger_lock SET generation = generation + 1 WHERE id = 1")
        else:
            fcntl.flock(self.turns, fcntl.LOCK_EX)
            self.conn.execute("BEGIN IMMEDIATE")

    def _commit(self) -> None:
        if self.pg:
            self.conn.commit()
        else:
            self.conn.execute("COMMIT")
            fcntl.flock(self.turns, fcntl.LOCK_UN)

    def cycle(self, rnd: random.Random) -> None:
        if self.pg:
            return self._cycle_pipelined(rnd)
        sql, now = self.sql, datetime.now(UTC).replace(tzinfo=None)
        user = f"user{rnd.randrange(USERS)}"
        self._begin()
        self.conn.execute(sql.held_count, (user,)).fetchone()
        while True:  # half the GPUs are free: a few tries at most
            gpu = rnd.choice(self.gpus)
            if self.conn.execute(sql.is_held, (gpu,)).fetchone() is None:
                break
        aid = self.conn.execute(sql.insert, (user, now, now)).fetchone()[0]
        self.conn.execute(sql.link, (aid, gpu, True))
        self._commit()
        self._begin()
        self.conn.execute(sql.end, (now, aid))
        self.conn.execute(sql.give, (False, aid))
        self._commit()

    def _cycle_pipelined(self, rnd: random.Random) -> None:
        """PostgreSQL's: the same statements in psycopg's pipeline mode, so that a transaction
        waits for the server twice at most (the turn and the reads; the writes and the commit)
        and the release once."""
        c, sql, now = self.conn, self.sql, datetime.now(UTC).replace(tzinfo=None)
        user = f"user{rnd.randrange(USERS)}"
        with c.pipeline():
            c.execute("UPDATE ledger_lock SET generation = generation + 1 WHERE id = 1")
            held = c.execute(sql.held_count, (user,))
            free = c.execute(sql.one_free, (rnd.sample(self.gpus, 8),))
            held.fetchone()
            found = free.fetchone()
            while found is None:  # all eight held (one time in 256 with half the GPUs free)
                found = c.execute(sql.one_free, (rnd.sample(self.gpus, 8),)).fetchone()
            booked = c.execute(sql.insert_with_link, (user, now, now, found[0]))
            c.commit()
            aid = booked.fetchone()[0]
            c.execute("UPDATE ledger_lock SET generation = generation + 1 WHERE id = 1")
            c.execute(sql.end, (now, aid))
            c.execute(sql.give, (False, aid))
            c.commit()

    def close(self) -> None:
        self.conn.close()


class OneWriter(Bare):
    """The design that would pass the floor: one process decides every request, in memory,
    and writes what it decided for all the requests waiting at once in one transaction. A
    prototype with the floor's rules (a live-GPU count per user, a free GPU), no more."""

    def __init__(self, url: str):
        super().__init__(url)
        self.free = set(self.gpus) - {
            r[0] for r in self.conn.execute(f"SELECT gpu_id FROM allocation_gpus WHERE {self.held}")
        }
        self.held_by: dict[int, tuple[int, str]] = {}  # allocation -> its GPU, its user
        self.live: dict[str, int] = dict(
            self.conn.execute(f'SELECT "user", count(*) FROM allocations WHERE {LIVE} GROUP BY "user"')
        )
        if self.pg:
            self.conn.rollback()
        self.batches: list[int] = []

    def decide_and_write(self, asks: list[tuple]) -> list:
        """``asks``: ("admit", user) or ("release", id); their answers, in order, once written."""
        now = datetime.now(UTC).replace(tzinfo=None)
        admits, releases, answers, ids = [], [], [], []
        for kind, what in asks:
            if kind == "admit":
                self.live[what] = self.live.get(what, 0) + 1  # the limit check would read this
                gpu = self.free.pop()
                admits.append((len(answers), what, gpu))
                answers.append(None)
            else:
                gpu, user = self.held_by.pop(what)
                self.free.add(gpu)
                self.live[user] -= 1
                releases.append(what)
                answers.append(True)
        self.batches.append(len(asks))
        sql = self.sql
        self._begin()
        cur = self.conn.cursor()
        if releases:  # first: a GPU given back may be taken again in the same batch
            cur.executemany(sql.end, [(now, aid) for aid in releases])
            cur.executemany(sql.give, [(False, aid) for aid in releases])
        if self.pg and admits:
            cur.executemany(
                sql.insert_with_link,
                [(user, now, now, gpu) for _, user, gpu in admits],
                returning=True,
            )
            ids = []
            for _ in admits:  # each row's RETURNING is a result of its own
                ids.append(cur.fetchone()[0])
                cur.nextset()
        elif admits:
            ids = [cur.execute(sql.insert, (user, now, now)).fetchone()[0] for _, user, _ in admits]
            links = [(aid, gpu, True) for aid, (_, _, gpu) in zip(ids, admits, strict=True)]
            cur.executemany(sql.link, links)
        self._commit()
        for aid, (slot, user, gpu) in zip(ids, admits, strict=True):
            self.held_by[aid] = (gpu, user)
            answers[slot] = aid
        return answers


def _one_writer(url, conns, ready) -> None:
    from multiprocessing.connection import wait

    writer = OneWriter(url)
    ready.put(True)
    open_ = list(conns)
    while open_:
        asks, whose = [], []
        for conn in wait(open_):
            ask = conn.recv()
            if ask is None:
                open_.remove(conn)
                continue
            asks.append(ask)
            whose.append(conn)
        if asks:
            for conn, answer in zip(whose, writer.decide_and_write(asks), strict=True):
                conn.send(answer)
    ready.put(statistics.mean(writer.batches))
    writer.close()


def _worker(kind, url, cycles, seed, start, done, conn=None):
    rnd = random.Random(seed)
    if kind == "one writer":

        def run():
            conn.send(("admit", f"user{rnd.randrange(USERS)}"))
            conn.send(("release", conn.recv()))
            conn.recv()

        def close():
            conn.send(None)

    elif kind == "bare":
        one = Bare(url)
        run, close = (lambda: one.cycle(rnd)), one.close
    else:
        ledger = ls.Ledger(url, config_rules=ls.RULES)

        def run():
            got = ledger.request(f"user{rnd.randrange(USERS)}", ["lab"], 1)
            if got.allocation is not None:
                ledger.release(got.allocation.id)
            else:
                ledger.leave_queue(got.entry.id)

        close = ledger.close
    try:
        for _ in range(ls.WARM):
            run()
        start.wait()
        for _ in range(cycles):
            run()
    except BaseException:
        done.put(None)  # the run is void: say so at once instead of leaving the others waiting
        start.abort()
        raise
    done.put(time.perf_counter())
    close()


def rate(kind: str, url: str, procs: int, cycles: int, seed: int) -> float:
    """Cycles (an admission and its release) per second from ``procs`` processes at once."""
    ctx = mp.get_context("fork")
    start, done = ctx.Barrier(procs + 1), ctx.Queue()
    pipes = [ctx.Pipe() for _ in range(procs)] if kind == "one writer" else [(None, None)] * procs
    ps = [
        ctx.Process(target=_worker, args=(kind, url, cycles, seed + k, start, done, pipes[k][0]))
        for k in range(procs)
    ]
    writer = None
    if kind == "one writer":
        ready = ctx.Queue()
        writer = ctx.Process(target=_one_writer, args=(url, [b for _, b in pipes], ready))
        writer.start()
        ready.get(timeout=300)  # the writer has read the free GPUs
    for p in ps:
        p.start()
    for a, b in pipes:  # the children's now: a process that dies closes its ends for the others
        if a is not None:
            a.close()
            b.close()
    try:
        start.wait()
    except threading.BrokenBarrierError:
        pass  # a process failed before the clock started: its None is in ``done``
    t = time.perf_counter()
    ends = [done.get() for _ in ps]
    if None in ends:
        for p in [*ps, *([writer] if writer else [])]:
            p.kill()
        raise SystemExit(f"a {kind} process failed (its traceback is above)")
    for p in [*ps, *([writer] if writer else [])]:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a {kind} process failed (exit {p.exitcode})")
    if writer is not None:
        rate.batch = ready.get()  # requests decided per transaction, on average
    return procs * cycles / (max(ends) - t)


def run_backend(label: str, url: str, args) -> None:
    ls.build(url, *ls.SIZES["large"])
    kinds = ("bare", "one writer", "gpuhub")
    results: dict[tuple[str, int], list[float]] = {}
    batches: dict[int, list[float]] = {}
    for r in range(args.rounds):
        for procs in args.procs:
            for kind in kinds:
                results.setdefault((kind, procs), []).append(rate(kind, url, procs, args.cycles, 100 * r))
                if kind == "one writer":
                    batches.setdefault(procs, []).append(rate.batch)
    print(f"{label}: admission + release cycles per second, median of {args.rounds} rounds (10,000 GPUs)")
    for procs in args.procs:
        bare, one, hub = (statistics.median(results[(k, procs)]) for k in kinds)
        print(
            f"  {procs} process{'es' if procs > 1 else '  '}: bare driver {bare:6.0f}/s"
            f"  one writer {one:6.0f}/s ({statistics.median(batches[procs]):.1f} a transaction)"
            f"  gpuhub {hub:6.0f}/s ({hub / bare:.2f}x of the floor)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--postgres", help="SQLAlchemy URL of a PostgreSQL server (CREATE DATABASE allowed)")
    ap.add_argument("--cycles", type=int, default=300)
    ap.add_argument(
        "--procs", type=lambda v: [int(p) for p in v.split(",")], default=[1, 4, 8], help="e.g. 1,4,8"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=("sqlite", "postgres"))
    args = ap.parse_args()
    if args.only != "postgres":
        with tempfile.TemporaryDirectory() as d:
            run_backend("SQLite", f"sqlite:///{d}/large.sqlite", args)
    if args.postgres and args.only != "sqlite":
        pg = ls.Postgres(args.postgres)
        try:
            run_backend("PostgreSQL", pg.fresh("floor"), args)
        finally:
            pg.drop()


if __name__ == "__main__":
    main()
