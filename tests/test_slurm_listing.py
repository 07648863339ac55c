"""How the watcher reads gpuhub's jobs (``squeue --json``, or the text fallback with a token of
its own) and checks a job again before it cancels it; no cluster (fake squeue/scancel on PATH).
The same forgeries on the real cluster are in test_slurm_forgery.py."""

import json
from datetime import datetime

import pytest

from spawner.slurm import SlurmError, commands, squeue
from spawner.slurm.squeue import JobInfo, Listing

from . import test_slurm_units as units
from .test_slurm_units import cancelled, job_json, queued, write_jobs

fake = units.fake  # the fake squeue/scancel fixture

NAMES = ("gpuhub-server", "gpuhub-engines")
# bob's comment: a newline, then a line that reads as a job of carol's in the old text form
BOB = "gpuhub:99\n777|RUNNING|None|gpu-node1|carol|gpuhub-server|N/A|gpuhub:5"


def answer(*listed, errors=()):
    return json.dumps({"meta": {}, "errors": list(errors), "jobs": list(listed)})


def read(*listed):
    return squeue.parse_squeue_json(answer(*listed), NAMES)


def without(key, **kw):
    j = job_json(5, **kw)
    del j[key]
    return j


# squeue --json -------------------------------------------------------------------------


def test_a_json_job_and_its_gpus():
    start = int(datetime(2026, 11, 29, 18, 0).timestamp())
    got = read(
        job_json(
            5, comment="gpuhub:7", nodes="gpu-node[1-2]", gres=("gpu:a100:1(IDX:3)", "gpu:a100:2(IDX:0-1)")
        ),
        job_json(6, "PENDING", reason="Resources", start=start, name="gpuhub-engines", user="bob"),
        job_json(8, name="someone-elses", user="carol"),  # not gpuhub's: not listed, not a problem
    )
    assert got == Listing(
        {
            "5": JobInfo(
                "5",
                "RUNNING",
                "None",
                ("gpu-node1", "gpu-node2"),
                "alice",
                "gpuhub-server",
                "",
                "gpuhub:7",
                (("gpu-node1", 3), ("gpu-node2", 0), ("gpu-node2", 1)),
            ),
            "6": JobInfo(
                "6",
                "PENDING",
                "Resources",
                (),
                "bob",
                "gpuhub-engines",
                "2026-11-29T18:00:00",
                expected=squeue.epoch_utc(start),
            ),
        },
        queue=(squeue.QueuedJob("6", (), 0),),  # every pending job counts, whoever's
    )
    assert got.jobs["5"].allocation_id == 7 and got.jobs["6"].allocation_id is None


def test_newer_slurms_state_list_and_start_time_object_read_too():
    j = {**job_json(5), "job_state": ["RUNNING", "COMPLETING"], "start_time": {"set": False, "number": 0}}
    assert read(j).jobs["5"].state == "RUNNING" and read(j).jobs["5"].start_time == ""


