"""Several processes take slices and whole GPUs, queue, wait, leave and release at random
against one ledger, on a SQLite file and on a PostgreSQL database (issue 34).

The checker replays the whole history from the database: a GPU is never held whole by two,
never whole and in slices at once, a slice never by two, its held shares never add up past
the whole GPU, and no user ever holds (or holds and waits for) more than their limit, a slice
counting as its share. It also runs while the workers write; forged histories prove that it
catches each kind of break."""

import multiprocessing as mp
import random
from collections import Counter, defaultdict
from datetime import datetime
from fractions import Fraction

from sqlalchemy import select

from spawner.ledger import Ledger, QueueSettings
from spawner.ledger.models import Allocation, AllocationGpu, QueueEntry
from spawner.policy.limits import Limit, LimitRules, Refusal, effective_limit
from spawner.policy.placement import Gpu
from spawner.policy.slices import check_gpu_slices

from .invariants import read

INV = [Gpu("n0", i, "A100", 40960) for i in range(2)] + [Gpu("n1", i, "T4", 16384) for i in range(3)]
OFFERS = check_gpu_slices({"A100": 4}, INV)
RULES = LimitRules(default=Limit(max_gpus=1), groups={"staff": Limit(max_gpus=2)})
USERS = {f"u{i}": (["staff"] if i % 4 == 0 else []) for i in range(8)}
QUEUE = QueueSettings(keepalive_seconds=3600, max_wait_hours=12)
FOREVER = datetime.max


def ledger_for(url: str) -> Ledger:
    return Ledger(url, config_rules=RULES, queue=QUEUE, slice_offers=OFFERS)


def worker(url: str, seed: int, ops: int, results) -> None:
    ledger = ledger_for(url)
    try:
        results.put(work(ledger, seed, ops))
    finally:
        ledger.close()


