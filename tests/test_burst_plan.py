"""Bursts and resizing for ``%%distributed``: the rules as tables (``gpu_magics.kernel.acquire``), the
``Burst`` lifecycle and the magic's order of steps against a fake broker and fake engines
(what is asked, what is stopped, and when). Real engines on a real hub: test_distributed_hub."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError

from gpu_magics.common.ranks import Slot
from gpu_magics.engine.namespace import user_names
from gpu_magics.kernel import burst as burstmod
from gpu_magics.kernel import distributed as magicsmod
from gpu_magics.kernel import lifecycle as lifecyclemod
from gpu_magics.kernel import preemption as preemptionmod
from gpu_magics.kernel.acquire import (
    OTHER_SETTINGS,
    GpuPlan,
    kept_settings,
    may_retry_after_release,
    plan_gpus,
    refuse_discard,
    why_new_engines,
)
from gpu_magics.kernel.broker import BrokerError
from gpu_magics.kernel.burst import Burst, burst_size

# ------------------------------------------------------------------------------ the plans


@pytest.mark.parametrize(
    "own, wanted, slots, burst, node",
    [
        (["n:0", "n:1"], 2, ["n:0", "n:1"], 0, None),  # the server's own, nothing asked
        (["n:1", "n:0"], 1, ["n:0"], 0, None),  # lowest first
        (["n:0", "n:1"], 3, ["n:0", "n:1"], 1, "n"),  # 2 own + 1 burst on the same node
        (["n:2"], 2, ["n:2"], 1, "n"),  # a 1-GPU server: its GPU + 1 burst GPU
        ([], 2, [], 2, None),  # no own GPUs: all burst, any one node
        (["a:0", "b:0", "b:1"], 4, ["b:0", "b:1"], 2, "b"),  # the node with most of them
        (["a:0", "b:0"], 1, ["a:0"], 0, None),
    ],
)
def test_plan_gpus(own, wanted, slots, burst, node):
    plan = plan_gpus(own, wanted)
    assert plan == GpuPlan(tuple(Slot.parse(s) for s in slots), burst, node)
    assert plan.total == wanted


@pytest.mark.parametrize(
    "has_pool, same, broken, lost, restart, why",
    [
        (False, False, False, False, False, None),  # no pool: one starts, nothing to say
        (True, True, False, False, False, None),  # the warm pool runs the cell
        (True, False, False, False, False, OTHER_SETTINGS),
        (True, True, False, False, True, "the cell asked for --restart"),
        (True, True, True, False, False, "the pool was left broken by the last cell"),
        (True, False, True, True, False, "the pool lost its burst allocation"),
    ],
)
def test_why_new_engines(has_pool, same, broken, lost, restart, why):
    got = why_new_engines(
        has_pool=has_pool, same_settings=same, broken=broken, lease_lost=lost, restart=restart
    )
    assert got == why


@pytest.mark.parametrize(
    "why, names, restart, autosave, refused",
    [
        (OTHER_SETTINGS, ["model", "opt"], False, False, "the pool holds your variables (model, opt)"),
        (OTHER_SETTINGS, None, False, False, "the pool may hold your variables"),
        (OTHER_SETTINGS, [], False, False, None),  # nothing of the user's: it just goes
        (OTHER_SETTINGS, ["model"], True, False, None),  # --restart
        (OTHER_SETTINGS, ["model"], False, True, None),  # autosave carries them over
        ("the pool was left broken by the last cell", ["model"], False, False, None),
        ("the pool lost its burst allocation", ["model"], False, False, None),
    ],
)
def test_refuse_discard(why, names, restart, autosave, refused):
    text = refuse_discard(
        why, names, restart=restart, autosave=autosave, current="--gpus 2 --timeout 300", asked="--gpus 3"
    )
    if refused is None:
        assert text is None
    else:
        assert refused in text
        assert "%%distributed --gpus 3 needs new engines (the pool runs --gpus 2 --timeout 300)" in text
        assert "run the cell with --restart to discard them" in text.lower()
        assert "--autosave NAME... to carry them over" in text and "nothing was changed" in text


def test_refuse_discard_shortens_a_long_list():
    text = refuse_discard(
        OTHER_SETTINGS, [f"v{i}" for i in range(11)], restart=False, autosave=False, current="a", asked="b"
    )
    assert "v0, v1, v2, v3, v4, v5, v6, v7, and 3 more" in text


@pytest.mark.parametrize(
    "reason, fits, old, need, retry",
    [
        ("over_limit", 0, 1, 1, True),  # limit 3, 2 own + 1 burst, asking 1 anew: the old one's
        ("over_limit", 0, 1, 2, False),  # beyond the limit even without the old burst
        ("no_capacity", 1, 2, 3, True),
        ("too_large", 2, 2, 3, False),  # more than could ever fit: never
        ("quota_exhausted", 0, 2, 1, False),
        ("over_limit", 0, 0, 1, False),  # no old burst to release
        ("over_limit", None, 2, 1, False),
    ],
)
def test_may_retry_after_release(reason, fits, old, need, retry):
    assert may_retry_after_release(reason, fits, old, need) is retry


def test_user_names_leave_out_setup_ipython_modules_and_private_names():
    import os

    hidden = {"In": [], "exit": object()}
    ns = {
        **hidden,
        "device": "cpu",
        "rank": 0,
        "world_size": 2,
        "local_rank": 0,
        "dist": object(),
        "torch": os,
        "os": os,
        "_i3": "x",
        "__builtins__": {},
        "model": object(),
        "opt": 1,
        "exit": "mine now",  # rebound by the user: theirs
    }
    assert user_names(ns, hidden) == ["exit", "model", "opt"]


def test_user_names_leave_out_what_was_imported_from_packages():
    from collections import OrderedDict as DDP  # a class imported under another name
    from json import dumps

    class Net:  # defined in a cell: the namespace's own module
        pass

    Net.__module__ = "__main__"

    def step():
        pass

    step.__module__ = "__main__"
    ns = {"__name__": "__main__", "DDP": DDP, "dumps": dumps, "p": print, "Net": Net, "step": step, "x": 1}
    assert user_names(ns, {}) == ["Net", "step", "x"]


@pytest.mark.parametrize(
    "settings, text",
    [
        ((2, None, None), "--gpus 2"),  # no --timeout typed: none quoted
        ((2, "gloo", 60.0), "--gpus 2 --backend gloo --timeout 60"),
        ((2, None, 300.0, None, None, 300.0), "--gpus 2 with the default timeout of 300 s"),
        ((2, None, 60.0, 2, 1, 300.0), "--gpus 2 --nodes 2 --gpus-per-node 1 --timeout 60"),
    ],
)
def test_describe_settings_quotes_only_what_was_typed(settings, text):
    from gpu_magics.kernel.acquire import describe_settings

    assert describe_settings(*settings[:5], **({"default": settings[5]} if len(settings) > 5 else {})) == text


DUE = 1764747998.0  # 2025-12-03 07:46:38 UTC
HUB = (
    "preempted: 1 borrowed GPU(s) taken back for another user's request within its limit "
    "(2 GPU(s), waiting since 07:45 UTC)"
)
BACKFILL = (
    "preempted: 2 GPU(s) that started ahead of a waiting request (backfill) taken back at its turn "
    "(1 GPU(s), waiting since 07:45 UTC)"
)
# the hub's reason as it is written now (spawner.policy.borrowing.notice_reason)
HUB_NOW = (
    "preempted: 1 borrowed GPU taken back for another user's request within its limit "
    "(2 GPUs, waiting since 07:45 UTC)"
)


@pytest.mark.parametrize(
    "borrowed, size, reason, text",
    [
        (
            1,
            1,
            HUB,
            "1 borrowed GPU of this pool (allocation #5) is taken back at 07:46:38 UTC for another "
            "user's request within its limit (2 GPUs, waiting since 07:45 UTC).",
        ),
        (
            1,
            1,
            HUB_NOW,
            "1 borrowed GPU of this pool (allocation #5) is taken back at 07:46:38 UTC for another "
            "user's request within its limit (2 GPUs, waiting since 07:45 UTC).",
        ),
        (  # the hub's reason once it says only why
            2,
            3,
            "for another user's request within its limit (1 GPU, waiting since 07:45 UTC)",
            "2 borrowed GPUs of this pool (allocation #5) are taken back at 07:46:38 UTC for another "
            "user's request within its limit (1 GPU, waiting since 07:45 UTC).",
        ),
        (
            0,
            2,
            BACKFILL,
            "2 GPUs of this pool that started ahead of the queue (allocation #5) are taken back at "
            "07:46:38 UTC at the turn of the request they started ahead of (1 GPU, waiting since 07:45 UTC).",
        ),
        (1, 1, "preempted", "1 borrowed GPU of this pool (allocation #5) is taken back at 07:46:38 UTC."),
    ],
)
def test_a_preemption_notice_says_what_when_and_why_once(borrowed, size, reason, text):
    from gpu_magics.kernel.notices import taken, taken_back

    said = taken_back(taken(borrowed, size), borrowed or size, 5, DUE, reason, "of this pool")
    assert said == text
    assert "GPU(s)" not in said and " in " not in said.split("UTC")[0]  # no stale "(in 54 s)"


@pytest.mark.parametrize(
    "labels, own, bursts, text",
    [
        (["vm:0", "vm:1"], ["vm:0", "vm:1"], [], "2 engines up: rank 0 on vm:0, rank 1 on vm:1"),
        (
            ["vm:0", "vm:1", "vm:2"],
            ["vm:0", "vm:1"],
            [{"id": 5, "gpus": [{"node": "vm", "index": 2}], "gpu_count": 1, "borrowed": 1}],
            "3 engines up: rank 0 on vm:0, rank 1 on vm:1 (this server's own); rank 2 on vm:2 (burst "
            "allocation #5, borrowed beyond your limit: may be taken back with notice)",
        ),
        (
            ["vm:0", "vm:1", "vm:2"],
            ["vm:0"],
            [
                {"id": 5, "gpus": [{"node": "vm", "index": 1}], "gpu_count": 1, "borrowed": 0},
                {
                    "id": 6,
                    "gpus": [{"node": "vm", "index": 2}],
                    "gpu_count": 1,
                    "borrowed": 1,
                    "notice_seconds": 60,
                },
            ],
            "3 engines up: rank 0 on vm:0 (this server's own); rank 1 on vm:1 (burst allocation #5); "
            "rank 2 on vm:2 (burst allocation #6, borrowed beyond your limit: may be taken back "
            "with 60 s notice)",
        ),
        (
            ["n1:0", "n1:1"],
            [],
            [{"id": 7, "gpus": [], "gpu_count": 2, "borrowed": 1}],  # a Slurm burst: GPUs named later
            "2 engines up: rank 0 on n1:0, rank 1 on n1:1 (burst allocation #7, 1 of its 2 borrowed "
            "beyond your limit: may be taken back with notice)",
        ),
        (
            ["vm:0"],
            [],
            [{"id": 8, "gpus": [{"node": "vm", "index": 0}], "gpu_count": 1, "backfill": True}],
            "1 engine up: rank 0 on vm:0 (burst allocation #8, started ahead of the queue: may be taken "
            "back with notice at its turn)",
        ),
    ],
)
def test_engines_up_says_where_each_gpu_comes_from(labels, own, bursts, text):
    from gpu_magics.kernel.notices import engines_up

    assert engines_up(labels, own, bursts) == text


# ------------------------------------------------------------------------------ the Burst


class FakeBroker:
    def __init__(self, refuse: BrokerError | None = None, release_fails: bool = False, lost: bool = False):
        self.refuse, self.release_fails, self.lost, self.calls = refuse, release_fails, lost, []
        self.next_id = 10
        self.free = [("n", 2), ("n", 3)]

    def request(self, gpus, nodes, gpus_per_node, lease_seconds, node=None, wait=False):
        self.calls.append(("request", gpus, nodes, node))
        if callable(self.refuse):
            err = self.refuse(gpus)
            if err:
                raise err
        elif self.refuse:
            raise self.refuse
        self.next_id += 1
        taken, self.free = self.free[:gpus], self.free[gpus:]
        return {
            "id": self.next_id,
            "gpus": [{"node": n, "index": i} for n, i in taken],
            "gpu_count": gpus,
            "lease_expires": "2030-01-01T00:00:00Z",
        }

    def renew(self, allocation_id, lease_seconds, *more):
        if self.lost:
            raise BrokerError(404, "gone")
        return {"lease_expires": "2030-01-01T00:05:00Z"}

    def get(self, allocation_id):
        return {"end_reason": "reclaimed: idle"}

    def attach_job(self, allocation_id, job_id):
        return {"backend_job_id": job_id}

    def release(self, allocation_id):
        self.calls.append(("release", allocation_id))
        if self.release_fails:
            raise BrokerError(0, "The gpuhub broker cannot be reached")

    def made(self, kind):
        return [c for c in self.calls if c[0] == kind]


@pytest.fixture
def broker(monkeypatch):
    def install(**kw) -> FakeBroker:
        fake = FakeBroker(**kw)
        monkeypatch.setattr(burstmod.BrokerClient, "from_env", classmethod(lambda cls, environ=None: fake))
        return fake

    return install


def test_a_burst_is_requested_renewed_and_released_once(broker):
    fake = broker()
    said = []
    b = Burst.request("%%distributed", 1, lease_seconds=30, node="n", held=2, wanted=3, log=said.append)
    assert fake.calls == [("request", 1, 1, "n")]
    assert b.id == 11 and b.size == 1 and b.slots == [Slot("n", 2)] and not b.lost
    b.attach_job("123")
    assert b.allocation["backend_job_id"] == "123"
    assert b.release() is True and b.release() is False  # idempotent
    assert fake.made("release") == [("release", 11)] and said == []
    assert b.lease._stop.is_set()


def test_a_failed_release_is_reported(broker):
    broker(release_fails=True)
    said = []
    b = Burst.request("%dask_cuda", 1, lease_seconds=30, log=said.append)
    b.release()
    assert len(said) == 1 and "could not release allocation 11" in said[0] and "cannot be reached" in said[0]


@pytest.mark.parametrize(
    "held, gpus, wanted, message",
    [
        (0, 3, 3, "gpuhub refused 3 GPUs for %%distributed: at most 2 more"),
        (
            2,
            3,
            5,
            "gpuhub refused 3 more GPUs for %%distributed --gpus 5 (beside this server's 2): at most 2 more"
            " In this cell that is %%distributed --gpus 4 or fewer.",
        ),
        (1, 2, 2, "gpuhub refused 2 GPUs for %%distributed: at most 2 more Own server GPUs: 1."),
    ],
)
def test_a_refusal_is_a_usage_error_with_the_brokers_message(broker, held, gpus, wanted, message):
    broker(refuse=BrokerError(403, "at most 2 more", "over_limit", 2))
    with pytest.raises(UsageError) as e:
        Burst.request("%%distributed", gpus, lease_seconds=30, held=held, wanted=wanted)
    assert str(e.value) == message
    assert e.value.refusal.reason == "over_limit" and e.value.refusal.fits == 2


def test_without_a_broker_the_message_says_what_the_server_holds(monkeypatch):
    monkeypatch.setattr(burstmod.BrokerClient, "from_env", classmethod(lambda cls, environ=None: None))
    with pytest.raises(
        UsageError, match="needs 3 GPUs; this server holds 2 and no gpuhub broker is configured"
    ):
        Burst.request("%%distributed", 1, lease_seconds=30, held=2, wanted=3)


def test_a_lost_burst_is_noticed_with_the_hubs_reason(broker):
    from .hubtools import wait_for

    broker(lost=True)
    b = Burst.request("%dask_cuda", 1, lease_seconds=0.3, log=None)
    seen = []
    b.watch(seen.append, 0.05)
    wait_for(lambda: seen, 10, "the loss to be noticed")
    assert seen == [b] and b.lost and b.reason == "reclaimed: idle"
    b.release()


def test_burst_size_counts_what_was_admitted():
    assert burst_size({"gpu_count": 8, "gpus": []}) == 8  # a Slurm burst before its job runs
    assert burst_size({"gpus": [{}, {}]}) == 2


# ------------------------------------------------ the magic's order of steps, fake engines


class FakePool:
    made: list = []

    def __init__(self, specs, backend, timeout, launcher=None, n=0):
        self.specs, self.backend, self.timeout = specs, backend, timeout
        self.broken, self.stopped, self.report_allocation = False, False, 0
        self.names = []
        self.view = SimpleNamespace(
            apply_async=lambda f: SimpleNamespace(get=lambda timeout: [self.names] * 2)
        )
        self.pids = [1000 + len(FakePool.made), 2000 + len(FakePool.made)]
        FakePool.made.append(self)

    @property
    def size(self):
        return len(self.specs)

    def start(self, progress):
        progress(self.size, self.size)

    def stop(self, graceful=True):
        self.stopped = True
        self.graceful = graceful  # False only at the kernel's exit


@pytest.fixture
def magic(monkeypatch):
    monkeypatch.setenv("GPUHUB_GPUS", "n:0,n:1")
    monkeypatch.delenv("GPUHUB_BACKEND", raising=False)
    monkeypatch.setattr(lifecyclemod, "EnginePool", FakePool)
    monkeypatch.setattr(lifecyclemod, "display", lambda *a, **k: SimpleNamespace(display_id="x"))
    monkeypatch.setattr(lifecyclemod, "update_display", lambda *a, **k: None)
    FakePool.made = []
    m = magicsmod.DistributedMagics(shell=None)
    m.lease_seconds = 30
    m.resize_in_place = False  # the steps of a restart (fake engines cannot grow: tests/test_grow.py)
    yield m
    m.shutdown()


def args(gpus, restart=False, backend=None):
    return SimpleNamespace(
        gpus=gpus, nodes=None, gpus_per_node=None, backend=backend, timeout=60, restart=restart
    )


def ensure(m, a):
    pool = m.lifecycle.ensure(a)
    m.busy -= 1
    return pool


def labels(pool):
    return [s.slot.label for s in pool.specs]


def over_limit_beyond(room):
    """The broker of alice (limit 3) on a 2-GPU server: ``room`` more fit now."""

    def refuse(gpus):
        if gpus > room:
            return BrokerError(
                403, f"you hold 2 of a limit of 3: at most {room} more would fit now.", "over_limit", room
            )
        return None

    return refuse


def test_beyond_the_servers_gpus_only_the_difference_is_asked_for(magic, broker):
    fake = broker()
    pool = ensure(magic, args(3))
    assert fake.calls == [("request", 1, 1, "n")]
    assert labels(pool) == ["n:0", "n:1", "n:2"]
    assert magic.burst.id == 11 and pool.report_allocation == 0  # the kernel reports the burst
    same = ensure(magic, args(3))
    assert same is pool and len(fake.calls) == 1  # warm: nothing asked again


def test_a_refused_growth_in_place_stops_nothing(magic, broker):
    magic.resize_in_place = True  # refused before anything of the pool is touched
    fake = broker(refuse=over_limit_beyond(1))
    pool = ensure(magic, args(3))
    with pytest.raises(
        UsageError,
        match=r"refused 2 more GPUs for %%distributed --gpus 5 \(beside the pool's 3\): .* "
        r"In this cell that is %%distributed --gpus 4 or fewer",
    ):
        ensure(magic, args(5))
    assert magic.pool is pool and not pool.stopped and magic.burst.id == 11
    assert fake.made("release") == []


def test_a_refused_resize_stops_nothing(magic, broker):
    fake = broker(refuse=over_limit_beyond(1))
    pool = ensure(magic, args(3))
    with pytest.raises(
        UsageError, match=r"refused 3 more GPUs for %%distributed --gpus 5 \(beside this server's 2\)"
    ):
        ensure(magic, args(5))
    assert magic.pool is pool and not pool.stopped and magic.burst.id == 11
    assert fake.made("release") == []


def test_a_resize_that_would_discard_variables_is_refused_before_anything(magic, broker):
    fake = broker()
    pool = ensure(magic, args(2))
    pool.names = ["model", "opt"]
    with pytest.raises(UsageError) as e:
        ensure(magic, args(3))
    assert "the pool holds your variables (model, opt)" in str(e.value) and "--restart" in str(e.value)
    assert magic.pool is pool and not pool.stopped and fake.calls == []  # not even the broker asked
    with pytest.raises(UsageError, match="holds your variables"):
        ensure(magic, args(2, backend="gloo"))  # other settings, same size
    new = ensure(magic, args(3, restart=True))
    assert pool.stopped and labels(new) == ["n:0", "n:1", "n:2"]


def test_autosave_saves_before_the_stop_and_restores_after(magic, broker):
    broker()
    pool = ensure(magic, args(2))
    pool.names = ["model"]
    steps = []
    magic.autosave = ["model"]
    magic._save_before_stop = lambda why, full=True: steps.append(("save", why, pool.stopped))
    magic._restore_after_resize = lambda: steps.append(("restore", magic.pool is not pool))
    ensure(magic, args(3))
    # saved for the resize while the old pool still ran (a stop may ask again: saved once),
    # restored once the new pool is up
    assert steps[0] == ("save", "resize", False) and steps[-1] == ("restore", True)


def test_a_failed_autosave_keeps_the_pool_and_gives_the_new_burst_back(magic, broker):
    fake = broker()
    pool = ensure(magic, args(2))
    pool.names = ["model"]
    magic.autosave = ["model"]

    def fail(why, full=True):
        raise UsageError("cannot save model")

    magic._save_before_stop = fail
    with pytest.raises(UsageError, match="cannot save model"):
        ensure(magic, args(3))
    assert magic.pool is pool and not pool.stopped and fake.made("release") == [("release", 11)]


def test_shrinking_to_the_servers_gpus_releases_the_burst(magic, broker):
    fake = broker()
    ensure(magic, args(3))
    pool = ensure(magic, args(1))
    assert labels(pool) == ["n:0"] and magic.burst is None and fake.made("release") == [("release", 11)]


def test_the_pools_own_burst_in_the_way_is_released_then_asked_again(magic, broker, monkeypatch):
    monkeypatch.setenv("GPUHUB_GPUS", "")
    fake = broker()
    first = ensure(magic, args(1))
    assert labels(first) == ["n:2"]
    fake.free = [("n", 2), ("n", 3)]  # the old burst's GPU comes back once released
    fake.refuse = lambda gpus: (
        BrokerError(403, "at most 1 more", "over_limit", 1) if not fake.made("release") else None
    )
    pool = ensure(magic, args(2))
    assert first.stopped and fake.made("release") == [("release", 11)]
    assert [c[:2] for c in fake.made("request")] == [("request", 1), ("request", 2), ("request", 2)]
    assert labels(pool) == ["n:2", "n:3"]


# preemption notices that are withdrawn (issue 27) ------------------------------------------

NOTICE = {"due": "2026-12-03T12:00:00Z", "reason": "preempted: 2 borrowed GPU(s) taken back"}
LATER = {"due": "2026-12-03T12:09:00Z", "reason": "preempted: 2 borrowed GPU(s) taken back"}
GONE = {"at": "2026-12-03T11:58:00Z", "reason": "withdrawn: the request it was for left the queue"}


@pytest.mark.parametrize(
    "answers, told",
    [
        ([{"preemption": NOTICE}], [NOTICE]),
        ([{"preemption": NOTICE}, {"preemption": NOTICE}], [NOTICE]),  # once per notice
        # withdrawn (the ledger's row says so), then given again for another request
        (
            [
                {"preemption": NOTICE},
                {"preemption": None, "preemption_withdrawn": GONE},
                {"preemption": LATER},
            ],
            [NOTICE, {"withdrawn": GONE}, LATER],
        ),
        # a notice gone without the ledger saying it was withdrawn: nothing is said
        ([{"preemption": NOTICE}, {"preemption": None, "preemption_withdrawn": None}], [NOTICE]),
        # a withdrawal of a notice never seen: nothing to tell
        ([{"preemption": None, "preemption_withdrawn": GONE}], []),
        # released (taken back): not a withdrawal
        (
            [{"preemption": NOTICE}, {"state": "released", "preemption": None, "preemption_withdrawn": GONE}],
            [NOTICE],
        ),
        # the due time moved (a new notice after a withdrawal the keeper did not see)
        ([{"preemption": NOTICE}, {"preemption": LATER}], [NOTICE, LATER]),
    ],
)
def test_the_lease_keeper_passes_on_each_notice_and_withdrawal_once(answers, told):
    from gpu_magics.kernel.broker import LeaseKeeper

    seen = []
    keeper = LeaseKeeper(SimpleNamespace(), {"id": 7, "borrowed": 2}, 3600, on_notice=seen.append)
    try:
        for answer in answers:
            keeper._noticed({"state": "running", **answer})
    finally:
        keeper.stop()
    assert seen == told


def test_a_withdrawn_notice_is_forgotten_and_said(magic, capsys):
    part = SimpleNamespace(id=7, borrowed=2, size=2)
    other = SimpleNamespace(id=8, borrowed=0, size=1)
    due = preemptionmod.parse_due(NOTICE["due"])
    magic.preemption.notice = preemptionmod.Notice(part, NOTICE["reason"], due)
    magic.preemption.on_notice(other, {"withdrawn": GONE})  # another allocation's: this one stands
    assert magic.preemption.notice is not None and magic.preemption.notice.part is part
    magic.preemption.on_notice(part, {"withdrawn": GONE})
    assert magic.preemption.notice is None
    said = capsys.readouterr()
    assert (
        "gpuhub: the notice for 2 borrowed GPUs of this pool (allocation #7) was withdrawn: the "
        "request it was for left the queue. Nothing is taken back: the pool keeps them."
    ) in said.out + said.err


def test_a_notice_acted_on_is_not_withdrawn(magic):
    part = SimpleNamespace(id=7, borrowed=0, size=3)
    n = preemptionmod.Notice(part, "preempted", 0.0, acted=True)
    magic.preemption.notice = n
    magic.preemption.on_notice(part, {"withdrawn": GONE})
    assert magic.preemption.notice is n  # the pool was already stopped for it: nothing to undo
    assert preemptionmod._taken(part) == "3 GPUs that started ahead of the queue"


def test_gpus_says_a_notice_once_at_a_utc_time_and_a_reclaim_as_a_stamp():
    from gpu_magics.kernel.status import describe_use

    me = {
        "allocations": [
            {
                "id": 5,
                "purpose": "distributed",
                "borrowed": 1,
                "gpu_count": 1,
                "gpus": [{"node": "vm", "index": 2}],
                "preemption": {"due": "2025-12-03T07:46:38Z", "reason": HUB},
            }
        ],
        "reclaimed": [{"server_name": "", "created": "2025-12-03T07:30:00Z", "reason": "idle"}],
    }
    text = describe_use(me, {"gpus": []})
    assert (
        "  NOTICE: 1 borrowed GPU (allocation #5) is taken back at 07:46:38 UTC for another user's "
        "request within its limit (2 GPUs, waiting since 07:45 UTC)." in text
    ), text
    assert "Your server was reclaimed at 2025-12-03 07:30:00 UTC: idle." in text
    assert "GPU(s)" not in text and "T07" not in text


KEY = ((3, None, None), "gloo", 60.0)  # a pool of 3 GPUs, gloo, a 60 s timeout
POOL = {"gpus": 3, "nodes": None, "gpus_per_node": None, "backend": "gloo", "timeout": 60.0}


@pytest.mark.parametrize(
    "typed, key, kept",
    [
        ({}, KEY, POOL),
        ({"gpus": None, "timeout": None, "autosave": ["w"]}, KEY, POOL),  # autosave is no pool setting
        ({"timeout": 30.0}, KEY, None),  # a setting typed: the cell's settings decide
        ({"gpus": 3}, KEY, None),
        ({"backend": "nccl"}, KEY, None),
        ({}, None, None),  # no pool: the defaults
    ],
)
def test_a_bare_cell_keeps_the_warm_pools_settings(typed, key, kept):
    assert kept_settings(typed, key) == kept