# fmt: off
@pytest.mark.parametrize("listed, unreadable, words", [
    ([without("user_name")], {"5"}, "no readable user_name"),
    ([job_json(5, user="")], {"5"}, "no readable user_name"),
    ([job_json(5, user="al ice")], {"5"}, "no readable user_name"),
    ([without("job_state")], {"5"}, "no readable job_state"),
    ([{**job_json(5), "job_state": "running?"}], {"5"}, "no readable job_state"),
    ([{**job_json(5), "job_state": 3}], {"5"}, "no readable job_state"),
    ([{**job_json(5), "comment": ["x"]}], {"5"}, "no readable comment"),
    ([{**job_json(5), "nodes": "n1\nn2"}], {"5"}, "no readable nodes"),
    ([{**job_json(5), "nodes": "n[a-b]"}], {"5"}, "nodes gpuhub cannot read"),
    ([{**job_json(5), "gres_detail": "gpu:1"}], {"5"}, "no readable nodes and GRES"),
    ([job_json(5, nodes="n[1-2]", gres=("gpu:1(IDX:0)",))], {"5"}, "1 GRES entries for 2 nodes"),
    ([{**job_json(5), "start_time": "soon"}], {"5"}, "no readable start_time"),
    ([job_json(5), job_json(5, state="COMPLETED")], {"5"}, "lists job 5 twice"),
    ([job_json(5), job_json(5), job_json(5)], {"5"}, "lists job 5 twice"),
    ([{**job_json(5), "job_id": "5"}], set(), "entry 0 has no readable job_id"),
    ([{**job_json(5), "job_id": True}], set(), "entry 0 has no readable job_id"),
    ([{**job_json(5), "job_id": 0}], set(), "entry 0 has no readable job_id"),
    (["a job?"], set(), "entry 0 has no readable job_id"),
    ([{**job_json(5), "name": None}], {"5"}, "no readable name"),
])
def test_a_job_gpuhub_cannot_read_is_skipped_and_named_never_fatal(listed, unreadable, words):
    got = read(*listed, job_json(9, comment="gpuhub:2"))  # the other jobs are read as ever
    assert set(got.jobs) == {"9"} and got.unreadable == unreadable
    assert any(words in p for p in got.problems), got.problems
# fmt: on


@pytest.mark.parametrize(
    "text, words",
    [
        ("squeue: error: x", "cannot read"),
        (json.dumps({"jobs": {}}), "no list of jobs"),
        (json.dumps([]), "no list of jobs"),
        # slurmctld not answering: 22.05 exits 0 with this; never "every job is gone"
        (
            answer(errors=[{"description": "Failed while looking for jobs", "error_number": -1}]),
            "Failed while",
        ),
    ],
)
def test_an_answer_that_is_no_listing_is_an_error(text, words):
    with pytest.raises(SlurmError, match=words):
        squeue.parse_squeue_json(text, NAMES)


def test_a_comment_in_json_is_only_a_comment():
    got = read(job_json(12, user="bob", name="gpuhub-engines", comment=BOB), job_json(30, comment="gpuhub:1"))
    assert set(got.jobs) == {"12", "30"} and not got.unreadable and not got.problems
    assert got.jobs["12"].comment == BOB and got.jobs["12"].allocation_id is None  # no tag: nothing to attach


# the text fallback ----------------------------------------------------------------------


def render(fmt, job, **fields):
    """One record as squeue prints the format: the token's record marker, its separators, its end."""
    j = {**job, **fields}
    values = [str(j["job_id"]), j["job_state"], j["state_reason"], j["nodes"] or "(null)", j["user_name"],
              j["name"], "N/A", j["comment"] or "(null)"]  # fmt: skip
    return fmt.record + fmt.sep.join(values) + fmt.end + "\n"


FMT = squeue.TextFormat("0123456789abcdef0123456789abcdef")


def test_text_format_is_the_tokens_own_and_goes_in_the_environment():
    assert FMT.format == (
        "@R0123456789abcdef0123456789abcdef@%i@S0123456789abcdef0123456789abcdef@%T"
        + "".join(f"@S0123456789abcdef0123456789abcdef@{c}" for c in ("%r", "%N", "%u", "%j", "%S", "%k"))
        + "@E0123456789abcdef0123456789abcdef@"
    )
    assert commands.squeue_text_env(FMT, {"PATH": "/bin"}) == {"PATH": "/bin", "SQUEUE_FORMAT": FMT.format}
    assert squeue.TextFormat.new().token != squeue.TextFormat.new().token


def test_text_jobs_read():
    text = (
        render(FMT, job_json(5, comment="gpuhub:7", nodes="gpu-node[1-2]"))
        + render(FMT, job_json(6, "PENDING", reason="Resources", user="bob", name="gpuhub-engines"))
        + render(FMT, job_json(8, name="other"))
    )
    got = squeue.parse_squeue_text(text, FMT, NAMES)
    assert got == Listing(
        {
            "5": JobInfo(
                "5", "RUNNING", "None", ("gpu-node1", "gpu-node2"), "alice", "gpuhub-server", "", "gpuhub:7"
            ),
            "6": JobInfo("6", "PENDING", "Resources", (), "bob", "gpuhub-engines", ""),
        }
    )


