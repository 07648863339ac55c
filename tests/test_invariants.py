"""The run-end check of tests/invariants.py catches each kind of thing left open, on a real
ledger (SQLite and PostgreSQL): a live allocation, a wait still waiting, and an end with no
reason given."""

from sqlalchemy import create_engine, update

from spawner.ledger import Ledger
from spawner.ledger.models import Allocation
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu

from .invariants import check_invariants, history, unfinished


def test_unfinished_names_what_a_run_left_open(db_url):
    led = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=1)))
    led.sync_inventory([Gpu("n1", 0, "A100")])
    try:
        a = led.allocate("alice", [], 1)
        got = led.request("bob", [], 1)
        assert got.entry is not None
        assert unfinished(db_url) == [
            f"allocation {a.id} of alice is still starting",
            f"wait {got.entry.id} of bob is still waiting",
        ]
        led.release(a.id, "server stopped")
        led.leave_queue(got.entry.id, "the server was stopped while it waited")
        assert unfinished(db_url) == []
        # an end nobody was told the reason of
        eng = create_engine(db_url)
        with eng.begin() as conn:
            conn.execute(update(Allocation).where(Allocation.id == a.id).values(end_reason=""))
        eng.dispose()
        assert unfinished(db_url) == [f"allocation {a.id} of alice ended (released) with no reason given"]
        # and the history's invariants hold for what happened: one holder, within the limit
        assert check_invariants(*history(db_url), limits=lambda user: (1, 0)) == []
        assert check_invariants(*history(db_url), limits=lambda user: (0, 0)) == [
            "alice held 1 GPUs, over their limit of 0",
            "alice held and waited for 1 GPUs, over their limit of 0",
            "bob held and waited for 1 GPUs, over their limit of 0",
        ]
    finally:
        led.close()


def test_a_slurm_allocation_holds_its_gpus_from_when_slurm_placed_its_job(db_url):
    """Submitted while another job ran on the one GPU, placed there once it ended: one holder
    at a time. Placed before the other's end (forged): two."""
    led = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=1)))
    led.sync_inventory([Gpu("n1", 0, "A100")])
    try:
        first = led.allocate("alice", [], 1, deferred=True, backend="slurm")
        led.record_gpus(first.id, [("n1", 0)], "5")
        second = led.allocate("bob", [], 1, deferred=True, backend="slurm")  # pending in Slurm
        led.release(first.id, "Slurm job 5 ended (cancelled)")
        led.record_gpus(second.id, [("n1", 0)], "6")
        led.release(second.id, "Slurm job 6 ended (completed)")
        assert check_invariants(*history(db_url), limits=lambda user: (1, 0)) == []
        alice = led.get(first.id)
        meanwhile = alice.started + (alice.ended - alice.started) / 2
        eng = create_engine(db_url)
        with eng.begin() as conn:  # bob's job started while alice's still held the GPU
            conn.execute(update(Allocation).where(Allocation.id == second.id).values(started=meanwhile))
        eng.dispose()
        assert check_invariants(*history(db_url), limits=lambda user: (1, 0)) == [
            f"GPU 1 held by {first.id} and {second.id} at once"
        ]
    finally:
        led.close()
