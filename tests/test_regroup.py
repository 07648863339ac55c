"""The pure decisions after a failed or interrupted cell: keep the process groups, or reconnect
which of them on which ranks, and the words the cell says (``gpu_magics.kernel.regroup``)."""

from __future__ import annotations

import pytest

from gpu_magics.kernel import regroup


def _g(ranks, seq=4, reconfigurable=True, backend="gloo"):
    return {"ranks": ranks, "seq": seq, "reconfigurable": reconfigurable, "backend": backend}


def _st(groups, freed=0, initialized=True, rank=0):
    return {"initialized": initialized, "freed": freed, "rank": rank, "groups": groups}


W2 = [0, 1]


@pytest.mark.parametrize(
    "states, keep",
    [
        ([_st({"0": _g(W2)}), _st({"0": _g(W2)})], True),
        (
            [_st({"0": _g(W2, 4)}), _st({"0": _g(W2, 5)})],
            False,
        ),  # one rank ran a collective the other did not join
        ([_st({"0": _g(W2)}), _st({"0": _g(W2)}, freed=1)], False),  # a rank was freed from a collective
        ([_st({"0": _g(W2)}), _st({}, initialized=False)], False),
        ([], False),
        # the world group agrees, a subgroup does not: a collective on the subgroup was left half done
        ([_st({"0": _g(W2), "1": _g(W2, 2)}), _st({"0": _g(W2), "1": _g(W2, 3)})], False),
        ([_st({"0": _g(W2, -1)}), _st({"0": _g(W2, -1)})], False),  # a backend that does not count
    ],
)
def test_keep_groups(states, keep):
    assert regroup.keep_groups(states) is keep


def test_plan_reconnects_every_gpuhub_group_on_its_members_only():
    w4 = [0, 1, 2, 3]
    states = [
        _st({"0": _g(w4), "1": _g([0, 1])}),
        _st({"0": _g(w4), "1": _g([0, 1])}),
        _st({"0": _g(w4), "2": _g([2, 3])}),
        _st({"0": _g(w4), "2": _g([2, 3])}),
    ]
    p = regroup.plan(states)
    assert p.names == [["0", "1"], ["0", "1"], ["0", "2"], ["0", "2"]]
    assert p.lost == {} and not p.broken


@pytest.mark.parametrize(
    "states, lost_name, words",
    [
        # a group the user made with another backend than gpuhub's
        (
            [
                _st({"0": _g(W2), "1": _g(W2, reconfigurable=False)}),
                _st({"0": _g(W2), "1": _g(W2, reconfigurable=False)}),
            ],
            "1",
            "made with backend 'gloo', which gpuhub cannot reconnect",
        ),
        # rank 1 never made the subgroup (its cell failed before new_group)
        ([_st({"0": _g(W2), "1": _g(W2)}), _st({"0": _g(W2)})], "1", "rank 1 no longer has it"),
    ],
)
def test_plan_names_what_it_cannot_reconnect(states, lost_name, words):
    p = regroup.plan(states)
    assert words in p.lost[lost_name]
    assert all(lost_name not in names for names in p.names)
    assert p.names == [["0"], ["0"]] and not p.broken


def test_the_world_group_lost_breaks_the_pool():
    p = regroup.plan([_st({"0": _g(W2)}), _st({})])
    assert p.broken


def _result(failed=None, checked=None, synced=()):
    return {"failed": failed or {}, "checked": checked or {}, "synced": list(synced)}


def test_report_names_only_what_every_member_checked():
    states = [_st({"0": _g(W2), "1": _g(W2)}), _st({"0": _g(W2), "1": _g(W2)})]
    p = regroup.plan(states)
    ok = _result(checked={"0": "", "1": ""}, synced=["ddp"])
    found = {"ddp": ["ddp"], "fsdp": ["model"], "mesh": [], "group": {"1": ["sub"]}}
    notes, good = regroup.report(p, [ok, ok], found)
    text = "\n".join(notes)
    assert good
    assert (
        "each answered a collective on every member: the world group (2 ranks); sub (ranks 0 and 1)." in text
    )
    assert "so these go on: model (FSDP2), ddp (DDP)." in text
    assert "Made equal to rank 0's on every rank (parameters and buffers): ddp." in text
    # one member's check failed: the group is not said to work, and nothing is said to go on
    bad = _result(checked={"0": "", "1": "RuntimeError: Connection closed by peer"})
    notes, good = regroup.report(p, [ok, bad], found)
    text = "\n".join(notes)
    assert good  # the world group answered
    assert "the world group (2 ranks)." in text and "sub (ranks 0 and 1);" not in text
    assert (
        "Not working after the reconnection: sub (ranks 0 and 1) "
        "(rank 1: RuntimeError: Connection closed by peer)." in text
    )
    assert "go on" not in text


def test_report_when_the_world_group_fails_says_fresh_engines():
    p = regroup.plan([_st({"0": _g(W2)}), _st({"0": _g(W2)})])
    notes, good = regroup.report(
        p, [_result(checked={"0": ""}), _result(failed={"0": "TimeoutError: x"})], {}
    )
    assert not good
    assert "The world group did not answer on every rank; the next cell starts fresh engines." in notes


@pytest.mark.parametrize(
    "digests, apart",
    [
        ([], []),
        ([{"ddp": [1.0, 2.0, 3.0]}, {"ddp": [1.0, 2.0, 3.0]}], []),
        ([{"ddp": [1.0, 2.0, 3.0], "b": [0.0, 0, 0]}, {"ddp": [1.0, 2.5, 3.0], "b": [0.0, 0, 0]}], ["ddp"]),
        ([{"ddp": [1.0, 2.0, 3.0], "own": [1.0, 1, 1]}, {"ddp": [1.0, 2.0, 3.0]}], []),  # not on every rank
    ],
)
def test_ddp_replicas_left_apart_by_an_interrupt_are_found(digests, apart):
    assert regroup.diverged(digests) == apart


def test_the_cell_says_which_replicas_and_optimizers_were_made_equal():
    assert regroup.resync_note(None) == [] and regroup.resync_note({"modules": [], "optimizers": []}) == []
    [note] = regroup.resync_note({"modules": ["ddp"], "optimizers": []})
    assert note.endswith("made equal to rank 0's on every rank (parameters and buffers): ddp.")
    [note] = regroup.resync_note({"modules": ["ddp"], "optimizers": ["opt"]})
    assert note.endswith("(parameters and buffers): ddp, and the state of their optimizers: opt.")
