"""A soak, short (issue 35; ``benchmarks/soak.py`` is the long one): 6 users and a researcher
on a real hub with 4 simulated GPUs for 50 s, while the broker, the proxy, a server and the hub
are killed or restarted, a server is paused, and the ledger's PostgreSQL database drops every
connection (``tests/soaktools.py``). The researcher trains in a 2-rank ``--autosave`` pool
all along, interrupting a cell now and then, then shuts it down and restores into a new one.

Afterwards: every allocation and wait ended with its reason, no GPU had two holders, nobody was
over their limit beyond their borrowing allowance, no answer was a 500 (nor a 502-504 outside a
fault), the killed server's GPUs came back, every training step reached both ranks, the
restored state is the last step's, and nothing of the hub is left running.
"""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from .dbtools import ledger_database
from .hubtools import Hub
from .soaktools import Soak, config

pytestmark = pytest.mark.hub
GPUS, USERS, SECONDS = 4, 6, 50.0


# PostgreSQL, whose connections the soak ends too; SQLite's soak is benchmarks/soak.py's (the
# suite's 20 minutes on 2 cores have no room for both: docs/reliability.md)
@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_soak_with_faults_loses_nothing_and_breaks_no_rule(backend, tmp_path):
    users = [f"u{i:02d}" for i in range(USERS)]
    lab, target = [*users[: USERS // 2], "r00"], users[-1]
    with ledger_database(backend, tmp_path) as url:
        hub = Hub(tmp_path / "hub", extra_config=config(GPUS, lab, target), ledger_url=url).start()
        soak = Soak(hub, users, lab, target, SECONDS, seed=35, researcher="r00")
        soak.database = make_url(url).query.get("application_name", "") if backend == "postgresql" else ""
        figures = soak.run_checked()
        assert figures["waits"] > 0, figures  # the queue was used
        assert soak.cells > 0 and soak.interrupts > 0, "the researcher trained nothing, or stopped no cell"
