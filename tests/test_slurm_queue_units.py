"""Slurm's own queue as gpuhub configures and shows it, without a cluster: fair shares written
as associations' Fairshare, queue positions and expected starts read from ``squeue --json``,
the wait line, and the slurm.conf priority settings rendered from gpuhub's traits.
The same on the real cluster: test_slurm_queue.py."""

import json
from datetime import datetime

import pytest
from traitlets.config import Config

from spawner.policy.fairshare import Shares, Weights
from spawner.policy.limits import EffectiveLimit, Limit
from spawner.slurm import accounting, priority, squeue
from spawner.slurm.squeue import JobInfo

NAMES = ("gpuhub-server", "gpuhub-engines")


def eff(max_gpus):
    return EffectiveLimit(Limit(max_gpus=max_gpus), "default")


# shares -> associations' Fairshare --------------------------------------------------------


def test_parse_associations_reads_fairshare():
    text = "alice|gpuhub|gres/gpu=2|3\nbob|gpuhub||parent\ncarol|gpuhub|gres/gpu=1\n"
    got = accounting.parse_associations(text)
    assert [(a.user, a.gpus, a.fairshare) for a in got.values()] == [
        ("alice", 2, 3), ("bob", -1, None), ("carol", 1, None)]  # fmt: skip


SHARES = Shares(default=1, groups={"staff": 4, "students": 2}, users={"alice": 7})


@pytest.mark.parametrize("user, groups, want", [
    ("alice", ["staff"], 7),           # the user's own share wins over their groups
    ("bob", ["students", "staff"], 4),  # the most generous of their groups
    ("carol", ["students"], 2),
    ("dave", [], 1),                   # the default
    ("erin", ["nobody"], 1),
])  # fmt: skip
def test_wanted_shares(user, groups, want):
    assert accounting.wanted_shares({user: groups}, SHARES) == {user: want}


ADD = "sacctmgr -i add user alice Account=gpuhub".split()
SET = "sacctmgr -i modify user where name=alice account=gpuhub set".split()


@pytest.mark.parametrize("current, share, commands", [
    (None, 3, [ADD, [*SET, "GrpTRES=gres/gpu=2", "Fairshare=3"]]),   # new: limit and share at once
    ((2, 3), 3, []),                                                  # as Slurm has it: nothing
    ((2, 1), 3, [[*SET, "Fairshare=3"]]),                             # only the share changed
    ((2, None), 1, [[*SET, "Fairshare=1"]]),                          # "parent" becomes a number
    ((1, 3), 3, [[*SET, "GrpTRES=gres/gpu=2"]]),                      # only the limit changed
    ((1, 5), 3, [[*SET, "GrpTRES=gres/gpu=2", "Fairshare=3"]]),
    ((2, 5), None, []),                                               # no share given: left alone
])  # fmt: skip
def test_plan_writes_fairshare_with_the_limit(current, share, commands):
    have = {} if current is None else {"alice": accounting.Association("alice", "gpuhub", *current)}
    shares = None if share is None else {"alice": share}
    assert accounting.plan({"alice": eff(2)}, have, "gpuhub", shares) == commands


class FakeLedger:
    def __init__(self, groups):
        self.groups = groups

    def effective_limits(self, users=None):
        return {u: eff(2) for u in (users or self.groups)}

    def known_groups(self, users):
        return {u: self.groups.get(u, []) for u in users}


@pytest.fixture(autouse=True)
def _nothing_verified():
    """Each test starts with nothing remembered of Slurm's accounting (a per-process memo)."""
    accounting.SlurmAccounting.forget()
    yield
    accounting.SlurmAccounting.forget()


def test_sync_writes_each_known_users_effective_share(monkeypatch):
    config = Config()
    config.GpuHub.group_shares = {"staff": 4}
    config.GpuHub.user_shares = {"carol": 2}
    acc = accounting.SlurmAccounting(enabled=True, config=config)
    ran = []
    have = "alice|gpuhub|gres/gpu=2|1\nbob|gpuhub|gres/gpu=2|1\ncarol|gpuhub|gres/gpu=2|1\n"
    monkeypatch.setattr(acc, "_run", lambda argv: ran.append(argv) or (have if "show" in argv else ""))
    ledger = FakeLedger({"alice": ["staff"], "bob": [], "carol": ["staff"]})
    acc.sync(ledger)
    changed = {argv[5]: argv[-1] for argv in ran if "modify" in argv}
    assert changed == {"name=alice": "Fairshare=4", "name=carol": "Fairshare=2"}
    # a spawn knows the user's groups better than the ledger's last record
    ran.clear()
    acc.sync(ledger, ["bob"], {"bob": ["staff"]})
    assert [argv[-1] for argv in ran if "modify" in argv] == ["Fairshare=4"]


