"""Fixtures shared by the end-to-end tests (each module brings its own ``hub``)."""

import pytest

from spawner.ledger import Ledger


@pytest.fixture
def ledger(hub):
    """The ledger the module's hub writes, read from the test as an admin would."""
    led = Ledger(hub.ledger_url)
    yield led
    led.close()
