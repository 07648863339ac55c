"""The pure decisions and words of a pool that shrinks in place (``gpu_magics.kernel.resizing``)."""

from __future__ import annotations

import pytest

from gpu_magics.common.ranks import Slot, make_rank_specs
from gpu_magics.kernel import resizing

SPECS = make_rank_specs([Slot("vm", i) for i in range(4)], "127.0.0.1", 29500)


@pytest.mark.parametrize(
    "leaving, remote, problem",
    [
        ([3], False, None),
        ([2, 3], False, None),
        ([], False, "no rank leaves"),
        ([0, 1, 2, 3], False, "every rank leaves"),
        ([0], False, "rank 0 leaves (it holds the rendezvous and the gathered state)"),
        ([5], False, "rank 5 is not in the pool"),
        ([3], True, "the ranks run on other machines (a Slurm pool shrinks through Slurm)"),
    ],
)
def test_shrink_problem(leaving, remote, problem):
    assert resizing.shrink_problem(SPECS, leaving, remote=remote) == problem


def test_the_ranks_on_the_gpus_taken_back_leave():
    assert resizing.leaving_ranks(SPECS, ["vm:3"]) == [3]
    assert resizing.leaving_ranks(SPECS, ["vm:1", "vm:3", "other:0"]) == [1, 3]


def _shrunk(**kw):
    base = dict(old_size=4, left=[(3, "vm:3")], pids=[11, 12, 13], checked=True, ddp=["model"])
    return resizing.Shrunk(**{**base, **kw})


def test_the_report_says_the_new_size_what_was_kept_resharded_and_lost():
    text = "\n".join(
        resizing.shrink_text(
            _shrunk(
                resharded={
                    "models": {"fs": {"optimizers": ["fs_opt"]}},
                    "refused": {"hs": "uses a 2-D DeviceMesh"},
                },
                lost_groups=["sub"],
                lost_meshes=["mesh2d"],
            )
        )
    )
    assert "The pool shrank in place from 4 to 3 ranks: rank 3 (GPU vm:3) left;" in text
    assert "(renumbered ranks 0, 1 and 2;" in text
    assert "The world group was re-formed at 3 ranks and answered a collective on every rank." in text
    assert "checked equal on every rank: model." in text
    assert (
        "Resharded onto 3 ranks: fs (FSDP2) with fs_opt, its full state checked equal to the state "
        "before the move." in text
    )
    assert "Not resharded: hs (uses a 2-D DeviceMesh)." in text
    assert "Lost: sub (a process group of the old world), mesh2d (a DeviceMesh of the old world)" in text
    assert text.endswith("Run the next cells with --gpus 3.")


def test_the_report_never_says_checked_when_it_was_not():
    text = "\n".join(resizing.shrink_text(_shrunk(checked=False, ddp_equal=False)))
    assert "answered a collective" not in text and "checked equal" not in text
    assert "The new world group did not answer on every rank" in text
    assert "their parameters differ between ranks: model; restore them from a checkpoint." in text
