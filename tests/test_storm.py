"""A class-start storm, short (issue 35; ``benchmarks/storm.py`` is the full one, measured): a
real hub and proxy with 4 simulated GPUs, and 24 users who each press Start for one GPU within
3 seconds, through the REST API at once.

Every spawn settles: 4 start, and each of the other 20 waits with a place of its own, 1 to 20,
as the queue in the ledger orders them; no answer is a 5xx, and the hub's API answers all
along. Then every server is stopped in parallel, and the ledger's whole history is checked
(``tests/invariants.py``): everything ended with a reason, no GPU twice, nobody over the limit.
"""

from __future__ import annotations

import pytest

from spawner.ledger import Ledger

from .hubtools import Hub
from .invariants import check_invariants, history, unfinished
from .stormtools import run_storm, stop_all

pytestmark = pytest.mark.hub
GPUS, USERS, WINDOW = 4, 24, 3.0


def test_a_class_start_storm_settles_every_spawn_with_its_place_and_no_5xx(tmp_path):
    hub = Hub(tmp_path / "hub", extra_config="c.JupyterHub.concurrent_spawn_limit = 0").start()
    users = [f"s{i:02d}" for i in range(USERS)]
    ledger = Ledger(hub.ledger_url)
    try:
        for user in users:
            hub.ensure_user(user)
        storm = run_storm(hub, users, WINDOW, {"gpus": 1})
        assert [(s.user, s.status, s.error) for s in storm.spawns if s.error] == []
        assert storm.server_errors == 0 and storm.unsettled == []
        assert storm.api_latencies, "the hub's API was never probed"
        ready = sorted(s.user for s in storm.spawns if s.ready)
        waiting = {s.user: s.place for s in storm.spawns if not s.ready}
        assert len(ready) == GPUS
        # one place each, none twice, none skipped: the queue as the ledger orders it
        assert sorted(waiting.values()) == list(range(1, USERS - GPUS + 1))
        assert {q.user: q.position for q in ledger.queue()} == waiting
        assert sorted(a.user for a in ledger.active()) == ready
        assert all(len(a.gpus) == 1 for a in ledger.active())
    finally:
        stopped_with_5xx = stop_all(hub, users)
        ledger.close()
        hub.stop()
    assert stopped_with_5xx == 0
    # over the whole history: every start and every wait ended with the reason its user was
    # given; no GPU had two holders; nobody held, or held and waited for, more than 1 GPU
    assert unfinished(hub.ledger_url) == []
    assert check_invariants(*history(hub.ledger_url), limits=lambda user: (1, 0)) == []
