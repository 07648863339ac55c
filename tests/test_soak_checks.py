"""The soak's own checks (``tests/soaktools.py``) catch each kind of thing they look for, on
forged runs: an answer no user should get, a killed server whose GPUs stayed held, something
left running, a researcher's lost step. (The ledger's kinds: ``tests/test_invariants.py``.)"""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from spawner.ledger import Ledger
from spawner.policy.limits import Limit, LimitRules
from spawner.policy.placement import Gpu

from .soaktools import SETTLE, Answer, Fault, Soak


def soak(url: str = "", faults=()) -> Soak:
    return Soak(SimpleNamespace(ledger_url=url), ["alice"], [], "bob", 60.0, faults=list(faults))


HUB_DOWN = Fault("hub", start=100.0, end=110.0)
BROKER_DOWN = Fault("broker", start=200.0, end=210.0)


@pytest.mark.parametrize(
    "answer, wrong",
    [
        (Answer(50.0, "alice", "start", 201, "{}"), False),
        (Answer(50.0, "alice", "start", 403, '{"message": "over your limit"}'), False),
        (Answer(50.0, "alice", "start", 403, ""), True),  # a refusal without its reason
        (Answer(105.0, "alice", "start", 500, "Internal Server Error"), False),  # JupyterHub stopping
        (Answer(105.0, "alice", "burst", 500, "Internal error", broker=True), True),  # the broker's: never
        (Answer(115.0, "alice", "start", 500, "Internal Server Error"), True),  # the hub is up again
        (Answer(105.0, "alice", "model", 503, "Service Unavailable"), False),  # the hub was down
        (Answer(105.0, "alice", "model", 0, "connection refused"), False),
        (Answer(110.0 + SETTLE - 1, "alice", "model", 502, "Bad Gateway"), False),  # settling
        (Answer(110.0 + SETTLE + 1, "alice", "model", 502, "Bad Gateway"), True),  # after it
        (Answer(50.0, "alice", "model", 0, "connection refused"), True),  # no fault then
        (Answer(50.0, "alice", "burst", 507, "Insufficient Storage"), True),
        (Answer(205.0, "alice", "model", 500, "Internal Server Error"), True),  # only the hub's own stop
    ],
)
def test_an_answer_no_user_should_get_is_a_problem(answer, wrong):
    assert soak(faults=[HUB_DOWN, BROKER_DOWN]).wrong(answer) is wrong


def test_a_killed_server_whose_gpus_stayed_held_and_what_is_left_are_problems(tmp_path):
    url = f"sqlite:///{tmp_path / 'gpuhub.sqlite'}"
    led = Ledger(url, config_rules=LimitRules(default=Limit(max_gpus=2)))
    led.sync_inventory([Gpu("n1", 0, "A100"), Gpu("n1", 1, "A100")])
    try:
        held = led.allocate("alice", [], 1)
        freed = led.allocate("alice", [], 1)
        led.release(freed.id, "server exited")
        s = soak(url)
        killed = led.get(freed.id).created
        s.kills = [(killed, "alice", freed.id), (killed, "alice", held.id)]
        s.leftover = ["4242 python -m spawner.singleuser"]
        s.research = ["step 3: the ranks hold [('0', '3')], not step 3 on both"]
        s.stop_5xx = 2
        s.guarded(lambda who: 1 / 0)("alice")
        problems = s.problems()
        assert f"allocation {held.id} of alice is still starting" in problems
        assert f"alice's killed server's allocation {held.id} ended at None (killed {killed})" in problems
        assert not any(f"allocation {freed.id} ended" in p for p in problems)  # within the bound
        assert "still running after the hub stopped: 4242 python -m spawner.singleuser" in problems
        assert "the researcher's pool: step 3: the ranks hold [('0', '3')], not step 3 on both" in problems
        assert "2 stops after the run answered 500 or more" in problems
        assert (
            "a scripted actor stopped on an error: <lambda>('alice',): ZeroDivisionError('division by zero')"
            in problems
        )
        # a kill whose GPUs came back later than the bound
        s.kills = [(killed - timedelta(minutes=5), "alice", freed.id)]
        assert any(f"allocation {freed.id} ended at" in p for p in s.problems())
    finally:
        led.close()
