"""Slices that Slurm places (``gres/shard``, issue 34) in the ledger, on a real SQLite file and a
real PostgreSQL database: a deferred slice is admitted against the limit in shares and holds no
GPU until its job runs; ``record_gpus`` gives each the lowest free part of the GPU Slurm chose,
keeps the other slices of that GPU, and never records one GPU whole and in slices while the
other holder's job still runs (Slurm 22.05 gives a GPU twice: docs/known-issues.md)."""

from fractions import Fraction

import pytest

from spawner.ledger import GpuConflict, Ledger
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu
from spawner.policy.slices import check_gpu_slices

INV = [Gpu("n1", i, "A100") for i in range(2)]
OFFERS = check_gpu_slices({"A100": 4}, INV)
QUARTER = dict(model="A100", slice_parts=4, deferred=True, backend="slurm")


@pytest.fixture
def led(db_url):
    led = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=1)), slice_offers=OFFERS)
    led.sync_inventory(INV)
    yield led
    led.close()


def parts(led):
    """(GPU label, part) -> (user, job) of each held part; part 0 is a whole GPU."""
    out = {}
    for a in led.active():
        for g in a.gpus:
            out[(f"{g.node}:{g.index}", g.part)] = (a.user, a.backend_job_id)
    return out


def test_slurm_slices_share_a_gpu_each_on_its_own_part(led):
    users = ["alice", "bob", "carol", "dave"]
    got = [led.allocate(u, [], 1, **QUARTER) for u in users]
    assert all(a.gpus == () and a.state == "starting" for a in got)  # no GPU until the job runs
    assert led.allowance("alice").held == Fraction(1, 4)
    for n, a in enumerate(got):
        info, released = led.record_gpus(a.id, [("n1", 0)], str(100 + n), live_jobs=["100", "101", "102"])
        assert released == [] and info.state == "running" and info.gpus[0].part == n + 1
    assert parts(led) == {("n1:0", n + 1): (u, str(100 + n)) for n, u in enumerate(users)}
    again, _ = led.record_gpus(got[0].id, [("n1", 0)], "100")  # idempotent
    assert again.gpus[0].part == 1 and len(parts(led)) == 4


def test_a_slice_takes_the_part_of_a_job_that_ended_and_keeps_the_live_ones(led):
    got = [led.allocate(u, [], 1, **QUARTER) for u in ["alice", "bob", "carol", "dave"]]
    for n, a in enumerate(got):
        led.record_gpus(a.id, [("n1", 0)], str(100 + n))
    erin = led.allocate("erin", [], 1, **QUARTER)
    with pytest.raises(GpuConflict, match="all 4 of its parts are held by live jobs"):
        led.record_gpus(erin.id, [("n1", 0)], "200", live_jobs=["100", "101", "102", "103", "200"])
    assert len(parts(led)) == 4 and led.get(erin.id).gpus == ()  # nothing written
    # bob's job (101) ended unseen: erin gets its part, the other three keep theirs
    info, released = led.record_gpus(erin.id, [("n1", 0)], "200", live_jobs=["100", "102", "103", "200"])
    assert released == [got[1].id] and info.gpus[0].part == 2
    assert parts(led)[("n1:0", 2)] == ("erin", "200") and len(parts(led)) == 4


def test_a_whole_gpu_given_where_a_live_slice_is_held_is_a_conflict_and_writes_nothing(led):
    a = led.allocate("alice", [], 1, **QUARTER)
    led.record_gpus(a.id, [("n1", 1)], "100")
    whole = led.allocate("carol", [], 1, deferred=True, backend="slurm")
    for live in (None, ["100", "300"]):  # unknown, or known to run: never recorded over it
        with pytest.raises(
            GpuConflict,
            match="GPU n1:1 went to job 300; job 100 of alice holds a slice of it",
        ):
            led.record_gpus(whole.id, [("n1", 1)], "300", live_jobs=live)
        assert parts(led) == {("n1:1", 1): ("alice", "100")} and led.get(whole.id).state == "starting"
    # once alice's job is gone, Slurm's word stands: hers was stale
    _, released = led.record_gpus(whole.id, [("n1", 1)], "300", live_jobs=["300"])
    assert released == [a.id] and parts(led) == {("n1:1", 0): ("carol", "300")}


def test_a_slice_given_where_the_gpu_is_held_whole_by_a_live_job_is_a_conflict(led):
    whole = led.allocate("carol", [], 1, deferred=True, backend="slurm")
    led.record_gpus(whole.id, [("n1", 0)], "300")
    a = led.allocate("alice", [], 1, **QUARTER)
    with pytest.raises(GpuConflict, match="GPU n1:0 went to job 100; job 300 of carol holds it whole"):
        led.record_gpus(a.id, [("n1", 0)], "100", live_jobs=["100", "300"])
    assert parts(led) == {("n1:0", 0): ("carol", "300")}


def test_a_deferred_slice_counts_its_share_against_the_limit(led):
    for _ in range(4):
        led.allocate("alice", [], 1, server_name="", **QUARTER)
    with pytest.raises(Refusal) as err:  # four quarters are her limit of 1 GPU
        led.allocate("alice", [], 1, **QUARTER)
    assert err.value.reason == "over_limit" and "you hold 1 GPU" in err.value.message
    with pytest.raises(Refusal) as err:  # a whole GPU beside them too
        led.allocate("alice", [], 1, deferred=True, backend="slurm")
    assert err.value.reason == "over_limit"
    assert led.allowance("alice").held == 1


def test_a_slice_job_on_two_gpus_is_refused(led):
    a = led.allocate("alice", [], 1, **QUARTER)
    with pytest.raises(ValueError, match="admitted for 1 GPUs; the job shows 2"):
        led.record_gpus(a.id, [("n1", 0), ("n1", 1)], "100")