@pytest.mark.parametrize("section, value, trait", [
    ("default_share", 0, "c.GpuHub.default_share"),
    ("group_shares", {"staff": -1}, "c.GpuHub.group_shares['staff']"),
    ("user_shares", {"alice": 1.5}, "c.GpuHub.user_shares['alice']"),
    ("user_shares", {"alice": "2"}, "c.GpuHub.user_shares['alice']"),
])  # fmt: skip
def test_a_bad_share_is_refused_naming_its_trait_before_sacctmgr_runs(monkeypatch, section, value, trait):
    config = Config()
    setattr(config.GpuHub, section, value)
    acc = accounting.SlurmAccounting(enabled=True, config=config)
    ran = []
    monkeypatch.setattr(acc, "_run", lambda argv: ran.append(argv) or "")
    with pytest.raises(ValueError) as e:
        acc.sync(FakeLedger({"alice": []}))
    assert trait in str(e.value) and "whole number of 1 or more" in str(e.value)
    assert ran == []


# squeue --json: priorities, partitions, expected starts ----------------------------------


def job(job_id, state="PENDING", name="gpuhub-server", user="alice", priority=100, partition="gpu", start=0):
    return {"job_id": job_id, "job_state": state, "user_name": user, "name": name, "comment": "",
            "nodes": "" if state == "PENDING" else "gpu-node1", "start_time": start,
            "state_reason": "Resources",
            "gres_detail": [] if state == "PENDING" else ["gpu:a100:1(IDX:0)"], "priority": priority,
            "partition": partition}  # fmt: skip


def listing(*listed):
    return squeue.parse_squeue_json(json.dumps({"errors": [], "jobs": list(listed)}), NAMES)


def test_the_queue_holds_everyones_pending_jobs_and_positions_come_from_it():
    got = listing(
        job(10, "RUNNING", name="someone-elses", user="carol"),  # running: not waiting
        job(11, name="someone-elses", user="carol", priority=900),  # anyone's job competes
        job(12, priority=500),
        job(13, name="gpuhub-engines", user="bob", priority=500, partition="gpu,interactive"),
        job(14, name="x", user="dave", priority=0),  # held: competes for nothing
        job(15, name="x", user="dave", priority=800, partition="interactive"),
        job(16, name="x", user="eve", priority=-3),  # unreadable: not counted, nothing fails
    )
    assert set(got.jobs) == {"12", "13"}
    assert {q.job_id for q in got.queue} == {"11", "12", "13", "14", "15"}
    assert squeue.queue_positions(got.queue, ["12", "13"]) == {
        "12": (2, 3, "gpu"),  # behind 11 (900); ahead of 13 at the same priority (older id)
        "13": (3, 3, "gpu"),  # placed in the first partition it names
    }
    assert squeue.queue_positions(got.queue, ["15"]) == {"15": (1, 2, "interactive")}
    assert squeue.queue_positions(got.queue, ["14", "99"]) == {}  # held, unknown: no position


def test_a_job_listed_twice_is_not_counted():
    got = listing(job(11, name="x", priority=900), job(11, name="x", priority=900), job(12))
    assert squeue.queue_positions(got.queue, ["12"]) == {"12": (1, 1, "gpu")}


@pytest.mark.parametrize("raw, want", [
    (0, None),                                            # Slurm has no estimate yet
    (1796134868, datetime(2026, 12, 1, 14, 21, 8)),       # epoch (22.05)
    ({"set": True, "infinite": False, "number": 1796134868}, datetime(2026, 12, 1, 14, 21, 8)),  # 23.02+
    ({"set": False, "number": 0}, None),
    (None, None),
])  # fmt: skip
def test_expected_start_of_a_pending_job(raw, want):
    j = job(12, start=0)
    j["start_time"] = raw
    assert listing(j).jobs["12"].expected == want


