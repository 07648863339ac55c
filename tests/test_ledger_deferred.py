"""The ledger's scheduler-placed (deferred) allocations, GPUs recorded later, and known users,
on SQLite and on PostgreSQL."""

import pytest

from spawner.ledger import Ledger
from spawner.policy.limits import Limit, LimitRules, Refusal
from spawner.policy.placement import Gpu

INV = [Gpu("n1", i, "A100") for i in range(4)] + [Gpu("n2", i, "A100") for i in range(2)]


@pytest.fixture
def ledger(db_url):
    rules = LimitRules(default=Limit(max_gpus=2), groups={"staff": Limit(max_gpus=None)})
    led = Ledger(db_url, config_rules=rules)
    led.sync_inventory(INV)
    yield led
    led.close()


def held(ledger):
    """GPU label -> id of the allocation holding it."""
    return {st.gpu.label: st.holder.id for st in ledger.gpu_table() if st.holder}


def queued(ledger, user="alice", count=2, groups=(), backend="slurm", **kw):
    return ledger.allocate(user, groups, count, deferred=True, backend=backend, **kw)


def test_deferred_is_admitted_within_the_limit_when_nothing_is_free(ledger):
    ledger.allocate("carol", ["staff"], 4)
    ledger.allocate("carol", ["staff"], 2)  # every GPU is held now
    with pytest.raises(Refusal) as err:
        ledger.allocate("alice", [], 1)
    assert err.value.reason == "no_capacity"
    a = queued(ledger)
    assert (a.state, a.gpus, a.gpu_count, a.started, a.backend) == ("starting", (), 2, None, "slurm")
    assert ledger.allowance("alice").held == 2 and len(held(ledger)) == 6
    with pytest.raises(Refusal) as err:  # the queued count holds the limit
        queued(ledger, count=1)
    assert err.value.reason == "over_limit"
    assert len(ledger.active(user="alice")) == 1


# fmt: off
@pytest.mark.parametrize("count, kw, reason", [
    (5, {}, "too_large"),  # one node holds at most 4
    (3, {"on_nodes": ["n2"]}, "too_large"),  # the partition's nodes hold 2
    (7, {"max_nodes": None}, "too_large"),  # the cluster holds 6
    (1, {"model": "H100"}, "unknown_model"),
    (4, {}, None), (2, {"on_nodes": ["n2"]}, None), (6, {"max_nodes": None}, None),
])
def test_deferred_is_bounded_by_what_the_nodes_could_ever_hold(ledger, count, kw, reason):
    ledger.allocate("carol", ["staff"], 6, max_nodes=None)  # nothing is free now
    if reason is None:
        assert queued(ledger, "dave", count, ["staff"], **kw).gpu_count == count
        assert ledger.allowance("dave", ["staff"]).held == count
        return
    with pytest.raises(Refusal) as err:
        queued(ledger, "dave", count, ["staff"], **kw)
    assert err.value.reason == reason and ledger.active(user="dave") == []
# fmt: on


def test_attach_job_and_record_gpus(ledger):
    a = queued(ledger)
    assert ledger.attach_job(a.id, 7).backend_job_id == "7"
    assert ledger.get(a.id).state == "starting"
    info, released = ledger.record_gpus(a.id, [("n1", 2), ("n1", 1)], "7")
    assert (info.state, [g.label for g in info.gpus], released) == ("running", ["n1:1", "n1:2"], [])
    assert info.started is not None and info.cuda_visible_devices == "1,2"
    again, released = ledger.record_gpus(a.id, [("n1", 1), ("n1", 2), ("n1", 1)], "7")  # idempotent
    assert (again.gpus, again.started, released) == (info.gpus, info.started, [])
    assert held(ledger) == {"n1:1": a.id, "n1:2": a.id}
    assert ledger.allowance("alice").held == 2
    with pytest.raises(RuntimeError, match="already holds other GPUs"):
        ledger.record_gpus(a.id, [("n1", 0), ("n1", 1)], "7")
    assert held(ledger) == {"n1:1": a.id, "n1:2": a.id}
    ledger.release(a.id)
    with pytest.raises(LookupError):
        ledger.attach_job(a.id, "8")
    with pytest.raises(LookupError):
        ledger.record_gpus(a.id, [("n1", 0)])


def test_record_gpus_refuses_gpus_the_ledger_does_not_know(ledger):
    a = queued(ledger)
    with pytest.raises(LookupError, match="n9:0"):
        ledger.record_gpus(a.id, [("n1", 0), ("n9", 0)], "7")
    got = ledger.get(a.id)
    assert (got.state, got.gpus, held(ledger)) == ("starting", (), {})


