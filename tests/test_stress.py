"""Several processes allocate, queue, wait, leave and release at random against one ledger,
on a SQLite file and on a PostgreSQL database.

The invariant checker reads the whole history back from the database and replays it:
no GPU is ever held by two allocations at the same moment, no user ever holds more than
their limit, nor holds and waits for more than it. It also runs concurrently with the
workers on live snapshots.

The order checker replays every grant: it rebuilds the ledger as it stood at the grant's
moment (from the allocations' and queue entries' history, in a scratch SQLite file) and asks
that ledger's own :meth:`Ledger.queue` whether the plan at that moment started the entry
(its position is 0). A request granted at once is checked as a waiting entry made at that
moment. So a grant that passed someone the policy put first (a lost lock, a scene read
outside the write transaction, a new request ranked differently from a waiting one) shows.
"""

import multiprocessing as mp
import random
import threading
from collections import Counter
from datetime import datetime, timedelta

from sqlalchemy import create_engine, delete, insert, select, update

from spawner.ledger import BorrowSettings, Ledger, QueueSettings
from spawner.ledger.models import Allocation, AllocationGpu, GpuRow, Node, Preemption, QueueEntry
from spawner.policy.borrowing import BorrowRules, backfill_ids, effective_borrow
from spawner.policy.fairshare import Shares
from spawner.policy.limits import Limit, LimitRules, Refusal, effective_limit
from spawner.policy.placement import Gpu

from . import invariants
from .invariants import A, E, history, read

INV = [Gpu(f"n{n}", i, "A100") for n in range(3) for i in range(4)]
RULES = LimitRules(default=Limit(max_gpus=3), groups={"big": Limit(max_gpus=6)})
USERS = {f"u{i}": (["big"] if i % 3 == 0 else []) for i in range(8)}
# no entry goes stale and no lease runs out during a run: the order checker's replay has
# only the ends the history shows (expiry and keepalive have their own tests)
QUEUE = QueueSettings(shares=Shares(groups={"big": 3}), keepalive_seconds=3600, max_wait_hours=12)
LEASE_SECONDS = 3600
QUIET_OPS = 40  # each worker's first operations queue nothing (the hub at night)
# every user may borrow 2 beyond the limit (the big group 1); notices are due at once, so a
# preempted burst's next renewal is refused and the worker releases it
BORROW = BorrowSettings(rules=BorrowRules(default=2, groups={"big": 1}), grace_seconds=0.0)
COUNTS = [1, 1, 2, 2, 3, 4]  # GPUs asked for