ALICE = job_json(30, comment="gpuhub:1")
DUP = "gpuhub:2\n30|COMPLETED|None|gpu-node1|alice|gpuhub-server|N/A|gpuhub:1"


# fmt: off
@pytest.mark.parametrize("forged, unreadable", [
    # bob's exact comment: a newline and an imitation of the old one-line form
    (render(FMT, job_json(12, user="bob", name="gpuhub-engines", comment=BOB)), {"12"}),
    # a line repeating alice's job id (the old parser refused the whole answer: every cycle failed)
    (render(FMT, job_json(12, user="bob", name="gpuhub-engines", comment=DUP)), {"12"}),
    # a name with a newline or a bar
    (render(FMT, job_json(12, user="bob", name="gpuhub-engines\n30|x")), {"12"}),
    (render(FMT, job_json(12, user="bob", comment="gpuhub:2|x")), {"12"}),
    # a guess at the record's shape without the token
    (render(FMT, job_json(12, user="bob", comment="gpuhub:2@E@\n@R@30@S@COMPLETED")), {"12"}),
    # cut short, or two records run together
    (FMT.record + "12" + FMT.sep + "RUNNING\n", {"12"}),
    (render(FMT, job_json(12, user="bob")).replace(FMT.end, ""), {"12"}),
    (FMT.record + "x1" + FMT.sep * 7 + FMT.end + "\n", set()),
])
def test_text_a_job_whose_text_could_fake_a_record_is_refused(forged, unreadable):
    got = squeue.parse_squeue_text(render(FMT, ALICE) + forged, FMT, NAMES)
    assert got.jobs == {"30": squeue.parse_squeue_text(render(FMT, ALICE), FMT, NAMES).jobs["30"]}
    assert got.unreadable == unreadable and got.problems
# fmt: on


def test_text_around_the_records():
    got = squeue.parse_squeue_text("squeue: warning\n" + render(FMT, ALICE), FMT, NAMES)
    assert set(got.jobs) == {"30"} and "before its first job" in got.problems[0]
    got = squeue.parse_squeue_text(render(FMT, ALICE) + "more\n" + render(FMT, job_json(31)), FMT, NAMES)
    assert set(got.jobs) == {"31"} and got.unreadable == {"30"}  # no line of text is ever a record


def test_text_a_job_listed_twice_is_skipped():
    got = squeue.parse_squeue_text(render(FMT, ALICE) * 2 + render(FMT, job_json(31)), FMT, NAMES)
    assert set(got.jobs) == {"31"} and got.unreadable == {"30"} and "twice" in got.problems[0]


@pytest.mark.parametrize(
    "error, unsupported",
    [
        ("squeue failed (exit 1): squeue: unrecognized option '--json'", True),
        ("squeue failed (exit 1): squeue: invalid option -- 'json'", True),
        ("squeue failed (exit 1): squeue: error: cannot find serializer plugin for application/json", True),
        ("squeue failed (exit 1): slurm_load_jobs error: Unable to contact slurm controller", False),
        ("squeue took longer than 20 s", False),
    ],
)
def test_json_unsupported(error, unsupported):
    assert squeue.json_unsupported(error) is unsupported


# before a cancel ------------------------------------------------------------------------


def listed(*js, unreadable=()):
    return Listing({j.job_id: j for j in js}, frozenset(unreadable))


BOBS = JobInfo("12", "RUNNING", user="bob", name="gpuhub-engines", comment="gpuhub:4")


