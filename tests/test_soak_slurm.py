"""A soak on the Slurm test cluster, short (issue 35; ``tests/test_soak.py`` is the local one):
its 4 users (real Unix accounts) start and stop Slurm-job servers of 0 to 3 GPUs and take
bursts on the cluster's 8 fake GPUs for 40 s, while the broker is SIGKILLed, a server's process
is SIGKILLed inside its job, slurmctld is stopped and started again, and the hub restarts
(``tests/soaktools.py``). Afterwards: every allocation and wait ended with its reason, no GPU
had two holders, nobody was over their limit, no answer was a 500 (nor a 502-504 outside a
fault), the killed server's GPUs came back, no job is left in Slurm and nothing of the hub runs.
"""

from __future__ import annotations

import pytest

from . import slurmtools
from .soaktools import SLURM_FAULTS, Soak, config

pytestmark = pytest.mark.hub
SECONDS = 40.0


def test_a_slurm_soak_with_faults_loses_nothing_and_breaks_no_rule(tmp_path):
    users = list(slurmtools.USERS)
    lab, target = ["bob", "carol"], "dave"
    with slurmtools.slurm_hub(tmp_path / "hub", config(0, lab, target, slurm=True)) as hub:
        soak = Soak(hub, users, lab, target, SECONDS, seed=35, schedule=SLURM_FAULTS, slurm=True)
        soak.run_checked()