def test_a_running_jobs_start_is_no_expected_start_and_newer_priority_objects_read():
    assert listing(job(12, "RUNNING", start=1796134868)).jobs["12"].expected is None
    j = {**job(12), "priority": {"set": True, "infinite": False, "number": 77}}
    assert listing(j).jobs["12"].priority == 77


@pytest.mark.parametrize("field, value", [("priority", "high"), ("priority", True), ("partition", "gp u")])
def test_a_gpuhub_job_with_an_odd_priority_or_partition_is_skipped(field, value):
    got = listing({**job(12), field: value})
    assert got.jobs == {} and got.unreadable == {"12"}


# the wait line ----------------------------------------------------------------------------

NOW = datetime(2026, 12, 1, 14, 0)


def local(at):  # gpuhub writes times in UTC, whatever the machine's zone
    return at.strftime("%H:%M UTC")


@pytest.mark.parametrize("expected, position, words", [
    (datetime(2026, 12, 1, 14, 20), (2, 3, "gpu"),
     "Queued in Slurm as job 42 in partition gpu: 2nd of 3 waiting for 2 GPUs, expected start about "
     f"{local(datetime(2026, 12, 1, 14, 20))} (in 20 min; Slurm's estimate, not a promise). "
     "Slurm's reason: Resources"),
    (None, (1, 1, "gpu"),
     "Queued in Slurm as job 42 in partition gpu: 1st of 1 waiting for 2 GPUs; no estimate from Slurm yet"),
    (None, None, "Queued in Slurm as job 42 (Resources)"),  # no position (held, text fallback)
    # a year ahead is Slurm's "no start time found", never shown as an estimate
    (datetime(2027, 12, 1, 14, 0), (1, 1, "gpu"),
     "Queued in Slurm as job 42 in partition gpu: 1st of 1 waiting for 2 GPUs; no estimate from Slurm yet"),
])  # fmt: skip
def test_wait_message(expected, position, words):
    info = JobInfo("42", "PENDING", "Resources", expected=expected)
    assert words in priority.wait_message(info, position, 2, NOW)


def test_wait_message_of_a_running_job_says_where():
    info = JobInfo("42", "RUNNING", nodes=("gpu-node1",))
    assert priority.wait_message(info, (1, 1, "gpu"), 2, NOW) == "Slurm job 42 running on gpu-node1"


# slurm.conf from gpuhub's traits -----------------------------------------------------------


@pytest.mark.parametrize("hours, text", [
    (168, "7-00:00:00"), (2, "02:00:00"), (0.5, "00:30:00"), (36.25, "1-12:15:00"), (0, "00:00:00"),
])  # fmt: skip
def test_slurm_duration(hours, text):
    assert priority.slurm_duration(hours) == text


@pytest.mark.parametrize("hours", [-1, float("nan"), float("inf")])
def test_slurm_duration_refuses(hours):
    with pytest.raises(ValueError):
        priority.slurm_duration(hours)


def test_slurm_priority_conf_follows_gpuhubs_weights():
    conf = priority.slurm_priority_conf(
        Weights(fairshare=2000, age=500, max_age_hours=4, half_life_hours=72), 1
    )
    assert conf == {
        "PriorityType": "priority/multifactor", "PriorityFlags": "NO_FAIR_TREE",
        "PriorityDecayHalfLife": "3-00:00:00", "PriorityMaxAge": "04:00:00", "PriorityCalcPeriod": "1",
        "PriorityWeightFairshare": "2000", "PriorityWeightAge": "500", "PriorityWeightJobSize": "0",
        "PriorityWeightPartition": "0", "PriorityWeightQOS": "0", "PriorityFavorSmall": "NO",
    }  # fmt: skip
    with pytest.raises(ValueError, match="whole minutes"):
        priority.slurm_priority_conf(Weights(), 0)


# the engines' job while it waits (gpu_magics.launch.slurm) ---------------------------------