def work(ledger: Ledger, seed: int, ops: int) -> dict:
    rng = random.Random(seed)
    mine: list[int] = []
    waits: list[int] = []
    n: Counter = Counter()
    for k in range(ops):
        r = rng.random()
        if mine and r < 0.3:
            ledger.release(mine.pop(rng.randrange(len(mine))), "stress")
            continue
        if waits and r < 0.55:
            entry = rng.choice(waits)
            got = ledger.wait_turn(entry)
            if got.allocation is not None:
                mine.append(got.allocation.id)
                n["granted after waiting"] += 1
            if got.entry.state != "waiting":
                waits.remove(entry)
            continue
        if waits and r < 0.6:
            assert ledger.leave_queue(waits.pop(rng.randrange(len(waits))), "stress")
            n["left"] += 1
            continue
        user = rng.choice(sorted(USERS))
        kind = rng.random()
        if kind < 0.6:
            kw = {"model": "A100", "slice_parts": 4}
            count = 1
        else:
            kw = {"model": rng.choice(["A100", None])}
            count = rng.choice([1, 1, 2])
        kw["server_name"] = f"w{seed}-{k}"
        try:
            if rng.random() < 0.6:
                got = ledger.request(user, USERS[user], count, **kw)
                if got.entry is not None:
                    waits.append(got.entry.id)
                    n["queued slice" if "slice_parts" in kw else "queued whole"] += 1
                    continue
                a = got.allocation
            else:
                a = ledger.allocate(user, USERS[user], count, **kw)
            mine.append(a.id)
            n["slice" if a.slice_parts else "whole"] += 1
        except Refusal as e:
            n[f"refused: {e.reason}"] += 1
    for e in waits[::2]:
        ledger.leave_queue(e, "stress end")
    for a in mine[: len(mine) // 2]:
        ledger.release(a, "stress end")
    return dict(n)


A, AG, E = Allocation, AllocationGpu, QueueEntry


def history(url: str):
    return read(
        url,
        select(
            A.id, A.user, A.created, A.ended, A.gpu_count, A.slice_parts, AG.gpu_id, AG.part, AG.parts
        ).join(AG, AG.allocation_id == A.id, isouter=True),
        select(E.id, E.user, E.gpu_count, E.slice_parts, E.created, E.ended),
    )


def check(rows, entries=()) -> list[str]:
    """Replay the history: the problems found, none when the ledger never broke a rule."""
    problems = []
    per_gpu = defaultdict(list)
    held = {}
    for aid, user, created, ended, count, slice_parts, gpu_id, part, parts in rows:
        end = ended or FOREVER
        if gpu_id is not None:
            per_gpu[gpu_id].append((created, end, aid, part or 0, parts or 0))
        held[aid] = (user, created, end, Fraction(count, slice_parts or 1))
    for gpu_id, spans in per_gpu.items():
        # at equal times ends come first (an end and a start in one write)
        events = sorted([(c, 1, s) for s in spans for c in [s[0]]] + [(s[1], 0, s) for s in spans])
        whole, parts_held = set(), {}
        for _t, starts, (_c, _e, aid, part, parts) in events:
            if not starts:
                (whole.discard(aid) if not part else parts_held.pop(part, None))
                continue
            if not part:
                if whole or parts_held:
                    problems.append(f"GPU {gpu_id} given whole to {aid} while held by {whole or parts_held}")
                whole.add(aid)
                continue
            if whole:
                problems.append(f"GPU {gpu_id} sliced for {aid} while held whole by {whole}")
            if part in parts_held:
                problems.append(
                    f"slice {part} of GPU {gpu_id} held by {parts_held[part][0]} and {aid} at once"
                )
            parts_held[part] = (aid, parts)
            share = sum(Fraction(1, p) for _a, p in parts_held.values())
            if share > 1:
                problems.append(f"GPU {gpu_id} held in slices adding up to {share} of it")

    def replay(spans, what):
        events = sorted([(c, 1, u, x) for u, c, _e, x in spans] + [(e, 0, u, x) for u, _c, e, x in spans])
        count = defaultdict(Fraction)
        for _t, starts, user, x in events:
            count[user] += x if starts else -x
            limit = effective_limit(user, USERS.get(user, []), RULES).limit.max_gpus
            if limit is not None and count[user] > limit:
                problems.append(f"{user} {what} {count[user]} GPUs, over their limit of {limit}")

    spans = list(held.values())
    replay(spans, "held")
    waited = [(u, c, e or FOREVER, Fraction(n, parts or 1)) for _id, u, n, parts, c, e in entries]
    replay(spans + waited, "held and waited for")
    return problems


def test_concurrent_processes_never_mix_slices_and_whole_gpus_or_pass_a_limit(db_url):
    first = ledger_for(db_url)
    first.sync_inventory(INV)
    first.close()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(db_url, seed, 250, results)) for seed in range(3)]
    for p in procs:
        p.start()
    live_problems = []
    while any(p.is_alive() for p in procs):
        live_problems += check(*history(db_url))  # snapshots while they write
        for p in procs:
            p.join(timeout=0.2)
    assert all(p.exitcode == 0 for p in procs)
    counts: Counter = Counter()
    for _ in procs:
        counts.update(results.get(timeout=10))
    # every path taken: slices and whole GPUs at once and after waiting, refusals over the limit
    assert counts["slice"] > 40 and counts["whole"] > 8, counts
    assert counts["queued slice"] > 15 and counts["queued whole"] > 2, counts
    assert counts["granted after waiting"] > 5 and counts["refused: over_limit"] > 40, counts
    assert live_problems == []
    rows, entries = history(db_url)
    assert check(rows, entries) == []
    # the checker catches each kind of break, forged into the real history
    slice_row = next(r for r in rows if r[7])
    _aid, _user, created, _ended, _n, _sp, gpu_id, part, _parts = slice_row
    big = 10**6
    forged = {
        "given whole": [(big, "u1", created, None, 1, None, gpu_id, 0, 0)],
        f"slice {part} of GPU {gpu_id} held by": [(big, "u1", created, None, 1, 4, gpu_id, part, 4)],
        "adding up to": [
            (big, "u1", created, None, 1, 2, gpu_id, 9, 2),
            (big + 1, "u2", created, None, 1, 2, gpu_id, 8, 2),
        ],
        "u3 held 5/4 GPUs": [(big + k, "u3", created, None, 1, 4, None, None, None) for k in range(5)],
    }
    for kind, extra in forged.items():
        assert any(kind in p for p in check(rows + extra, entries)), kind
    waited = [(big + k, "u5", 1, 4, created, None) for k in range(5)]  # five quarters waited for
    assert any("u5 held and waited for 5/4" in p for p in check(rows, entries + waited))