def worker(url: str, seed: int, ops: int, results, threads: int = 1) -> None:
    """One process: ``threads`` workers asking at once through the process's one ledger (as a
    hub's or broker's thread pool does: their writes that wait together commit together)."""
    ledger = Ledger(url, config_rules=RULES, queue=QUEUE, borrow=BORROW)
    outcomes = []

    def one(k: int) -> None:
        outcomes.append(work(ledger, seed * 10 + k, ops // threads))

    pool = [threading.Thread(target=one, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    ledger.close()
    assert len(outcomes) == threads, "a worker thread failed (its error is printed above)"
    n: Counter = Counter(ledger.write_counts)
    shapes: dict[int, int | None] = {}
    gives: dict[int, list] = {}
    for counts, made, given in outcomes:
        n.update(counts)
        shapes.update(made)
        for aid, times in given.items():
            gives.setdefault(aid, []).extend(times)
    results.put((dict(n), shapes, gives))


def work(ledger: Ledger, seed: int, ops: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    mine: list[int] = []  # allocations held
    waits: list[int] = []  # queue entries waited on
    lent: set[int] = set()  # of mine, those with borrowed GPUs
    shapes: dict[int, int | None] = {}  # max_nodes of what was granted at once (for the replay)
    # each notice given, by allocation (a notice withdrawn and given again is one row in the
    # ledger, which keeps only the last: the replay needs the earlier ones)
    gives: dict[int, list] = {}
    n: Counter = Counter()

    def stop(a: int) -> None:
        """A borrowed allocation that was given notice stops: taken back, or its notice moot."""
        assert ledger.release(a, "stress: stopped")
        ended = ledger.get(a)
        if not ended.end_reason.startswith("preempted: "):
            # the owner's own release: the request its notice was for no longer waited
            # (served otherwise, left), which it cannot have started doing again since
            [p] = [p for p in ledger.preemptions(ended.user) if p.allocation_id == a]
            entry = ledger.queue_entry(p.entry_id) if p.entry_id is not None else None
            assert entry is not None and entry.state != "waiting", (ended, p, entry)
            assert ended.end_reason == "stress: stopped", ended
            n["released, its notice moot"] += 1
        else:
            n["preempted and released"] += 1
        mine.remove(a)
        lent.discard(a)

    for k in range(ops):
        r = rng.random()
        x = rng.random()  # the borrowing operations, beside the queue's
        quiet = k < QUIET_OPS  # nobody queues yet: idle GPUs are lent, later taken back
        if x < 0.1:  # the broker's pass: notice to borrowed allocations in the head's way
            given = ledger.preempt_for_queue()
            for p in given:
                gives.setdefault(p.allocation_id, []).append((p.created, p.due))
            n["preemptions"] += len(given)
            continue
        if lent and x < 0.2:  # a kernel renews; refused once preempted (due at once), it stops
            a = rng.choice(sorted(lent))
            info = ledger.get(a)
            try:
                if info.lease_expires is not None:
                    ledger.renew(a, LEASE_SECONDS)
                    continue
                if info.preempt_due is None:
                    continue
                # a server given notice: the broker stops it once due
            except LookupError as e:
                assert "was preempted" in str(e), e
            stop(a)
            continue
        own = [a for a in mine if a not in lent]  # borrowed ones end when taken back (or at the end)
        if quiet and mine and r < 0.4:  # at night borrowers give back too
            a = rng.choice(mine)
            mine.remove(a)
            lent.discard(a)
            ledger.release(a, "stress")
            continue
        if quiet or x < 0.2:  # a user asks beyond the limit (held or not): borrows when nobody waits
            user = rng.choice(sorted(USERS))
            limit = effective_limit(user, USERS[user], RULES).limit.max_gpus
            held = sum(a.gpu_count for a in ledger.active(user=user))
            count = max(1, limit - held + rng.choice([1, 1, 2, 3]))  # 3 more: beyond some allowances
            kw = {"server_name": f"w{seed}-{k}", "max_nodes": None}
            if rng.random() < 0.5:
                kw |= {"purpose": "distributed", "lease_seconds": LEASE_SECONDS}
            try:
                a = ledger.allocate(user, USERS[user], count, **kw)
            except Refusal as e:
                n[f"borrow refused: {e.reason}"] += 1
                continue
            mine.append(a.id)
            if a.borrowed:
                lent.add(a.id)
            shapes[a.id] = None
            n["borrowed" if a.borrowed else "granted"] += 1
            continue
        if own and r < 0.35:
            a = rng.choice(own)
            mine.remove(a)
            ledger.release(a, "stress")
            continue
        if waits and r < 0.7:
            entry = rng.choice(waits)
            got = ledger.wait_turn(entry)
            if got.allocation is not None:
                mine.append(got.allocation.id)
                n["granted after waiting"] += 1
            if got.entry.state != "waiting":
                waits.remove(entry)
            continue
        if waits and r < 0.75:
            assert ledger.leave_queue(waits.pop(rng.randrange(len(waits))), "stress")
            n["left"] += 1
            continue
        user = rng.choice(sorted(USERS))
        max_nodes = rng.choice([1, None])
        kw = {"max_nodes": max_nodes, "server_name": f"w{seed}-{k}"}
        if rng.random() < 0.3:
            kw |= {"purpose": "distributed", "lease_seconds": LEASE_SECONDS}
        try:
            if not quiet and rng.random() < 0.6:
                got = ledger.request(user, USERS[user], rng.choice(COUNTS), **kw)
                if got.entry is not None:
                    waits.append(got.entry.id)
                    n["queued"] += 1
                    continue
                a = got.allocation
            else:
                a = ledger.allocate(user, USERS[user], rng.choice(COUNTS), **kw)
            if rng.random() < 0.5 and a.state != "running":
                ledger.mark_running(a.id, str(seed))
            mine.append(a.id)
            shapes[a.id] = max_nodes
            n["granted"] += 1
            if a.borrowed:
                lent.add(a.id)
                n["borrowed"] += 1
        except Refusal as e:
            n["refused"] += 1
            n[e.reason] += 1
    # the end of the day: what was given notice stops, borrowed or backfilled (a run whose only
    # notice went to a backfilled allocation counted no release before: a flake in CI)
    for a in sorted(set(lent) | set(mine)):
        info = ledger.get(a)
        if info.state != "released" and any(p.allocation_id == a for p in ledger.preemptions(info.user)):
            stop(a)
    for e in waits[::2]:  # leave some waiting and some held at the end
        ledger.leave_queue(e, "stress end")
    for a in mine[: len(mine) // 2]:
        ledger.release(a, "stress end")
    return dict(n), shapes, gives


def preemption_problems(url: str) -> list[str]:
    """Preemptions of allocations that borrowed nothing and did not start ahead of the request
    they were taken back for (backfill), or that had ended already."""
    P = Preemption
    [found] = read(
        url,
        select(P.allocation_id, A.borrowed, A.backfill_for, P.entry_id, A.created, A.ended, P.created).join(
            A
        ),
    )
    problems = []
    for aid, borrowed, ahead_of, entry_id, created, ended, at in found:
        if not borrowed and entry_id not in backfill_ids(ahead_of):
            problems.append(
                f"allocation {aid} was preempted, but it borrowed nothing and went ahead of nobody"
            )
        if at < created or (ended is not None and ended < at):
            problems.append(f"allocation {aid} was preempted at {at}, outside its life {created}-{ended}")
    return problems


def stress_limits(user: str) -> tuple[int | None, int]:
    groups = USERS.get(user, [])
    return effective_limit(user, groups, RULES).limit.max_gpus, effective_borrow(user, groups, BORROW.rules)[
        0
    ]


def check_invariants(rows, entries=()) -> list[str]:
    return invariants.check_invariants(rows, entries, limits=stress_limits)


class Replay:
    """The ledger as it stood at a past moment, rebuilt in a scratch SQLite file from the
    history of ``source`` (any database), read through a :class:`Ledger` whose clock stands
    at that moment."""

    def __init__(self, source: str, scratch: str):
        self.scratch = f"sqlite:///{scratch}"
        self.moment = None
        nodes, gpus, self.allocations, self.allocation_gpus, self.entries, self.notices = (
            [dict(r._mapping) for r in rows]
            for rows in read(
                source,
                *(select(t) for t in (Node, GpuRow, Allocation, AllocationGpu, QueueEntry, Preemption)),
            )
        )
        self.ledger = Ledger(self.scratch, config_rules=RULES, queue=QUEUE, clock=self.clock)
        self.ledger.close()  # created at the schema's head; it reopens on each read
        self.engine = create_engine(self.scratch)
        with self.engine.begin() as db:
            db.execute(delete(GpuRow))
            db.execute(delete(Node))
            self._copy(db, Node, nodes)
            self._copy(db, GpuRow, gpus)

    def clock(self):
        return self.moment

    @staticmethod
    def _copy(db, model, rows) -> None:
        if rows:
            db.execute(insert(model), rows)

    def earlier_notices(self, moment: datetime, gives: dict[int, list]) -> list[dict]:
        """The notices that may have stood at ``moment`` though the ledger's rows do not say
        so: a notice withdrawn and given again later is the same row, with only its last
        giving (``gives``: every giving, by allocation, as the workers saw them). Such an
        earlier notice was withdrawn at some time before the next giving, unknown."""
        rows = {n["allocation_id"]: n for n in self.notices}
        found = []
        for aid, times in gives.items():
            row = rows.get(aid)
            if row is None or row["created"] < moment:  # the row itself says what stood
                continue
            before = [(c, d) for c, d in sorted(times) if c < moment]
            if before:
                created, due = before[-1]
                found.append(
                    row | {"created": created, "due": due, "withdrawn": None, "withdrawn_reason": None}
                )
        return found

    def queue_at(self, moment: datetime, new: dict | None = None, maybe: list[dict] = ()):
        """The queue as :meth:`Ledger.queue` saw it just before ``moment`` (a stored time),
        with ``new`` (queue_entries columns) as one more entry made at that moment, and the
        notices ``maybe`` standing too."""
        allocations = []
        for a in self.allocations:
            if a["created"] >= moment:
                continue
            a = dict(a)
            if a["started"] is not None and a["started"] >= moment:
                a["started"] = None
            if a["ended"] is None or a["ended"] >= moment:
                a |= {"ended": None, "end_reason": None, "state": "running" if a["started"] else "starting"}
            allocations.append(a)
        live = {a["id"]: a["ended"] is None for a in allocations}
        held = [
            ag | {"held": live[ag["allocation_id"]]}
            for ag in self.allocation_gpus
            if ag["allocation_id"] in live
        ]
        entries = [
            e
            if e["ended"] is not None and e["ended"] < moment
            else e | {"state": "waiting", "ended": None, "end_reason": None, "allocation_id": None}
            for e in self.entries
            if e["created"] < moment
        ]
        # the notices given by then (a notice's due time is a holding's firm end in the plan)
        notices = [
            n
            if n["withdrawn"] is not None and n["withdrawn"] < moment
            else n | {"withdrawn": None, "withdrawn_reason": None}
            for n in self.notices
            if n["created"] < moment
        ] + list(maybe)
        with self.engine.begin() as db:
            for model in (Preemption, AllocationGpu, QueueEntry, Allocation):
                db.execute(delete(model))
            self._copy(db, Allocation, allocations)
            self._copy(db, AllocationGpu, held)
            self._copy(db, QueueEntry, entries)
            self._copy(db, Preemption, notices)
            if new is not None:
                db.execute(insert(QueueEntry).values(new))
        self.moment = moment
        led = Ledger(self.scratch, config_rules=RULES, queue=QUEUE, clock=self.clock)
        try:
            return led.queue()
        finally:
            led.close()

    def close(self) -> None:
        self.engine.dispose()


def grants(source: str):
    """Every grant as ``(moment, entry id or None, allocation id, user, count, purpose, server_name)``;
    its moment is its allocation's creation, the time its transaction's plan was computed at."""
    granted = select(E.allocation_id).where(E.allocation_id.is_not(None))
    waited, at_once = read(
        source,
        select(A.created, E.id, A.id, A.user, A.gpu_count, A.purpose, A.server_name)
        .join(A, A.id == E.allocation_id)
        .where(E.state == "granted"),
        select(A.created, None, A.id, A.user, A.gpu_count, A.purpose, A.server_name).where(
            A.id.not_in(granted)
        ),
    )
    return sorted(tuple(r) for r in waited + at_once)


def check_grant_order(
    source: str, scratch: str, shapes: dict[int, int | None], gives: dict[int, list] | None = None
) -> list[str]:
    """Problems: grants the queue's plan at their moment did not start. Where a notice may
    have stood then (``Replay.earlier_notices``), the plan with it and without it are both
    what the ledger may have seen: the grant must be the start of one of them."""
    replay = Replay(source, scratch)
    problems = []
    for moment, entry_id, alloc_id, user, count, purpose, server_name in grants(source):
        new = None
        if entry_id is None:  # granted at once: as if it had joined the queue at that moment
            new = {
                "user": user,
                "groups": ",".join(USERS.get(user, [])),
                "purpose": purpose,
                "server_name": server_name,
                "backend": "local",
                "gpu_count": count,
                "max_nodes": shapes.get(alloc_id, 1),
                "state": "waiting",
                "created": moment,
                "seen": moment,
            }

        def place(moment=moment, new=new, entry_id=entry_id, server_name=server_name, user=user, maybe=()):
            found = {q.id: q for q in replay.queue_at(moment, new, maybe)}
            if entry_id is None:
                [q] = [q for q in found.values() if q.server_name == server_name and q.user == user]
                return q
            return found[entry_id]

        q = place()
        maybe = replay.earlier_notices(moment, gives or {})
        if q.position != 0 and maybe:
            q = place(maybe=maybe)
        if q.position != 0:
            problems.append(
                f"allocation {alloc_id} ({user}, {count} GPUs{f', entry {entry_id}' if entry_id else ''}) "
                f"was granted at {moment} while the queue had it {q.position} of {q.waiting}"
            )
    replay.close()
    return problems


def test_concurrent_processes_never_double_book_or_exceed_limits(db_url, tmp_path):
    url = db_url
    first = Ledger(url, config_rules=RULES, queue=QUEUE)
    first.sync_inventory(INV)
    first.close()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # two processes of one worker, two of two worker threads sharing their process's ledger
    procs = [ctx.Process(target=worker, args=(url, seed, 330, results, 1 + seed // 2)) for seed in range(4)]
    for p in procs:
        p.start()
    live_problems = []
    while any(p.is_alive() for p in procs):
        live_problems += check_invariants(*history(url))  # snapshots while they write
        for p in procs:
            p.join(timeout=0.2)
    assert all(p.exitcode == 0 for p in procs)
    counts: Counter = Counter()
    shapes: dict[int, int | None] = {}
    gives: dict[int, list] = {}
    for _ in procs:
        n, s, g = results.get(timeout=10)
        counts.update(n)
        shapes.update(s)
        for aid, times in g.items():
            gives.setdefault(aid, []).extend(times)
    # every path exercised: granted at once and after waiting, queued, left, refused
    assert counts["granted"] > 60 and counts["refused"] > 20, counts
    assert counts["queued"] > 25 and counts["granted after waiting"] > 10 and counts["left"] > 8, counts
    assert counts["borrowed"] > 5 and counts["borrow refused: no_borrowing"] > 5, counts
    # notices given, and allocations under notice released: as preempted, or as their owner's
    # once the request the notice was for no longer waited (both checked where they happen)
    released = counts["preempted and released"] + counts["released, its notice moot"]
    assert counts["preemptions"] > 0 and released > 0, counts
    # the threads' writes that waited together were made in one transaction, and a refusal
    # among them had the others made again
    assert counts["combined"] > 0 and counts["made again"] > 0, counts
    assert live_problems == []
    assert check_invariants(*history(url)) == []
    assert check_grant_order(url, str(tmp_path / "replay.sqlite"), shapes, gives) == []
    assert preemption_problems(url) == []
    # the invariant checker itself catches a double booking and an over-limit user
    rows, entries = history(url)
    _aid, _user, created, _ended, _state, gpu_id, _held, _borrowed = rows[0]
    forged = [(10**6, "u1", created, None, "running", gpu_id, 1, 0)]
    forged += [(10**6 + k, "u1", created, None, "running", 10**6 + k, 1, 0) for k in range(1, 4)]
    found = check_invariants(rows + forged, entries)
    assert any("at once" in p for p in found) and any(
        "held 4 GPUs, over their limit of 3" in p for p in found
    )
    # ... and a user waiting for more than their limit allows beside what they hold
    holder = rows[0]
    waited = [(10**6, holder[1], 7, holder[2], None)]  # more than any limit (6)
    assert any("held and waited for" in p for p in check_invariants(rows, entries + waited))
    assert_the_checker_knows_the_borrowing_exception()


def assert_the_checker_knows_the_borrowing_exception():
    """Forged histories: u1 (limit 3, allowance 2) on GPUs of their own, nobody else."""
    t = [datetime(2026, 11, 2, 9, k) for k in range(10)]

    def alloc(aid, start, n, borrowed, end=None):
        return [(aid, "u1", t[start], end and t[end], "running", aid * 10 + k, 1, borrowed) for k in range(n)]

    within = alloc(1, 0, 3, 0) + alloc(2, 1, 2, 2)  # 3 in the limit, 2 borrowed: allowed
    assert check_invariants(within) == []
    beyond = alloc(1, 0, 3, 0) + alloc(2, 1, 3, 3)  # 3 borrowed: beyond the allowance of 2
    assert check_invariants(beyond) == [
        f"u1 {what} 6 GPUs, over their limit of 3 (borrowed 3 of an allowance of 2)"
        for what in ("held", "held and waited for")
    ]
    unmarked = alloc(1, 0, 3, 0) + alloc(2, 1, 2, 1)  # 2 beyond the limit, only 1 marked
    found = check_invariants(unmarked)
    assert "u1 held 5 GPUs, over their limit of 3 (borrowed 1 of an allowance of 2)" in found
    # borrowed while somebody (u2) waited: reported, even though within the allowance
    entry = (7, "u2", 1, t[0], t[5])
    found = check_invariants(within, [entry])
    assert found == [f"allocation 2 (u1) borrowed 2 GPU(s) at {t[1]} while 1 request(s) waited (entry 7)"]
    assert check_invariants(within, [(7, "u2", 1, t[0], t[1])]) == []  # it had been granted by then
    assert check_invariants(within, [(7, "u2", 1, t[2], None)]) == []  # it came later
    # the borrowed GPUs given back: the limit holds again without any marks
    later = alloc(1, 0, 3, 0) + alloc(2, 1, 2, 2, end=3) + alloc(3, 4, 1, 0)
    assert check_invariants(later) == [
        f"u1 {what} 4 GPUs, over their limit of 3" for what in ("held", "held and waited for")
    ]
    assert check_invariants(alloc(1, 0, 3, 0) + alloc(2, 1, 2, 2, end=3) + alloc(3, 4, 2, 2)) == []


def test_the_order_checker_catches_a_grant_out_of_order(db_url, tmp_path):
    """Two light users wait for 2 GPUs each, the first first; 2 GPUs free and the first gets
    them. The history passes; forged so that the second got them instead, it does not."""
    now = [datetime(2026, 11, 2, 9, 0)]

    def clock():
        return now[0]

    def tick():
        now[0] += timedelta(minutes=1)

    source = db_url
    led = Ledger(source, config_rules=RULES, queue=QUEUE, clock=clock)
    led.sync_inventory(INV)
    shapes = {}
    for user, count in [("u0", 4), ("u3", 4), ("u6", 2), ("u1", 2)]:  # all 12 held
        shapes[led.allocate(user, USERS[user], count, max_nodes=None).id] = None
        tick()
    first = led.request("u2", [], 2).entry
    tick()
    second = led.request("u4", [], 2).entry
    tick()
    led.release(led.active(user="u1")[0].id)
    tick()
    assert led.wait_turn(second.id).allocation is None  # u2 is ahead
    granted = led.wait_turn(first.id).allocation
    led.close()
    assert check_grant_order(source, str(tmp_path / "replay1.sqlite"), shapes) == []
    engine = create_engine(source)
    with engine.begin() as db:
        moment = db.scalar(select(A.created).where(A.id == granted.id))
        moved = {"state": "granted", "ended": moment, "allocation_id": granted.id}
        db.execute(update(E).where(E.id == second.id).values(moved))
        db.execute(update(E).where(E.id == first.id).values(state="waiting", ended=None, allocation_id=None))
        db.execute(update(A).where(A.id == granted.id).values(user="u4"))
    engine.dispose()
    found = check_grant_order(source, str(tmp_path / "replay2.sqlite"), shapes)
    assert found == [
        f"allocation {granted.id} (u4, 2 GPUs, entry {second.id}) was granted at "
        f"{moment} while the queue had it 1 of 1"
    ]
