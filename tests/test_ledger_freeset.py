"""The free GPUs a ledger keeps from one write to the next (spawner/ledger/freeset.py) are
always what the database says, whoever wrote: on SQLite and on PostgreSQL."""

import random
from datetime import datetime

from sqlalchemy import select

from spawner.ledger import Ledger, freeset
from spawner.ledger.models import AllocationGpu, LedgerLock
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu

from .ledgertools import Clock

RULES = LimitRules(default=Limit(max_gpus=6))
INVENTORY = [Gpu(f"n{n}", i, "A100") for n in range(4) for i in range(4)]


def truth(ledger: Ledger) -> list[Gpu]:
    """The free GPUs read from the database in a new transaction, without any kept state."""
    with ledger._read() as s:
        held = set(s.scalars(select(AllocationGpu.gpu_id).where(AllocationGpu.held)))
        present = ledger._present(s)
        return [g for g, i in zip(present.gpus, present.ids, strict=True) if i not in held]


def kept(ledger: Ledger) -> list[Gpu]:
    """What a writing transaction of ``ledger`` would place on."""
    with ledger._tx() as s:
        s.info["changed"] = False
        return list(ledger._free(s))


def test_two_processes_writing_in_turn_never_place_on_a_kept_but_taken_gpu(db_url):
    a = Ledger(db_url, config_rules=RULES)
    a.sync_inventory(INVENTORY)
    b = Ledger(db_url, config_rules=RULES)  # another process: a ledger of its own
    rnd = random.Random(3)
    live: list[tuple[Ledger, int]] = []
    for step in range(120):
        who = a if rnd.random() < 0.6 else b
        if live and (rnd.random() < 0.45 or len(live) > 6):
            _booker, aid = live.pop(rnd.randrange(len(live)))
            who.release(aid)  # either may release what either booked
        else:
            got = who.request(f"u{step}", [], rnd.choice((1, 2, 3)))
            if got.allocation is None:
                who.leave_queue(got.entry.id)
            else:
                live.append((who, got.allocation.id))
        if rnd.random() < 0.1:
            a.sync_inventory(INVENTORY[: 12 + rnd.randrange(5)])  # nodes leave and come back
        for ledger in (a, b):
            assert kept(ledger) == truth(ledger), f"step {step}"
    held = [g for _, aid in live for g in a.get(aid).gpus]
    assert len(held) == len(set(held))  # and no GPU was given twice
    a.close()
    b.close()


def test_a_write_that_moves_no_gpu_keeps_the_free_gpus_and_a_release_gives_them_back(db_url):
    ledger = Ledger(db_url, config_rules=RULES)
    ledger.sync_inventory(INVENTORY)
    got = ledger.allocate("alice", [], 3)
    before = kept(ledger)
    ledger.set_limit("user", "bob", Limit(max_gpus=2))  # a write: the generation moves
    assert kept(ledger) == before == truth(ledger)
    assert set(got.gpus).isdisjoint(before)
    ledger.release(got.id)
    assert kept(ledger) == INVENTORY == truth(ledger)
    ledger.close()


def test_a_lease_that_runs_out_during_a_waiters_keepalive_moves_the_generation(db_url):
    clock = Clock(datetime(2026, 12, 1, 9))
    a = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=12)), clock=clock)
    a.sync_inventory(INVENTORY)
    b = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=12)), clock=clock)
    a.allocate("alice", [], 12, max_nodes=None)
    a.allocate("bob", [], 2, lease_seconds=10)
    entry = a.request("carol", [], 6, max_nodes=None).entry  # 2 free, 4 when bob's lease ends
    assert entry is not None
    seen = kept(b)  # b keeps the free GPUs at this generation
    clock.advance(seconds=20)
    with a._read() as s:
        before = a._generation(s)
    assert a.wait_turn(entry.id).allocation is None  # still waits; bob's lease ended meanwhile
    with a._read() as s:
        assert a._generation(s) == before + 1
    assert len(kept(b)) == len(seen) + 2 == len(truth(b))
    a.close()
    b.close()


def test_when_the_moves_it_missed_are_no_longer_kept_a_ledger_reads_the_held_gpus_again(db_url, monkeypatch):
    monkeypatch.setattr(freeset, "KEEP_GENERATIONS", 3)
    monkeypatch.setattr(freeset, "PRUNE_EVERY", 2)
    a = Ledger(db_url, config_rules=RULES)
    a.sync_inventory(INVENTORY)
    b = Ledger(db_url, config_rules=RULES)
    assert kept(b) == INVENTORY  # b keeps the free GPUs now
    live = [a.allocate(f"u{k}", [], 2).id for k in range(4)]  # then misses 4 writes...
    a.release(live.pop(0))
    with a._read() as s:  # ...whose moves are partly pruned already
        assert s.scalar(select(LedgerLock.moves_after)) > 0
    assert kept(b) == truth(b) == kept(a)
    assert len(truth(b)) == len(INVENTORY) - 6
    a.close()
    b.close()