def test_queue_line_of_the_engines_job():
    from gpu_magics.launch.slurm import queue_line

    got = listing(job(12, name="gpuhub-engines", start=1796134868), job(11, name="x", priority=900))
    line = queue_line(got, "12", 4, NOW)
    assert line.startswith("Queued in Slurm as engines job 12 in partition gpu: 2nd of 2 waiting for 4 GPUs")
    assert queue_line(listing(job(12, "RUNNING", name="gpuhub-engines")), "12", 4, NOW) is None
    assert queue_line(listing(), "12", 4, NOW) is None  # gone: the pool reports missing engines
    assert "Slurm does not answer" in queue_line(None, "12", 4, NOW)  # keeps waiting
    # a cluster that shows a user only their own jobs: no place among them is claimed
    hidden = queue_line(got, "12", 4, NOW, hidden=True)
    assert hidden.startswith(
        "Queued in Slurm as engines job 12 in partition gpu: waiting for 4 GPUs, expected"
    )
    assert "private on this cluster" in hidden and " of " not in hidden.split("Slurm's reason")[0], hidden


@pytest.mark.parametrize(
    "config, hidden",
    [
        ("PrivateData             = jobs,usage,users\n", True),
        ("ClusterName = gpuhub\nPrivateData = usage,jobs\n", True),
        ("PrivateData             = none\n", False),
        ("PrivateData = usage,users\n", False),
        ("ClusterName = gpuhub\n", False),  # not set: every job is visible
        (None, True),  # Slurm could not be asked: claim no place
    ],
)
def test_whether_slurm_hides_other_users_jobs(config, hidden):
    from gpu_magics.launch.slurm import jobs_hidden

    assert jobs_hidden(config) is hidden


def test_wait_in_queue_shows_each_new_line_once_and_returns_when_the_job_leaves(monkeypatch):
    from gpu_magics.launch import slurm as slurmengines

    slept = []
    monkeypatch.setattr(slurmengines.time, "sleep", slept.append)
    answers = iter([
        listing(job(12, name="gpuhub-engines")),
        listing(job(12, name="gpuhub-engines")),
        listing(job(12, name="gpuhub-engines", start=1796134868)),
        listing(job(12, "RUNNING", name="gpuhub-engines")),
    ])  # fmt: skip
    launcher = slurmengines.SlurmLauncher("job", 1, 4, "/tmp")
    launcher.job_id = "12"
    launcher.read_config = lambda: "PrivateData = none\n"
    shown = []
    launcher.wait_in_queue(shown.append, lambda: next(answers))
    assert len(shown) == 3 and "no estimate from Slurm yet" in shown[0] and "expected start" in shown[1]
    assert shown[2] == "Slurm job 12 left the queue; starting the engines"
    assert slept == [0.5, 1.0, 2.0]  # backing off towards QUEUE_POLL_MAX


def test_ctrl_c_while_waiting_leaves_through_the_caller():
    from gpu_magics.launch import slurm as slurmengines

    def interrupted():
        raise KeyboardInterrupt

    launcher = slurmengines.SlurmLauncher("job", 1, 4, "/tmp")
    launcher.job_id = "12"
    launcher.read_config = lambda: "PrivateData = none\n"
    with pytest.raises(KeyboardInterrupt):  # the pool's stop (scancel) and the magic's release follow
        launcher.wait_in_queue(lambda line: None, interrupted)


def test_the_cli_prints_the_priority_settings_and_names_a_bad_weight(tmp_path, capsys):
    import io

    from spawner import cli

    conf = tmp_path / "jupyterhub_config.py"
    conf.write_text("c.GpuHub.fairshare_half_life_hours = 72\nc.GpuHub.priority_weight_age = 500\n")
    out = io.StringIO()
    assert cli.run(cli.make_parser().parse_args(["--config", str(conf), "slurm", "priority"]), out=out) == 0
    assert "PriorityDecayHalfLife=3-00:00:00\n" in out.getvalue()
    assert "PriorityWeightAge=500\n" in out.getvalue()
    conf.write_text("c.GpuHub.priority_weight_age = -1\n")
    assert cli.main(["--config", str(conf), "slurm", "priority"]) == 2
    assert "c.GpuHub.priority_weight_age must be 0 or more" in capsys.readouterr().err


def test_wait_message_of_a_slice_says_its_share():
    info = JobInfo("42", "PENDING", "Resources", expected=None)
    assert "1st of 1 waiting for 1/4 GPU; no estimate from Slurm yet" in priority.wait_message(
        info, (1, 1, "gpu"), "1/4 GPU", NOW
    )
