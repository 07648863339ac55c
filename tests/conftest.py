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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``scripts/test``: ``--dist loadgroup``) every test of the Slurm test
    cluster runs on one worker, one after the other (they take the cluster in turn anyway, so
    a second worker would only wait), and every other module stays whole on one worker (its
    module-scoped hub started once). The Slurm tests come first, so that their long chain
    starts at once while the other workers share the rest. Before xdist's own hook, which
    reads the groups."""
    slurm = {item.nodeid for item in items if "slurm" in item.nodeid.lower()}
    for item in items:
        item.add_marker(pytest.mark.xdist_group("slurm" if item.nodeid in slurm else item.module.__name__))
    items.sort(key=lambda item: item.nodeid not in slurm)  # stable: the order within each kept
