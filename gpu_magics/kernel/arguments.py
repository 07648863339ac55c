"""The magics' option types: the same parsers and ranges as the hub's form, API and CLI."""

from __future__ import annotations

from spawner.policy import values
from spawner.policy.limits import MAX_COUNT

MAX_TIMEOUT_SECONDS = 7 * 86400.0


def COUNT(option: str):
    """``type=`` for a count option of 1 or more: ``--gpus``, ``--nodes``, ``--workers``."""
    return values.argparse_type(values.parse_count, option, lo=1, hi=MAX_COUNT)


def SECONDS(option: str, lo: float = 0.1, hi: float = MAX_TIMEOUT_SECONDS):
    return values.argparse_type(values.parse_seconds, option, lo=lo, hi=hi)
