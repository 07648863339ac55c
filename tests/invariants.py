"""The ledger's invariants, checked over its whole history after (or while) a run: the stress
tests' processes (``tests/test_stress.py``), a class-start storm through a real hub
(``tests/test_storm.py``). Each check returns the problems it found, empty when the ledger never
broke the rule; forged histories in ``tests/test_stress.py`` prove each check catches its kind.

- :func:`check_invariants`: no GPU held by two allocations at once; no user over their limit,
  held or held and waited for, except within a borrowing allowance while nobody waited.
- :func:`unfinished`: after a run that stopped everything, every allocation and every wait has
  ended, each with the reason its user was given.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime

from sqlalchemy import case, func, select

from spawner.ledger.db import make_engine
from spawner.ledger.models import Allocation, AllocationGpu, QueueEntry

FOREVER = datetime.max  # the end of what has not ended
# a user's limit (None: none) and borrowing allowance
Limits = Callable[[str], tuple[int | None, int]]


def read(url: str, *queries):
    """The rows of each query, all from one snapshot of the ledger (its reader's transaction),
    times as datetimes on every database."""
    engine = make_engine(url, writer=False)
    try:
        with engine.begin() as conn:
            return [conn.execute(q).all() for q in queries]
    finally:
        engine.dispose()


A, AG, E = Allocation, AllocationGpu, QueueEntry


def history(url: str):
    """Each allocation's GPUs with the span it held them, and each wait. A local allocation
    holds its GPUs from its creation (booked then); a Slurm one from its start, when Slurm
    placed the job and the watcher wrote the GPUs Slurm gave it (it was created when the job
    was submitted, and waited in Slurm's queue holding nothing)."""
    held_from = case((A.backend == "slurm", func.coalesce(A.started, A.created)), else_=A.created)
    return read(
        url,
        select(A.id, A.user, held_from, A.ended, A.state, AG.gpu_id, AG.held, A.borrowed).join(
            AG, AG.allocation_id == A.id
        ),
        select(E.id, E.user, E.gpu_count, E.created, E.ended),
    )


def ends(url: str):
    """Each allocation's and each queue entry's end: (kind, id, user, state, end_reason)."""
    allocations, entries = read(
        url,
        select(A.id, A.user, A.state, A.end_reason),
        select(E.id, E.user, E.state, E.end_reason),
    )
    return [("allocation", *r) for r in allocations] + [("wait", *r) for r in entries]


def unfinished(url: str) -> list[str]:
    """What a run that stopped everything left open: an allocation not released, a wait still
    waiting, or either ended without a reason."""
    problems = []
    for kind, i, user, state, reason in ends(url):
        if state in ("starting", "running", "waiting"):
            problems.append(f"{kind} {i} of {user} is still {state}")
        elif not (reason or "").strip():
            problems.append(f"{kind} {i} of {user} ended ({state}) with no reason given")
    return problems


def check_invariants(rows, entries=(), *, limits: Limits) -> list[str]:
    """Replay the history: problems found, empty when the ledger never broke a rule.

    Nobody is ever over their limit, with one exception: GPUs beyond it up to the user's
    borrowing allowance, by allocations marked borrowed (at least as many marks as GPUs
    beyond the limit), each admitted while nobody waited in the queue."""
    problems = []
    per_gpu = defaultdict(list)
    allocs = {}
    for aid, user, created, ended, state, gpu_id, held, borrowed in rows:
        end = ended or FOREVER
        per_gpu[gpu_id].append((created, end, aid))
        allocs.setdefault(aid, [user, created, end, 0, borrowed or 0])[3] += 1
        if (state == "released") == bool(held):
            problems.append(f"allocation {aid} is {state} but its GPU {gpu_id} held={held}")
    for gpu_id, spans in per_gpu.items():
        spans.sort()
        for (_s1, e1, a1), (s2, _e2, a2) in itertools.pairwise(spans):
            if s2 < e1:
                problems.append(f"GPU {gpu_id} held by {a1} and {a2} at once")
    # borrowing only while nobody waits: no entry waited at a borrowed admission's moment
    for aid, (user, created, _end, _n, borrowed) in sorted(allocs.items()):
        if borrowed:
            waited = [e for e in entries if e[3] < created and (e[4] is None or e[4] > created)]
            if waited:
                problems.append(
                    f"allocation {aid} ({user}) borrowed {borrowed} GPU(s) at {created} while "
                    f"{len(waited)} request(s) waited (entry {waited[0][0]})"
                )

    def replay(spans, what):
        events = sorted(
            [(c, 1, u, n, b) for u, c, _e, n, b in spans] + [(e, 0, u, n, b) for u, _c, e, n, b in spans]
        )
        count, marks = defaultdict(int), defaultdict(int)
        for _t, kind, user, n, b in events:  # at equal times ends (0) come before starts (1)
            count[user] += n if kind else -n
            marks[user] += b if kind else -b
            limit, allowance = limits(user)
            if limit is None or count[user] <= limit:
                continue
            lent = min(allowance, marks[user])  # what the exception allows
            if count[user] > limit + lent:
                extra = f" (borrowed {marks[user]} of an allowance of {allowance})" if marks[user] else ""
                problems.append(f"{user} {what} {count[user]} GPUs, over their limit of {limit}{extra}")

    held_spans = [(u, c, e, n, b) for u, c, e, n, b in allocs.values()]
    replay(held_spans, "held")
    # what a user waits for counts against their limit too: held + waiting never passes it
    waiting_spans = [(u, c, e or FOREVER, n, 0) for _id, u, n, c, e in entries]
    replay(held_spans + waiting_spans, "held and waited for")
    return problems
