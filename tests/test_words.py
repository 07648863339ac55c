"""The one way counts and times are written for people (gpu_magics.common.words)."""

from datetime import UTC, datetime, timedelta, timezone

import pytest

from gpu_magics.common.words import clock, count, stamp


@pytest.mark.parametrize(
    ("n", "noun", "plural", "want"),
    [
        (0, "GPU", None, "0 GPUs"),
        (1, "GPU", None, "1 GPU"),
        (2, "GPU", None, "2 GPUs"),
        (1, "engine", None, "1 engine"),
        (3, "GPU-hour", None, "3 GPU-hours"),
        (2, "entry", "entries", "2 entries"),
        (1, "entry", "entries", "1 entry"),
    ],
)
def test_count(n, noun, plural, want):
    assert count(n, noun, plural) == want


@pytest.mark.parametrize(
    ("when", "want_stamp", "want_clock"),
    [
        (datetime(2026, 12, 3, 7, 36, 41), "2026-12-03 07:36:41 UTC", "07:36:41 UTC"),  # naive is UTC
        (datetime(2026, 12, 3, 7, 36, 41, tzinfo=UTC), "2026-12-03 07:36:41 UTC", "07:36:41 UTC"),
        (
            datetime(2026, 12, 3, 9, 36, 41, tzinfo=timezone(timedelta(hours=2))),
            "2026-12-03 07:36:41 UTC",
            "07:36:41 UTC",
        ),
        (datetime(2026, 12, 3, 7, 36, 41, tzinfo=UTC).timestamp(), "2026-12-03 07:36:41 UTC", "07:36:41 UTC"),
    ],
)
def test_stamp_and_clock_are_utc(when, want_stamp, want_clock):
    assert stamp(when) == want_stamp
    assert clock(when) == want_clock