# fmt: off
@pytest.mark.parametrize("listing, why", [
    (listed(BOBS), None),
    (listed(JobInfo("12", "PENDING", user="bob", name="gpuhub-server", comment=" gpuhub:4 ")), None),
    (listed(), "Slurm does not list job 12 as one of gpuhub's"),
    (listed(unreadable={"12"}), "Slurm's listing of job 12 cannot be read"),
    (listed(JobInfo("12", "RUNNING", user="alice", name="gpuhub-engines", comment="gpuhub:4")),
     "job 12 belongs to 'alice', allocation 4 to 'bob'"),
    (listed(JobInfo("12", "RUNNING", user="bob", name="wrap", comment="gpuhub:4")),
     "job 12 is named 'wrap', not one of gpuhub's"),
    (listed(JobInfo("12", "RUNNING", user="bob", name="gpuhub-engines", comment="gpuhub:5")),
     "job 12's comment names allocation 5, not allocation 4"),
    (listed(JobInfo("12", "RUNNING", user="bob", name="gpuhub-engines", comment="mine")),
     "job 12's comment names no gpuhub allocation, not allocation 4"),
    (listed(JobInfo("12", "RUNNING", user="bob", name="gpuhub-engines", comment=BOB)),
     "job 12's comment names no gpuhub allocation, not allocation 4"),
    (listed(JobInfo("12", "CANCELLED", user="bob", name="gpuhub-engines", comment="gpuhub:4")),
     "job 12 ended already (cancelled)"),
])
def test_cancel_refusal(listing, why):
    assert commands.cancel_refusal(listing, "12", "bob", 4, NAMES) == why
# fmt: on


def test_scancel_runs_as_the_owner_and_filters_by_owner_and_name():
    assert commands.scancel_argv(["sudo", "-E", "-u", "bob"], BOBS) == [
        "sudo", "-E", "-u", "bob", "scancel", "--user=bob", "--name=gpuhub-engines", "12"]  # fmt: skip


# the watcher against fake commands -------------------------------------------------------


async def test_forged_comments_change_nothing_and_the_cycle_goes_on(fake):
    """bob's comment imitating carol's job 777 (tagged with carol's live allocation), and one
    repeating alice's job id as completed: JSON and text fallback alike decide nothing from them."""
    d, led, watcher = fake
    for _ in range(4):
        led.release(led.allocate("dave", [], 1, deferred=True, backend="slurm").id, "x")
    carol = led.allocate("carol", [], 1, deferred=True, backend="slurm")  # waits for its job id
    assert carol.id == 5
    mine = queued(led, "30", 2)
    bob = led.allocate("bob", [], 1, deferred=True, backend="slurm")
    led.attach_job(bob.id, "12")
    forged_dup = f"gpuhub:{bob.id}\n30|COMPLETED|None|gpu-node1|alice|gpuhub-server|N/A|gpuhub:{mine.id}"
    for json_ok in (True, False):
        write_jobs(
            d,
            job_json(30, comment=f"gpuhub:{mine.id}"),
            job_json(12, user="bob", name="gpuhub-engines", comment=BOB, gres=("gpu:a100:1(IDX:3)",)),
            job_json(13, user="bob", name="gpuhub-engines", comment=forged_dup, gres=("gpu:a100:1(IDX:0)",)),
            json_ok=json_ok,
        )
        watcher._json = None  # found out again
        for _ in range(2):
            await watcher.cycle()
            assert watcher.failures == 0
        assert watcher._json is json_ok
        assert cancelled(d) == [] and not watcher.refused
        got = led.get(mine.id)
        assert got.state == "running" and [g.label for g in got.gpus] == ["gpu-node1:1", "gpu-node1:2"]
        assert led.get(carol.id).backend_job_id is None and "777" not in watcher.jobs
        assert watcher.jobs["30"].state == "RUNNING"
        if json_ok:
            assert [g.label for g in led.get(bob.id).gpus] == ["gpu-node1:3"]  # bob's own, and only his
        else:
            assert watcher.unreadable == {"12", "13"}  # refused, their last state kept
            assert watcher.jobs["12"].comment == BOB
            assert led.get(bob.id).state == "running"


