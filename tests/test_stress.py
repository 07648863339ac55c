"""Several processes allocate and release at random against one ledger file.

The invariant checker reads the whole history back from the database and replays it:
no GPU is ever held by two allocations at the same moment, and no user ever holds more
than their limit. It also runs concurrently with the workers on live snapshots.
"""

import itertools
import multiprocessing as mp
import random
from collections import defaultdict

from sqlalchemy import create_engine, text

from spawner.ledger import Ledger
from spawner.policy import Gpu, Limit, LimitRules, Refusal, effective_limit

INV = [Gpu(f"n{n}", i, "A100") for n in range(3) for i in range(4)]
RULES = LimitRules(default=Limit(max_gpus=2), groups={"big": Limit(max_gpus=5)})
USERS = {f"u{i}": (["big"] if i % 3 == 0 else []) for i in range(8)}


def worker(url: str, seed: int, ops: int, results) -> None:
    rng = random.Random(seed)
    ledger = Ledger(url, config_rules=RULES)
    mine: list[int] = []
    granted = refused = 0
    for _ in range(ops):
        if mine and rng.random() < 0.45:
            ledger.release(mine.pop(rng.randrange(len(mine))), "stress")
            continue
        user = rng.choice(sorted(USERS))
        try:
            a = ledger.allocate(
                user,
                USERS[user],
                rng.randint(1, 4),
                max_nodes=rng.choice([1, None]),
                purpose=rng.choice(["server", "distributed"]),
            )
            if rng.random() < 0.5:
                ledger.mark_running(a.id, str(seed))
            mine.append(a.id)
            granted += 1
        except Refusal:
            refused += 1
    for a in mine[: len(mine) // 2]:  # leave some held at the end
        ledger.release(a, "stress end")
    ledger.close()
    results.put((granted, refused))


def history(url: str):
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT a.id, a.user, a.created, a.ended, a.state, ag.gpu_id, ag.held "
                "FROM allocations a JOIN allocation_gpus ag ON ag.allocation_id = a.id"
            )
        ).all()
    engine.dispose()
    return rows


def check_invariants(rows) -> list[str]:
    """Replay the history: problems found, empty when the ledger never broke a rule."""
    problems = []
    per_gpu = defaultdict(list)
    allocs = {}
    for aid, user, created, ended, state, gpu_id, held in rows:
        end = ended or "9999"
        per_gpu[gpu_id].append((created, end, aid))
        allocs.setdefault(aid, [user, created, end, 0, state, held])[3] += 1
        if (state == "released") == bool(held):
            problems.append(f"allocation {aid} is {state} but its GPU {gpu_id} held={held}")
    for gpu_id, spans in per_gpu.items():
        spans.sort()
        for (_s1, e1, a1), (s2, _e2, a2) in itertools.pairwise(spans):
            if s2 < e1:
                problems.append(f"GPU {gpu_id} held by {a1} and {a2} at once")
    events = sorted(
        [(c, 1, u, n) for u, c, _e, n, *_ in allocs.values()]
        + [(e, 0, u, n) for u, _c, e, n, *_ in allocs.values()]
    )
    holding = defaultdict(int)
    for _t, kind, user, n in events:  # at equal times releases (0) come before grants (1)
        holding[user] += n if kind else -n
        limit = effective_limit(user, USERS.get(user, []), RULES).limit.max_gpus
        if limit is not None and holding[user] > limit:
            problems.append(f"{user} held {holding[user]} GPUs, over their limit of {limit}")
    return problems


def test_concurrent_processes_never_double_book_or_exceed_limits(tmp_path):
    url = f"sqlite:///{tmp_path / 'stress.sqlite'}"
    Ledger(url, config_rules=RULES).sync_inventory(INV)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(url, seed, 120, results)) for seed in range(4)]
    for p in procs:
        p.start()
    live_problems = []
    while any(p.is_alive() for p in procs):
        live_problems += check_invariants(history(url))  # snapshots while they write
        for p in procs:
            p.join(timeout=0.2)
    assert all(p.exitcode == 0 for p in procs)
    granted, refused = map(sum, zip(*[results.get(timeout=10) for _ in procs], strict=True))
    assert granted > 50 and refused > 20, (granted, refused)  # both paths exercised
    assert live_problems == []
    assert check_invariants(history(url)) == []
    # the invariant checker itself catches a double booking and an over-limit user
    rows = history(url)
    _aid, _user, created, _ended, _state, gpu_id, _held = rows[0]
    forged = [(10**6, "u1", created, None, "running", gpu_id, 1)]
    forged += [(10**6 + k, "u1", created, None, "running", 10**6 + k, 1) for k in range(1, 3)]
    found = check_invariants(rows + forged)
    assert any("at once" in p for p in found) and any("over their limit" in p for p in found)
