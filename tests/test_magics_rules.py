"""Pure parts of %%distributed: ranks, placement choice, targets, error classes, streaming."""

import pytest
from IPython.core.error import UsageError

from gpu_magics.common.ranks import Slot, choose_slots, make_rank_specs
from gpu_magics.kernel.outcome import parse_targets
from gpu_magics.kernel.pool import _Streamer, next_step


def test_rank_specs_follow_torchrun():
    slots = [Slot("b", 1), Slot("a", 3), Slot("b", 0), Slot("a", 2)]
    specs = make_rank_specs(slots, "10.0.0.1", 29500)
    assert [(s.rank, s.local_rank, s.slot.label) for s in specs] == [
        (0, 0, "a:2"),
        (1, 1, "a:3"),
        (2, 0, "b:0"),
        (3, 1, "b:1"),
    ]
    env = specs[2].env()
    assert env == {
        "RANK": "2",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "CUDA_VISIBLE_DEVICES": "0",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "GPUHUB_RANK_GPU": "b:0",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "2",
        "ROLE_WORLD_SIZE": "4",
        "TORCHELASTIC_RUN_ID": "gpuhub",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def test_rank_specs_refuse_a_gpu_twice():
    with pytest.raises(ValueError, match="twice"):
        make_rank_specs([Slot("a", 0), Slot("a", 0)], "h", 1)


@pytest.mark.parametrize(
    "server, wanted, expected",
    [
        (["n:2", "n:0", "n:1"], 2, ["n:0", "n:1"]),
        (["n:0"], 2, None),  # not enough: a burst
        ([], 1, None),
    ],
)
def test_choose_slots(server, wanted, expected):
    got = choose_slots(server, wanted)
    assert (None if got is None else [s.label for s in got]) == expected


@pytest.mark.parametrize(
    "text, world, ranks",
    [("0", 2, [0]), ("0,2-3", 4, [0, 2, 3]), (" 1 , 1 ", 2, [1])],
)
def test_parse_targets(text, world, ranks):
    assert parse_targets(text, world) == ranks


@pytest.mark.parametrize("text", ["2", "a", "1-0", "__import__('os')", ",", "0-"])
def test_parse_targets_refuses(text):
    with pytest.raises(UsageError):
        parse_targets(text, 2)


@pytest.mark.parametrize(
    "elapsed, taken, step",
    [
        (0.0, set(), "interrupt"),
        (0.9, {"interrupt"}, None),
        (1.0, {"interrupt"}, "free"),  # FREE_AFTER: still running means stuck in a collective
        (5.9, {"interrupt", "free"}, None),
        (6.0, {"interrupt", "free"}, "kill"),  # FREE_AFTER + KILL_AFTER
        (9.0, {"interrupt"}, "free"),  # one step at a time, in order
        (10.9, {"interrupt", "free", "kill"}, None),
        (11.0, {"interrupt", "free", "kill"}, "give up"),
    ],
)
def test_next_step(elapsed, taken, step):
    assert next_step(elapsed, frozenset(taken)) == step


def test_streamer_prefixes_whole_lines(capsys):
    s = _Streamer([0, 1], show=lambda rank, name: rank == 0 or name == "stderr")
    s.feed([{"stdout": "a\nb", "stderr": ""}, {"stdout": "hidden\n", "stderr": "warn\n"}])
    s.feed([{"stdout": "a\nbc\n", "stderr": ""}, {"stdout": "hidden\n", "stderr": "warn\n"}])
    s.close()
    out, err = capsys.readouterr()
    assert out == "[rank 0] a\n[rank 0] bc\n"
    assert err == "[rank 1] warn\n"


def test_a_slurm_preemption_reaches_the_cells_report(tmp_path):
    """The engines' own line, written when Slurm's SIGTERM made them save, is what the lost
    pool's report shows; without an autosave or for another job there is nothing to show."""
    import json
    from types import SimpleNamespace

    from gpu_magics.engine.checkpoints import preempt_report_path
    from gpu_magics.kernel.outcome import slurm_preemption

    line = "gpuhub: engine rank 0 preempted by Slurm (job 77): saved model to " + str(tmp_path)
    path = preempt_report_path(str(tmp_path), "77")
    with open(path, "w") as f:
        json.dump({"text": line}, f)

    def pool(job, autosave):
        return SimpleNamespace(launcher=SimpleNamespace(job_id=job, autosave=autosave))

    assert slurm_preemption(pool("77", (["model"], str(tmp_path)))) == line
    assert slurm_preemption(pool("78", (["model"], str(tmp_path)))) is None
    assert slurm_preemption(pool("77", None)) is None
    assert slurm_preemption(SimpleNamespace(launcher=SimpleNamespace())) is None  # a local pool