def test_record_gpus_releases_a_stale_holder_of_the_same_backend(ledger):
    old, _ = ledger.record_gpus(queued(ledger, "bob", 1).id, [("n1", 0)], "5")
    other, _ = ledger.record_gpus(queued(ledger, "bob", 1).id, [("n2", 1)], "6")
    a = queued(ledger)
    info, released = ledger.record_gpus(a.id, [("n1", 0), ("n1", 3)], "7")
    assert released == [old.id] and [g.label for g in info.gpus] == ["n1:0", "n1:3"]
    assert held(ledger) == {"n1:0": a.id, "n1:3": a.id, "n2:1": other.id}  # no double booking
    gone = ledger.get(old.id)
    assert gone.state == "released" and gone.end_reason == "its slurm job ended (GPUs given to job 7)"
    assert ledger.get(other.id).state == "running"


def test_record_gpus_refuses_gpus_another_backend_holds(ledger):
    local = ledger.allocate("bob", [], 2, on_nodes=["n2"])  # the local backend, n2:0-1
    a = queued(ledger)
    before = held(ledger)
    with pytest.raises(RuntimeError, match="two backends"):
        ledger.record_gpus(a.id, [("n1", 0), ("n2", 1)], "7")
    assert held(ledger) == before == {"n2:0": local.id, "n2:1": local.id}
    got = ledger.get(a.id)
    assert (got.state, got.gpus, got.backend_job_id) == ("starting", (), None)
    assert ledger.get(local.id).state == "starting"


def test_a_rejected_record_rolls_back_the_release_of_a_stale_holder(ledger):
    old, _ = ledger.record_gpus(queued(ledger, "bob", 1).id, [("n1", 0)], "5")
    a, _ = ledger.record_gpus(queued(ledger).id, [("n1", 1), ("n1", 2)], "6")
    with pytest.raises(RuntimeError, match="already holds other GPUs"):
        ledger.record_gpus(a.id, [("n1", 0), ("n1", 1)], "6")
    assert ledger.get(old.id).state == "running"
    assert held(ledger) == {"n1:0": old.id, "n1:1": a.id, "n1:2": a.id}


def test_released_with_jobs(ledger):
    a, b, c = (ledger.attach_job(queued(ledger, "bob", 1, ["staff"]).id, j) for j in "789")
    local = ledger.mark_running(ledger.allocate("dave", [], 1).id, "7")
    for x in (a, b, local):
        ledger.release(x.id, "lease expired")
    got = ledger.released_with_jobs("slurm", ["7", 8, 9, "10"])
    want = [(a.id, "7", "lease expired"), (b.id, "8", "lease expired")]  # c is live, local another backend
    assert sorted((x.id, x.backend_job_id, x.end_reason) for x in got) == want
    assert ledger.released_with_jobs("slurm", []) == []
    assert ledger.released_with_jobs("local", ["7"])[0].id == local.id
    assert ledger.get(c.id).state == "starting"


def test_note_user_and_effective_limits(ledger):
    ledger.note_user("alice", ["staff", "physics", "staff"])
    ledger.note_user("bob", [])
    ledger.set_limit("user", "bob", Limit(max_gpus=3))
    limits = ledger.effective_limits()
    assert sorted(limits) == ["alice", "bob"]
    assert (limits["alice"].limit.max_gpus, limits["alice"].source) == (None, "group staff")
    assert (limits["bob"].limit.max_gpus, limits["bob"].source) == (3, "user bob")
    only = ledger.effective_limits(["zed", "bob", "zed"])
    assert sorted(only) == ["bob", "zed"]
    assert (only["zed"].limit.max_gpus, only["zed"].source) == (2, "default")
    ledger.note_user("alice", ["physics"])  # groups change with the user
    assert ledger.effective_limits(["alice"])["alice"].source == "default"


def test_attach_job_is_once_and_a_job_belongs_to_one_allocation(db_url):
    led = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=8)))
    led.sync_inventory([Gpu("n1", i, "a100") for i in range(4)])
    a = led.allocate("alice", [], 1, deferred=True, backend="slurm")
    b = led.allocate("alice", [], 1, deferred=True, backend="slurm")
    assert led.attach_job(a.id, "7").backend_job_id == "7"
    assert led.attach_job(a.id, "7").backend_job_id == "7"  # the same again: fine
    with pytest.raises(ValueError, match="already runs as job 7"):
        led.attach_job(a.id, "8")
    with pytest.raises(ValueError, match=f"already allocation {a.id}'s"):
        led.attach_job(b.id, "7")
    assert led.get(b.id).backend_job_id is None
    led.release(a.id, "done")
    assert led.attach_job(b.id, "7").backend_job_id == "7"  # a released allocation's id is free
    with pytest.raises(LookupError):
        led.attach_job(a.id, "9")
    led.close()


def test_record_gpus_refuses_more_gpus_than_were_admitted(db_url):
    led = Ledger(db_url, config_rules=LimitRules(default=Limit(max_gpus=8)))
    led.sync_inventory([Gpu("n1", i, "a100") for i in range(4)])
    a = led.allocate("alice", [], 1, deferred=True, backend="slurm")
    with pytest.raises(ValueError, match="admitted for 1 GPUs; the job shows 2"):
        led.record_gpus(a.id, [("n1", 0), ("n1", 1)], "7")
    got = led.get(a.id)
    assert got.gpus == () and got.state == "starting"
    led.close()
