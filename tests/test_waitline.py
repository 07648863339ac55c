"""What a start waiting in the queue shows on the spawn page (spawner/policy/waitline.py)."""

import pytest

from spawner.policy import waitline


@pytest.mark.parametrize(
    "position, waiting, progress, heading",
    [
        (1, 1, 50, "Waiting for GPUs: 1st of 1 in the queue"),
        (1, 3, 50, "Waiting for GPUs: 1st of 3 in the queue"),
        (2, 3, 37, "Waiting for GPUs: 2nd of 3 in the queue"),
        (3, 3, 23, "Waiting for GPUs: 3rd of 3 in the queue"),
        (2, 2, 30, "Waiting for GPUs: 2nd of 2 in the queue"),
        (11, 12, 17, "Waiting for GPUs: 11th of 12 in the queue"),
        (0, 0, 10, "Waiting for GPUs in the queue"),  # a place nobody could count
    ],
)
def test_the_heading_and_bar_follow_the_place(position, waiting, progress, heading):
    assert waitline.queue_progress(position, waiting) == progress
    assert waitline.queue_heading(position, waiting) == heading


def test_the_bar_grows_as_the_place_nears_the_first():
    bars = [waitline.queue_progress(p, 5) for p in range(5, 0, -1)]
    assert bars == sorted(bars) and len(set(bars)) == 5
    lo, hi = waitline.QUEUE_PROGRESS
    assert lo < bars[0] and bars[-1] == hi


@pytest.mark.parametrize(
    "gpus, reason, message",
    [
        (
            2,
            "your limit is now 1 GPU (group students); your request for 2 GPUs can never fit: start "
            "again with 1 or fewer, or ask an admin to raise the limit",
            "Your request for 2 GPUs no longer waits: your limit is now 1 GPU (group students); your "
            "request for 2 GPUs can never fit: start again with 1 or fewer, or ask an admin to raise "
            "the limit.",
        ),
        (
            1,
            "an admin (admin) cancelled it",
            "Your request for 1 GPU no longer waits: an admin (admin) cancelled it. "
            "Start the server again to wait anew.",
        ),
        (
            3,
            None,
            "Your request for 3 GPUs no longer waits: it left the queue. "
            "Start the server again to wait anew.",
        ),
    ],
)
def test_a_start_that_left_the_queue_says_why_and_what_to_do(gpus, reason, message):
    assert waitline.left_message(gpus, reason) == message
