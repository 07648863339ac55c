"""Fixtures shared by the end-to-end tests (each module brings its own ``hub``)."""

import shutil

import pytest

from spawner.ledger import Ledger

from . import dbtools
from .hubtools import Hub, tidy


@pytest.fixture
def ledger(hub):
    """The ledger the module's hub writes, read from the test as an admin would."""
    led = Ledger(hub.ledger_url)
    yield led
    led.close()


@pytest.fixture(scope="session")
def demo_hub(tmp_path_factory):
    """One test hub with the demo's configuration alone (4 simulated GPUs), started once for
    every module that needs nothing else; use it through ``tidy_demo_hub``."""
    h = Hub(tmp_path_factory.mktemp("demo-hub")).start().wait_for_broker()
    yield h
    h.stop()


@pytest.fixture
def tidy_demo_hub(demo_hub):
    """The shared demo hub, left after each test as a fresh one would be but for the
    ledger's history and the hub's users: nothing waits, no burst is held, no demo user's
    server runs, the configured limits hold (``hubtools.tidy``)."""
    yield demo_hub
    tidy(demo_hub, stop_servers=True, limits=True)


@pytest.fixture(params=dbtools.BACKENDS)
def db_url(request, tmp_path):
    """A fresh, empty ledger database: the test runs once on SQLite, once on PostgreSQL."""
    with dbtools.ledger_database(request.param, tmp_path) as url:
        yield url


# Debian's headless Chromium: the flags it needs to run as root without a display
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture
def browser():
    """A headless Chromium driven by Playwright (the page tests)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def slurm_test(nodeid: str) -> bool:
    """A test of the Slurm test cluster (its module's, its own or its parameter's name says
    so): they take the cluster in turn (``slurmtools.cluster_turn``)."""
    return "slurm" in nodeid.lower()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist with ``--dist loadfile`` (``scripts/test``) every module stays whole
    on one worker (its module-scoped hub started once), and every test of the Slurm cluster
    runs on one worker, one after the other: they take the cluster in turn anyway, so a second
    worker would only wait for it. (xdist's ``loadgroup`` marks do not reach pytest 9's node
    ids, so the grouping is this scheduler's.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndSlurm(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "slurm" if slurm_test(nodeid) else nodeid.split("::", 1)[0]

    return ModulesAndSlurm(config, log)


# the longest modules besides the Slurm chain (seconds on 2 cores, from the suite's durations):
# handed out first, so that no worker starts one of them while the others are finishing
LONG_MODULES = (
    "test_soak.py",  # 200
    "test_time_limits_hub.py",  # 170
    "test_lab_hub.py",  # 130
    "test_reclaim_hub.py",  # 110
    "test_checkpoint_sharded.py",  # 100
    "test_distributed_hub.py",  # 90
    "test_queue_hub.py",  # 80
)


def pytest_collection_modifyitems(config, items):
    """The Slurm tests come first, so that their long chain starts at once while the other
    workers share the rest (xdist hands out the modules in this order), the longest of the rest
    next (``LONG_MODULES``)."""

    def order(item) -> tuple[bool, int]:
        module = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
        long = LONG_MODULES.index(module) if module in LONG_MODULES else len(LONG_MODULES)
        return (not slurm_test(item.nodeid), long)

    items.sort(key=order)  # stable: the order within each kept