async def test_an_unreadable_job_keeps_its_allocation_and_its_last_state(fake):
    d, led, watcher = fake
    a = queued(led, "7", 2)
    write_jobs(d, job_json(7, comment=f"gpuhub:{a.id}"))
    await watcher.cycle()
    before = watcher.jobs["7"]
    write_jobs(
        d, {**job_json(7, comment=f"gpuhub:{a.id}"), "user_name": None}, job_json(8, state="COMPLETED")
    )
    await watcher.cycle()
    assert watcher.failures == 0 and watcher.unreadable == {"7"} and watcher.job("7") == ("known", before)
    assert led.get(a.id).state == "running"
    write_jobs(d, job_json(7, comment=f"gpuhub:{a.id}"), job_json(7, comment=f"gpuhub:{a.id}"))  # twice
    await watcher.cycle()
    assert watcher.failures == 0 and led.get(a.id).state == "running" and cancelled(d) == []


async def test_an_error_answer_is_a_failed_query_not_an_empty_cluster(fake):
    d, led, watcher = fake
    a = queued(led, "7", 2)
    write_jobs(d, errors=[{"description": "Failed while looking for jobs", "error_number": -1}])
    assert await watcher.cycle() is False
    assert watcher.failures == 1 and watcher._json is True and led.get(a.id).state == "starting"


async def test_a_cancel_is_checked_again_and_refused_when_the_job_is_not_the_one_expected(fake, monkeypatch):
    d, led, watcher = fake
    released = queued(led, "9", 1)
    led.release(released.id, "lease expired")
    write_jobs(d, job_json(9, name="gpuhub-engines", comment=f"gpuhub:{released.id}"))
    real_read = watcher.read_jobs
    reads = []

    async def read_jobs():
        reads.append(1)
        if len(reads) == 2:  # the re-read before scancel: job 9 is now carol's (an id reused)
            write_jobs(d, job_json(9, user="carol", name="gpuhub-engines", comment=f"gpuhub:{released.id}"))
        return await real_read()

    monkeypatch.setattr(watcher, "read_jobs", read_jobs)
    await watcher.cycle()
    assert len(reads) == 2 and cancelled(d) == [] and list(watcher.cancelled) == []
    assert watcher.refused[-1] == ("9", f"job 9 belongs to 'carol', allocation {released.id} to 'alice'")
    write_jobs(d, job_json(9, name="gpuhub-engines", comment=f"gpuhub:{released.id}", user="carol"))
    await watcher.cycle()  # carol's job 9 is no orphan of alice's allocation: not even planned
    assert len(reads) == 3 and cancelled(d) == []
    write_jobs(d, job_json(9, name="gpuhub-engines", comment=f"gpuhub:{released.id}"))
    await watcher.cycle()
    assert cancelled(d) == ["--user=alice --name=gpuhub-engines 9"]


async def test_scancel_goes_through_the_owners_prefix(fake):
    d, led, watcher = fake
    (d / "as").write_text(f'#!/bin/sh\necho "as $1" >> {d / "scancel.log"}\nshift\nexec "$@"\n')
    (d / "as").chmod(0o755)
    watcher.exec_prefix = "as {username}"
    released = queued(led, "9", 1)
    led.release(released.id, "lease expired")
    write_jobs(d, job_json(9, name="gpuhub-engines", comment=f"gpuhub:{released.id}"))
    await watcher.cycle()
    assert cancelled(d) == ["as alice", "--user=alice --name=gpuhub-engines 9"]


def test_the_watchers_prefix_defaults_to_the_spawners():
    from traitlets.config import Config

    from spawner.slurm.watcher import SlurmWatcher

    c = Config()
    assert SlurmWatcher(lambda: None, config=c).cancel_prefix("bob") == ["sudo", "-E", "-u", "bob"]
    c.SlurmSpawner.exec_prefix = "sudo -u {username} --"
    assert SlurmWatcher(lambda: None, config=c).cancel_prefix("bob") == ["sudo", "-u", "bob", "--"]
    c.GpuSlurmSpawner.exec_prefix = ""
    assert SlurmWatcher(lambda: None, config=c).cancel_prefix("bob") == []
    c.SlurmWatcher.exec_prefix = "run-as {username}"
    assert SlurmWatcher(lambda: None, config=c).cancel_prefix("bob") == ["run-as", "bob"]
