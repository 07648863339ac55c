"""Slurm backend units without a cluster: parsers, batch scripts (golden files), accounting plans,
the watcher's decisions, and one watcher cycle against fake squeue/scancel on PATH."""

import json
import os
import shlex
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from traitlets.config import Config

from spawner.ledger import Ledger
from spawner.policy.limits import EffectiveLimit, Limit, LimitRules
from spawner.policy.placement import Gpu
from spawner.policy.records import AllocationInfo
from spawner.slurm import SlurmError, accounting, commands, script, sinfo, squeue
from spawner.slurm.reconcile import orphans, reconcile
from spawner.slurm.sinfo import GresEntry
from spawner.slurm.squeue import JobInfo
from spawner.slurm.watcher import SlurmWatcher

GOLDEN = Path(__file__).parent / "golden"


# sinfo.py, squeue.py, commands.py: parsers ----------------------------------------------------


def gres(args):
    return commands.gres_request(*args)


HL, IDX, GRES = sinfo.expand_hostlist, sinfo.parse_index_list, sinfo.parse_gres
SB = commands.parse_sbatch
N1 = "gpu-node1"
SQUEUE_TEXT = ["squeue", "-h", "-a", "-t", "all", "--name", "gpuhub-engines,gpuhub-server"]


# fmt: off
@pytest.mark.parametrize("fn, arg, want", [
    (HL, "gpu-node1", ["gpu-node1"]),
    (HL, "gpu-node[1-3]", ["gpu-node1", "gpu-node2", "gpu-node3"]),
    (HL, "gpu-node[1-2,4],login01", ["gpu-node1", "gpu-node2", "gpu-node4", "login01"]),
    (HL, "n[01-03]", ["n01", "n02", "n03"]),
    (HL, "n[08-10]", ["n08", "n09", "n10"]),
    (HL, "a[1-2],b[9-10],c", ["a1", "a2", "b9", "b10", "c"]),
    (HL, "n[1-2]-ib[0-1]", ["n1-ib0", "n1-ib1", "n2-ib0", "n2-ib1"]),
    (IDX, "0", [0]), (IDX, "0-1,3", [0, 1, 3]), (IDX, "", []),
    (GRES, "gpu:a100:4", [GresEntry("a100", 4)]),
    (GRES, "gpu:2", [GresEntry(None, 2)]),
    (GRES, "gpu:a100:4(S:0-1)", [GresEntry("a100", 4)]),
    (GRES, "mps:100,gpu:v100:1(S:0,1),shard:8", [GresEntry("v100", 1)]),
    (GRES, "gpu:a100:4(S:0),gpu:2", [GresEntry("a100", 4), GresEntry(None, 2)]),
    (GRES, "(null)", []),
    (gres, (2, "a100"), "gpu:a100:2"), (gres, (1, None), "gpu:1"),
    (SB, "12", "12"), (SB, "12;cluster\n", "12"), (SB, "warning: x\n13\n", "13"),
    (commands.squeue_text_argv, ["gpuhub-server", "gpuhub-engines"], SQUEUE_TEXT),
])
def test_pure(fn, arg, want):
    assert fn(arg) == want


@pytest.mark.parametrize("fn, arg, error",
    [(gres, a, ValueError) for a in [(0, None), (True, None), (-1, "a"), (2.0, None), (1, "a 1"), (1, "")]]
    + [(SB, out, SlurmError) for out in ["", "\n", "Submitted batch job 12", "sbatch: error: failed"]]
    + [(sinfo.parse_sinfo, "node1|gpu:4|gpu\n", SlurmError)]
    + [(script.export_list, {"PATH": "/bin", bad: "x"}, ValueError) for bad in ["A B", "1X", "A;", "A=", ""]],
)
def test_refused(fn, arg, error):
    with pytest.raises(error):
        fn(arg)
# fmt: on


def test_parse_sinfo_cluster_partitions_and_inventory():
    c = sinfo.parse_sinfo(
        "gpu-node1|gpu:a100:4(S:0)|gpu*|idle\ngpu-node1|gpu:a100:4(S:0)|all|idle\n"
        "gpu-node2|gpu:2,gpu:v100:1|all|mix\ncpu-node1|(null)|all|idle*\n"
    )
    assert c.partitions == ("gpu", "all") and c.default_partition == "gpu"
    assert [(n.name, n.partitions, n.state) for n in c.nodes] == [("cpu-node1", ("all",), "idle"),
        ("gpu-node1", ("gpu", "all"), "idle"), ("gpu-node2", ("all",), "mix")]  # fmt: skip
    assert (c.partition_nodes("gpu"), c.partition_nodes("nope")) == ({"gpu-node1"}, set())
    assert c.partition_nodes("all") == {"cpu-node1", "gpu-node1", "gpu-node2"}
    # indices run on across gres entries, in gres.conf order; untyped GPUs get the given model
    gpus = c.nodes[2].gpus("T4")
    assert [f"{g.label}={g.model}" for g in gpus] == ["gpu-node2:0=T4", "gpu-node2:1=T4", "gpu-node2:2=v100"]
    assert [f"{g.label}={g.model}" for g in c.inventory()] == [f"gpu-node1:{i}=a100" for i in range(4)] + [
        "gpu-node2:0=GPU", "gpu-node2:1=GPU", "gpu-node2:2=v100"]  # fmt: skip
    assert sinfo.parse_sinfo("").default_partition is None


FORGED = "gpuhub:97\n     Nodes=gpu-node2 CPU_IDs=0 Mem=1 GRES=gpu:a100:1(IDX:3)"


def squeue_json(*jobs_):
    return json.dumps({"jobs": [dict(j) for j in jobs_]})


@pytest.mark.parametrize(
    "listing, job_id, gpus",
    [
        (
            squeue_json({"job_id": 5, "nodes": "n1", "gres_detail": ["gpu:a100:2(IDX:2-3)"]}),
            "5",
            [("n1", 2), ("n1", 3)],
        ),
        (
            squeue_json(
                {"job_id": 6, "nodes": "n[1-2]", "gres_detail": ["gpu:a100:1(IDX:0)", "gpu:a100:2(IDX:1,3)"]}
            ),
            "6",
            [("n1", 0), ("n2", 1), ("n2", 3)],
        ),
        (
            squeue_json({"job_id": 7, "nodes": "n1", "gres_detail": ["gpu:2(IDX:0-1)"]}),
            "7",
            [("n1", 0), ("n1", 1)],
        ),
        (squeue_json({"job_id": 8, "nodes": "", "gres_detail": []}), "8", []),  # pending: no GPUs yet
        # a comment (or any field) imitating scontrol's GRES line adds nothing
        (squeue_json({"job_id": 9, "nodes": "n1", "gres_detail": [], "comment": FORGED}), "9", []),
        (
            squeue_json(
                {"job_id": 1, "nodes": "n2", "gres_detail": ["gpu:a100:4(IDX:0-3)"]},
                {"job_id": 9, "nodes": "n1", "gres_detail": ["gpu:a100:1(IDX:0)"], "comment": FORGED},
            ),
            "9",
            [("n1", 0)],
        ),
    ],
)
def test_a_jobs_gpus_come_from_squeue_json(listing, job_id, gpus):
    assert squeue.parse_job_gpus_json(listing, job_id) == gpus


@pytest.mark.parametrize(
    "listing, words",
    [
        ("not json", "cannot read"),
        (json.dumps({"no": "jobs"}), "cannot read"),
        (squeue_json({"job_id": 4, "nodes": "n1", "gres_detail": []}), "lists job 9 0 times"),
        (squeue_json({"job_id": 9, "nodes": "n1"}, {"job_id": 9, "nodes": "n2"}), "lists job 9 2 times"),
        (
            squeue_json({"job_id": 9, "nodes": "n[1-2]", "gres_detail": ["gpu:1(IDX:0)"]}),
            "1 GRES entries for 2 nodes",
        ),
        (squeue_json({"job_id": 9, "nodes": 3, "gres_detail": "gpu"}), "no readable nodes"),
    ],
)
def test_a_job_listing_gpuhub_cannot_trust_is_an_error_not_a_guess(listing, words):
    with pytest.raises(SlurmError, match=words):
        squeue.parse_job_gpus_json(listing, "9")


def test_sbatch_never_requeues_and_tags_its_allocation():
    assert commands.sbatch_argv(7) == ["sbatch", "--parsable", "--no-requeue", "--comment=gpuhub:7"]


@pytest.mark.parametrize(
    "comment, allocation_id",
    [("gpuhub:7", 7), (" gpuhub:12 ", 12), ("gpuhub:0", None), ("gpuhub:x", None), ("gpuhub:", None),
     ("mine", None), ("", None), ("GPUHUB:7", None), ("gpuhub:\u00b2", None), ("gpuhub:07", None),
     ("gpuhub:7 more", None)],
)  # fmt: skip
def test_a_jobs_gpuhub_tag(comment, allocation_id):
    assert JobInfo("1", "RUNNING", comment=comment).allocation_id == allocation_id


# fmt: off
@pytest.mark.parametrize("job, flags, text", [
    (JobInfo("12", "PENDING", "Resources", start_time="2026-11-29T18:00"), "P",
     "Queued in Slurm as job 12 (Resources), expected start 2026-11-29T18:00"),
    (JobInfo("12", "PENDING", "None", start_time="N/A"), "P", "Queued in Slurm as job 12 (waiting)"),
    (JobInfo("12", "REQUEUED", "Priority", start_time="Unknown"),
     "P", "Queued in Slurm as job 12 (Priority)"),
    (JobInfo("13", "RUNNING", nodes=("n1", "n2")), "R", "Slurm job 13 running on n1, n2"),
    (JobInfo("13", "COMPLETING", nodes=("n1",)), "R", "Slurm job 13 running on n1"),
    *[(JobInfo("14", s), "E", f"Slurm job 14 ended ({s.lower()})")
      for s in ("COMPLETED", "TIMEOUT", "FAILED")],
])
def test_job_states_and_describe(job, flags, text):
    assert (job.pending, job.running, job.ended) == (flags == "P", flags == "R", flags == "E")
    assert job.describe() == text
# fmt: on


# script.py: golden files and refused injections ------------------------------------------


def check_golden(name: str, text: str) -> None:
    """Compare with tests/golden/NAME; GPUHUB_REGEN_GOLDEN=1 rewrites the file first."""
    path = GOLDEN / name
    if os.environ.get("GPUHUB_REGEN_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text(), f"{name} changed; rerun with GPUHUB_REGEN_GOLDEN=1 if that is intended"


# fmt: off
SERVER = dict(
    user="alice", job_name="gpuhub-server", output="/home/alice/.gpuhub-server-%j.log", homedir="/home/alice",
    export=script.export_list({"PATH": "/usr/bin", "JUPYTERHUB_API_TOKEN": "s3cret", "JUPYTERHUB_USER": "a"}),
    gres="gpu:a100:2", partition="gpu", cpus=4, memory="", runtime="8:00:00", account="",
    directives=["--qos=interactive"], prologue="module load cuda",
    command=["/opt/venv/bin/batchspawner-singleuser", "/opt/venv/bin/jupyterhub-singleuser", "--debug"],
)
ENGINES = dict(
    user="alice", job_name="gpuhub-engines", output="/home/alice/.gpuhub-engines-%j.log",
    workdir="/home/alice", nodes=2, per_node=4, gres="gpu:a100:4", partition="gpu", cpus=8, memory="16G",
    account="research", runtime="480",
    directives=["--qos=interactive", "--exclusive"],
    command=["/opt/venv/bin/python", "-m", "ipyparallel.engine", "--profile-dir=/home/alice/my dir", "$HOME"],
)


@pytest.mark.parametrize("name, template, values", [
    ("server.sbatch", script.SERVER_TEMPLATE, SERVER),
    ("server-0gpus.sbatch", script.SERVER_TEMPLATE, {**SERVER, "gres": ""}),
    ("engines.sbatch", script.ENGINES_TEMPLATE, ENGINES),
])
def test_rendered_scripts_match_golden_files(name, template, values):
    text = script.render(template, **values)
    check_golden(name, text)
    lines = text.splitlines()
    assert "s3cret" not in text and lines[-1].startswith("exec ")
    if name == "server-0gpus.sbatch":
        assert "export CUDA_VISIBLE_DEVICES=  # no GPUs asked for: hide any the node has" in lines
        assert not any(line.startswith("#SBATCH --gres") for line in lines)
    else:
        assert f"#SBATCH --gres={values['gres']}" in lines and "CUDA_VISIBLE_DEVICES" not in text
    cmd = values["command"]
    assert shlex.split(lines[-1])[-len(cmd) :] == cmd  # quoted for the shell, word by word
# fmt: on


@pytest.mark.parametrize("key", ["user", "output", "gres", "partition", "memory", "account", "runtime"])
@pytest.mark.parametrize("value", ["a b", "a\nb", "gpu\n", "a;b", "a$b", "a'b", 'a"b', "a`b", "a\\b"])
def test_render_refuses_a_value_that_is_not_one_word(key, value):
    with pytest.raises(ValueError, match=key):
        script.render(script.SERVER_TEMPLATE, **{**SERVER, key: value})


@pytest.mark.parametrize(
    "line", ["--qos=a --x", "#SBATCH --x", "qos=high", "--qos=a\n#SBATCH --x", "--q=$X", "--"]
)
def test_render_refuses_a_directive_that_is_not_one_option(line):
    with pytest.raises(ValueError, match="one option"):
        script.render(script.SERVER_TEMPLATE, **{**SERVER, "directives": [line]})


# accounting.py ---------------------------------------------------------------------------


def test_parse_associations():
    text = "|gpuhub|\nalice|gpuhub|cpu=4,gres/gpu=2\nbob|gpuhub|\ncarol|gpuhub|gres/gpu=-1,mem=1G\njunk\n"
    assert {u: (a.user, a.account, a.gpus) for u, a in accounting.parse_associations(text).items()} == {
        "alice": ("alice", "gpuhub", 2),
        "bob": ("bob", "gpuhub", -1),
        "carol": ("carol", "gpuhub", -1),
    }


def eff(max_gpus):
    return EffectiveLimit(Limit(max_gpus=max_gpus), "default")


@pytest.mark.parametrize("max_gpus, want", [(2, 2), (0, 0), (None, -1)])
def test_wanted_gpus(max_gpus, want):
    assert accounting.wanted_gpus(eff(max_gpus)) == want


ADD = "sacctmgr -i add user alice Account=gpuhub".split()


def modify(n):
    return [*"sacctmgr -i modify user where name=alice account=gpuhub set".split(), f"GrpTRES=gres/gpu={n}"]


@pytest.mark.parametrize(
    "max_gpus, current, commands",
    [
        (2, None, [ADD, modify(2)]),
        (None, None, [ADD, modify(-1)]),
        (2, 2, []),
        (None, -1, []),
        (3, 2, [modify(3)]),
        (None, 2, [modify(-1)]),
        (0, -1, [modify(0)]),
    ],
)
def test_plan(max_gpus, current, commands):
    have = {} if current is None else {"alice": accounting.Association("alice", "gpuhub", current)}
    assert accounting.plan({"alice": eff(max_gpus)}, have, "gpuhub") == commands


def set_tres(tres):
    return [*"sacctmgr -i modify user where name=alice account=gpuhub set".split(), f"GrpTRES={tres}"]


@pytest.mark.parametrize(
    "max_gpus, current, per_gpu, commands",
    [
        (2, None, 4, [ADD, set_tres("gres/gpu=2,gres/shard=8")]),  # slices: the limit in shards too
        (None, None, 4, [ADD, set_tres("gres/gpu=-1,gres/shard=-1")]),
        (2, (2, None, 8), 4, []),
        (2, (2, None, -1), 4, [set_tres("gres/shard=8")]),
        (3, (2, None, 8), 4, [set_tres("gres/gpu=3,gres/shard=12")]),
        (0, (-1, None, -1), 2, [set_tres("gres/gpu=0,gres/shard=0")]),
        (2, (2, None, 5), None, []),  # nothing split: the shard limit is the operator's
    ],
)
def test_plan_writes_the_limit_in_shards_where_gpus_are_split(max_gpus, current, per_gpu, commands):
    have = {} if current is None else {"alice": accounting.Association("alice", "gpuhub", *current)}
    assert accounting.plan({"alice": eff(max_gpus)}, have, "gpuhub", None, per_gpu) == commands


def test_parse_associations_reads_the_shard_limit():
    got = accounting.parse_associations("alice|gpuhub|gres/gpu=2,gres/shard=8\nbob|gpuhub|gres/gpu=1\n")
    assert (got["alice"].gpus, got["alice"].shards, got["bob"].shards) == (2, 8, -1)


@pytest.mark.parametrize(
    "user, account, words",
    [
        ("a,b", "gpuhub", "which has ','"),
        ("a=b", "gpuhub", "which has '='"),
        ("alice bob", "gpuhub", "which has ' '"),
        ("al\nice", "gpuhub", "which has '\\n'"),
        ("a'b", "gpuhub", 'which has "\'"'),
        ("", "gpuhub", "Slurm user name must be"),
        ("-i", "gpuhub", "starts with '-'"),
        ("alice", "gpu,hub", "Slurm account name"),
        ("alice", "gpu=hub", "Slurm account name"),
    ],
)
def test_plan_refuses_a_name_sacctmgr_would_misread(user, account, words):
    with pytest.raises(SlurmError, match="not written to Slurm's accounting") as e:
        accounting.plan({"ok": eff(1), user: eff(2)}, {}, account)
    assert words in str(e.value)


def test_sync_writes_the_others_then_names_the_refused(monkeypatch):
    ran = []
    acc = accounting.SlurmAccounting(enabled=True)
    monkeypatch.setattr(acc, "_run", lambda argv: ran.append(argv) or "")

    class FakeLedger:
        def effective_limits(self, users=None):
            return {"alice": eff(2), "a,b=c": eff(1), "-x": eff(1)}

        def known_groups(self, users):
            return {u: [] for u in users}

    with pytest.raises(SlurmError) as e:
        acc.sync(FakeLedger())
    assert "'a,b=c'" in str(e.value) and "'-x'" in str(e.value)
    assert [argv for argv in ran if "show" not in argv] == [ADD, [*modify(2), "Fairshare=1"]]
    assert not any("a,b=c" in part or part == "-x" for argv in ran for part in argv)


@pytest.fixture(autouse=True)
def _nothing_verified():
    """Each test starts with nothing remembered of Slurm's accounting (a per-process memo)."""
    accounting.SlurmAccounting.forget()
    yield
    accounting.SlurmAccounting.forget()


class FakeSacctmgr:
    """Slurm's associations as sacctmgr keeps them: ``show assoc`` reads them, ``add user`` and
    ``modify user ... set GrpTRES= Fairshare=`` change them; every call is recorded."""

    def __init__(self):
        self.assoc: dict[str, dict[str, str]] = {}
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(argv)
        if argv[:4] == ["sacctmgr", "-n", "-P", "show"]:
            return "\n".join(
                f"{u}|gpuhub|{a.get('GrpTRES', '')}|{a.get('Fairshare', '1')}" for u, a in self.assoc.items()
            )
        if argv[2:4] == ["add", "user"]:
            self.assoc.setdefault(argv[4], {})
        elif argv[2:4] == ["modify", "user"]:
            user = argv[5].removeprefix("name=")
            for part in argv[argv.index("set") + 1 :]:
                key, _, value = part.partition("=")  # GrpTRES=gres/gpu=2, Fairshare=1
                self.assoc[user][key] = value
        return ""

    def reads(self) -> int:
        return sum(1 for argv in self.calls if "show" in argv)


def test_a_users_association_once_verified_is_not_read_again_until_it_may_have_changed(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(accounting.time, "monotonic", lambda: clock[0])
    slurm = FakeSacctmgr()
    limit = {"alice": eff(2)}

    class FakeLedger:
        def effective_limits(self, users=None):
            return dict(limit)

        def known_groups(self, users):
            return {u: [] for u in users}

    acc = accounting.SlurmAccounting(enabled=True, borrow_qos="", verified_seconds=300)
    monkeypatch.setattr(acc, "_run", slurm)
    acc.sync(FakeLedger())  # first seen: read, added, limit written
    assert slurm.reads() == 1 and slurm.assoc["alice"]["GrpTRES"] == "gres/gpu=2"
    acc.sync(FakeLedger())
    clock[0] += 299
    acc.sync(FakeLedger())
    assert slurm.reads() == 1  # the next jobs within 300 s: sacctmgr is not asked at all
    limit["alice"] = eff(3)  # a new limit is written at once, whatever the memo says
    acc.sync(FakeLedger())
    assert slurm.reads() == 2 and slurm.assoc["alice"]["GrpTRES"] == "gres/gpu=3"
    limit["alice"] = eff(2)  # and back: the memo of "2" is not taken for what Slurm says now
    acc.sync(FakeLedger())
    assert slurm.reads() == 3 and slurm.assoc["alice"]["GrpTRES"] == "gres/gpu=2"
    # an operator's sacctmgr outside gpuhub: seen once verified_seconds have passed ...
    slurm.assoc["alice"]["GrpTRES"] = "gres/gpu=7"
    clock[0] += 299
    acc.sync(FakeLedger())
    assert slurm.assoc["alice"]["GrpTRES"] == "gres/gpu=7"
    clock[0] += 2
    acc.sync(FakeLedger())
    assert slurm.reads() == 4 and slurm.assoc["alice"]["GrpTRES"] == "gres/gpu=2"
    # ... or at once when forgotten (a job Slurm refused); 0 reads before every job
    slurm.assoc["alice"]["GrpTRES"] = "gres/gpu=7"
    accounting.SlurmAccounting.forget("alice")
    acc.sync(FakeLedger())
    assert slurm.reads() == 5 and slurm.assoc["alice"]["GrpTRES"] == "gres/gpu=2"
    every = accounting.SlurmAccounting(enabled=True, borrow_qos="", verified_seconds=0)
    monkeypatch.setattr(every, "_run", slurm)
    every.sync(FakeLedger())
    every.sync(FakeLedger())
    assert slurm.reads() == 7


# watcher.py: decisions -------------------------------------------------------------------

NOW = datetime(2026, 11, 1, 12, 0)


def alloc(
    job_id="7",
    count=2,
    gpus=0,
    minutes=1,
    state="starting",
    end_reason=None,
    id=1,
    user="alice",
    ended_minutes=1,
):
    return AllocationInfo(
        id=id, user=user, purpose="server", server_name="", state=state,
        created=NOW - timedelta(minutes=minutes), started=None,
        ended=NOW - timedelta(minutes=ended_minutes) if state == "released" else None, backend="slurm",
        backend_job_id=job_id, end_reason=end_reason,
        gpus=tuple(Gpu("gpu-node1", i, "a100") for i in range(gpus)), gpu_count=count,
    )  # fmt: skip


def listing(job_id="7", state="RUNNING", comment="", user="alice"):
    return {job_id: JobInfo(job_id, state, user=user, comment=comment)}


# fmt: off
@pytest.mark.parametrize("a, listed, expected", [
    (alloc(None, minutes=4), {}, None),
    (alloc(None, minutes=5), {}, None),
    (alloc(None, minutes=6), {}, ("release", None, "never reached Slurm (hub stopped while submitting)")),
    # its job id never reached the ledger, but the job carries the allocation's tag
    (alloc(None, minutes=9), listing("8", comment="gpuhub:1"), ("attach", "8", "found by its gpuhub tag")),
    (alloc(None), listing("8", "PENDING", comment="gpuhub:1"), ("attach", "8", "found by its gpuhub tag")),
    (alloc(None), {**listing("8", comment="gpuhub:1"), **listing("9", comment="gpuhub:1")}, None),
    (alloc(None, minutes=9), listing("8", comment="gpuhub:1", user="bob"),
     ("release", None, "never reached Slurm (hub stopped while submitting)")),
    (alloc(None, minutes=9), listing("8", "COMPLETED", comment="gpuhub:1"),
     ("release", None, "never reached Slurm (hub stopped while submitting)")),
    (alloc(), {}, ("release", "7", "Slurm job 7 is gone")),
    (alloc(), listing("8"), ("release", "7", "Slurm job 7 is gone")),
    (alloc(), listing(state="COMPLETED"), ("release", "7", "Slurm job 7 ended (completed)")),
    (alloc(gpus=2), listing(state="CANCELLED"), ("release", "7", "Slurm job 7 ended (cancelled)")),
    (alloc(), listing(state="TIMEOUT"), ("release", "7", "Slurm job 7 ended (timeout)")),
    (alloc(), listing(), ("record", "7", "")),
    (alloc(gpus=1), listing(), ("record", "7", "")),
    (alloc(gpus=2), listing(), None),
    (alloc(), listing(state="PENDING"), None),
])
def test_reconcile(a, listed, expected):
    actions = reconcile([a], listed, NOW)
    assert [(x.kind, x.job_id, x.reason) for x in actions] == ([] if expected is None else [expected])
    assert all(x.allocation is a for x in actions)
# fmt: on


RELEASED = alloc(state="released", end_reason="lease expired")
GONE = "its allocation was released (lease expired)"


# fmt: off
@pytest.mark.parametrize("live, others, listed, want", [
    # by job id: a released allocation's job still in Slurm
    ([], [RELEASED], listing(), [("cancel", "7", GONE)]),
    ([], [RELEASED], listing(state="PENDING"), [("cancel", "7", GONE)]),
    ([], [RELEASED], listing(state="COMPLETED"), []),
    ([], [RELEASED], {}, []),
    ([], [RELEASED], listing(user="bob"), []),  # the same id, another user's job: never touched
    ([], [alloc(state="released", end_reason="x", ended_minutes=3000)], listing(), []),  # ids wrap around
    # by tag: the job of a released allocation whose id never reached the ledger
    ([], [alloc(None, state="released", end_reason="spawn cancelled")], listing("9", comment="gpuhub:1"),
     [("cancel", "9", "its allocation was released (spawn cancelled)")]),
    ([], [alloc(None, id=2, state="starting")], listing("9", comment="gpuhub:2"), []),  # live, attaching
    ([alloc("7")], [], listing("9", comment="gpuhub:1"), [("cancel", "9", "allocation 1 runs job 7")]),
    ([alloc(None)], [], listing("9", comment="gpuhub:1"), []),
    ([alloc("9")], [], listing("9", comment="gpuhub:1"), []),
    ([alloc("7")], [], listing("9", comment="gpuhub:1", user="bob"), []),
    ([], [], listing("9", comment="gpuhub:5"), []),  # an allocation this ledger does not know
])
def test_orphans(live, others, listed, want):
    listed = {**listed, "8": JobInfo("8", "RUNNING", user="alice")}  # an untagged unknown job never matters
    assert [(x.kind, x.job_id, x.reason) for x in orphans(live, others, listed, NOW)] == want
# fmt: on


# watcher.py: one cycle against fake Slurm commands ---------------------------------------


def job_json(job_id, state="RUNNING", user="alice", name="gpuhub-server", comment="", nodes="gpu-node1",
             gres=("gpu:a100:2(IDX:1-2)",), reason="None", start=0):  # fmt: skip
    """One job as Slurm 22.05's ``squeue --json`` shows it."""
    running = state in squeue.RUNNING_STATES
    return {
        "job_id": int(job_id), "job_state": state, "user_name": user, "name": name, "comment": comment,
        "nodes": nodes if state not in squeue.PENDING_STATES else "", "start_time": start,
        "state_reason": reason, "gres_detail": list(gres) if running else [],
    }  # fmt: skip


FAKE_SQUEUE = r"""
import json, os, re, sys
d = sys.argv[0].rsplit("/", 1)[0]
if os.path.exists(d + "/down"):
    sys.exit(1)
data = json.load(open(d + "/jobs.json"))
if "--json" in sys.argv:
    if not data["json"]:
        sys.exit("squeue: unrecognized option '--json'\nTry \"squeue --help\" for more information")
    print(json.dumps({"meta": {}, "errors": data["errors"], "jobs": data["jobs"]}))
    sys.exit()
names = sys.argv[sys.argv.index("--name") + 1].split(",")
keys = dict(i="job_id", T="job_state", r="state_reason", N="nodes", u="user_name", j="name", k="comment")
def field(job, code):
    if code == "S":
        return "N/A"
    value = str(job.get(keys[code]) or "")
    return value or ("(null)" if code in "Nk" else "")
for job in data["jobs"]:
    if job["name"] in names:
        print(re.sub("%([iTrNujSk])", lambda m: field(job, m.group(1)), os.environ["SQUEUE_FORMAT"]))
"""


def write_jobs(d, *listed, json_ok=True, errors=()):
    """What the fake squeue lists next: as JSON, or (``json_ok=False``) only as text."""
    (d / "jobs.json").write_text(json.dumps({"jobs": list(listed), "json": json_ok, "errors": list(errors)}))


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """squeue lists jobs.json's jobs (``write_jobs``), as JSON or in the text form its
    SQUEUE_FORMAT asks for, and exits 1 while `down` exists; scancel appends its arguments
    to scancel.log. The watcher runs scancel with no prefix."""
    q = shlex.quote
    (tmp_path / "squeue").write_text(f"#!{sys.executable}\n{FAKE_SQUEUE}")
    (tmp_path / "scancel").write_text(f'#!/bin/sh\necho "$@" >> {q(str(tmp_path / "scancel.log"))}\n')
    for name in ("squeue", "scancel"):
        (tmp_path / name).chmod(0o755)
    write_jobs(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    led = Ledger(f"sqlite:///{tmp_path}/l.sqlite", config_rules=LimitRules(default=Limit(max_gpus=4)))
    led.sync_inventory([Gpu("gpu-node1", i, "a100") for i in range(4)])
    watcher = SlurmWatcher(lambda: led, exec_prefix="")
    monkeypatch.setattr(watcher, "start", lambda: None)  # cycles run only when a test awaits one
    yield tmp_path, led, watcher
    led.close()


def cancelled(d):
    log = d / "scancel.log"
    return log.read_text().splitlines() if log.exists() else []


def queued(led, job_id, count=2):
    a = led.allocate("alice", [], count, deferred=True, backend="slurm")
    return led.attach_job(a.id, job_id)


def labels(info):
    return [g.label for g in info.gpus]


async def test_watcher_records_the_gpus_of_a_started_job(fake):
    d, led, watcher = fake
    a = queued(led, "7")
    write_jobs(d, job_json(7, comment=f"gpuhub:{a.id}"))
    assert await watcher.cycle() is True
    got = led.get(a.id)
    assert (got.state, labels(got), got.backend_job_id) == ("running", ["gpu-node1:1", "gpu-node1:2"], "7")
    assert await watcher.cycle() is False  # nothing left to do


async def test_watcher_keeps_its_state_through_an_outage_then_releases_what_is_gone(fake):
    d, led, watcher = fake
    a = queued(led, "7")
    watcher.track("7")
    write_jobs(d, job_json(7, "PENDING", reason="Resources", comment=f"gpuhub:{a.id}"))
    assert await watcher.cycle() is True
    before = dict(watcher.jobs)
    assert watcher.job("7") == ("known", before["7"]) and before["7"].pending
    watcher.track("8")  # submitted after the last successful query
    (d / "down").touch()
    for n in (1, 2):
        assert await watcher.cycle() is False
        assert watcher.failures == n and watcher.jobs == before
        assert led.get(a.id).state == "starting"
        assert watcher.job("7")[0] == "known" and watcher.job("8") == ("unknown", None)
    (d / "down").unlink()
    write_jobs(d)
    assert await watcher.cycle() is True
    assert watcher.failures == 0 and watcher.jobs == {}
    got = led.get(a.id)
    assert got.state == "released" and got.end_reason == "Slurm job 7 is gone"
    assert watcher.job("7") == ("gone", None) and watcher.job("8") == ("gone", None)
    assert watcher.job("99") == ("unknown", None)  # never tracked


async def test_watcher_cancels_a_job_whose_allocation_was_released(fake):
    d, led, watcher = fake
    for job_id in ("9", "10", "11"):
        led.release(queued(led, job_id, 1).id, "lease expired")
    live = queued(led, "12", 1)
    write_jobs(
        d,
        job_json(9, name="gpuhub-engines", comment="gpuhub:1"),
        job_json(10, "COMPLETED", name="gpuhub-engines", comment="gpuhub:2"),
        job_json(12, "PENDING", reason="Priority", comment=f"gpuhub:{live.id}"),
    )
    assert await watcher.cycle() is True
    assert cancelled(d) == ["--user=alice --name=gpuhub-engines 9"] and list(watcher.cancelled) == ["9"]
    assert led.get(live.id).state == "starting"


async def test_watcher_attaches_a_job_found_by_its_tag_and_cancels_one_over_its_admission(fake):
    d, led, watcher = fake
    lost = led.allocate("alice", [], 2, deferred=True, backend="slurm")  # sbatch's answer was lost
    small = queued(led, "21", count=1)
    write_jobs(
        d,
        job_json(20, "PENDING", reason="Resources", comment=f"gpuhub:{lost.id}"),
        job_json(21, name="gpuhub-engines", comment=f"gpuhub:{small.id}"),  # 2 GPUs, 1 admitted
    )
    assert await watcher.cycle() is True
    assert led.get(lost.id).backend_job_id == "20" and led.get(lost.id).state == "starting"
    assert cancelled(d) == ["--user=alice --name=gpuhub-engines 21"]
    got = led.get(small.id)
    assert got.state == "released" and "holds 2 GPUs, 1 were admitted" in got.end_reason
    assert led.gpu_table() and not any(st.holder for st in led.gpu_table())


# gpu_magics/launch/slurm.py: where Slurm put each engine -> ranks ------------------------


def facts(eid, node, local, gpus, cuda, host=None):
    from gpu_magics.launch.slurm import EngineFacts

    return EngineFacts(eid, node, local, tuple(gpus), tuple(cuda), host or f"{node}.example", 100 + eid)


def test_ranks_follow_nodes_then_gpus_and_pin_the_local_ids_gpu():
    from gpu_magics.launch.slurm import assign_ranks, cuda_device

    # engines registered in any order; node 2 uses cgroups (renumbered from 0), node 1 does not
    engines = [
        facts(5, "n2", 1, [4, 6], ["0", "1"]),
        facts(2, "n1", 0, [2, 3], ["2", "3"]),
        facts(9, "n2", 0, [4, 6], ["0", "1"]),
        facts(1, "n1", 1, [2, 3], ["2", "3"]),
    ]
    pairs = assign_ranks(engines, 29500, "run")
    assert [(eid, s.rank, s.local_rank, s.slot.label) for eid, s in pairs] == [
        (2, 0, 0, "n1:2"), (1, 1, 1, "n1:3"), (9, 2, 0, "n2:4"), (5, 3, 1, "n2:6"),
    ]  # fmt: skip
    assert {s.master_addr for _, s in pairs} == {"n1.example"} and {s.master_port for _, s in pairs} == {
        29500
    }
    assert {s.world_size for _, s in pairs} == {4} and {s.local_world_size for _, s in pairs} == {2}
    by_id = {f.engine_id: f for f in engines}
    assert [cuda_device(by_id[eid]) for eid, _ in pairs] == ["2", "3", "0", "1"]


@pytest.mark.parametrize(
    "engines, error",
    [
        ([facts(1, "n1", 2, [0, 1], ["0", "1"])], "task 2 but its step has GPUs"),
        ([facts(1, "n1", 0, [0], ["0"]), facts(2, "n1", 0, [0], ["0"])], "two engines got GPU n1:0"),
    ],
)
def test_ranks_refuse_impossible_placements(engines, error):
    from gpu_magics.launch.slurm import assign_ranks

    with pytest.raises(RuntimeError, match=error):
        assign_ranks(engines, 1, "r")


# fmt: off
@pytest.mark.parametrize("own, wanted, nodes, per_node, plan", [
    (2, 2, None, None, ("steps", 1, 2)),
    (4, 2, 1, None, ("steps", 1, 2)),
    (1, 2, None, None, ("job", 1, 2)),
    (8, 8, 2, None, ("job", 2, 4)),   # two nodes asked for: never a step of a one-node server
    (0, 8, None, 4, ("job", 2, 4)),
    (0, 6, 3, 2, ("job", 3, 2)),
])
def test_plan_launch(own, wanted, nodes, per_node, plan):
    from gpu_magics.launch.slurm import plan_launch

    assert plan_launch(own, wanted, nodes, per_node) == plan
# fmt: on


def test_plan_launch_refuses_an_uneven_split_and_the_engines_job_drops_the_servers_slurm_vars():
    from gpu_magics.launch.slurm import job_env, plan_launch

    with pytest.raises(ValueError, match="does not split evenly over 2 nodes"):
        plan_launch(0, 7, 2, None)
    env = {"PATH": "/bin", "SLURM_JOB_ID": "4", "SLURM_MEM_PER_NODE": "4000", "SBATCH_X": "1",
           "SRUN_CPUS_PER_TASK": "4", "SLURM_CONF": "/etc/s.conf", "HOME": "/home/a"}  # fmt: skip
    assert job_env(env) == {"PATH": "/bin", "HOME": "/home/a", "SLURM_CONF": "/etc/s.conf"}


def test_queue_positions_by_priority_then_age_per_partition():
    Q = squeue.QueuedJob
    queue = [
        Q("30", ("gpu",), 100),
        Q("31", ("gpu",), 500),
        Q("32", ("gpu",), 100),
        Q("33", ("interactive",), 1),
        Q("34", ("gpu", "interactive"), 900),
        Q("35", ("gpu",), 0),
    ]  # fmt: skip  (35: held, competes for nothing)
    assert squeue.queue_positions(queue, {"30", "32", "33", "35", "99"}) == {
        "30": (3, 4, "gpu"),  # behind 34 (900) and 31 (500); older than 32 at the same priority
        "32": (4, 4, "gpu"),
        "33": (2, 2, "interactive"),  # 34 waits in both partitions
    }
    job = JobInfo("30", "PENDING", "Priority")
    assert (
        job.describe((3, 4, "gpu"))
        == "Queued in Slurm as job 30 (Priority), 3rd of 4 waiting in partition gpu"
    )
    assert [squeue._ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th"]  # fmt: skip


# borrowing: the borrow QOS, the jobs' QOS, the engines' save at preemption -------------------

QOS_TEXT = (
    "normal|gpuhub-borrow|cluster|00:00:00|||DenyOnLimit\n"
    "gpuhub-borrow||cancel|00:00:05|gres/gpu=3|gres/gpu=8|DenyOnLimit\n"
    "odd|a,b|requeue|1-00:00:01|cpu=2,gres/gpu=1||\n"
    "short|line\n"
)


def test_parse_qos():
    got = accounting.parse_qos(QOS_TEXT)
    assert got == {
        "normal": accounting.Qos("normal", ("gpuhub-borrow",), "cluster", 0, -1, -1, ("DenyOnLimit",)),
        "gpuhub-borrow": accounting.Qos("gpuhub-borrow", (), "cancel", 5, 3, 8, ("DenyOnLimit",)),
        "odd": accounting.Qos("odd", ("a", "b"), "requeue", 86401, 1, -1, ()),
    }


@pytest.mark.parametrize("text, want", [
    ("00:00:05", 5), ("00:05:00", 300), ("1-00:00:01", 86401), ("05", 5), ("1:02", 62),
    ("x", None), ("1-x", None), ("a-00:00:01", None), ("1:2:3:4", None),
])  # fmt: skip
def test_slurm_seconds(text, want):
    assert accounting.slurm_seconds(text) == want


@pytest.mark.parametrize("limits, allowances, want", [
    ({"a": 2, "b": 4}, {"a": 2}, 4),
    ({"a": 2, "b": 4}, {"a": 2, "b": 1}, 5),
    ({"a": 2}, {}, 0),  # nobody may borrow
    ({"a": None}, {"a": 3}, 0),  # unlimited users never borrow
    ({"a": 0}, {"a": 1}, 0),  # a limit of 0 is no GPUs at all, not even borrowed
    ({"a": 0, "b": 1}, {"a": 5, "b": 1}, 2),
])  # fmt: skip
def test_borrow_ceiling(limits, allowances, want):
    assert accounting.borrow_ceiling({u: eff(n) for u, n in limits.items()}, allowances) == want


BORROW = dict(
    name="gpuhub-borrow", preemptor="normal", account="gpuhub", grace_seconds=5, per_user=3, total_gpus=8
)
MODIFY_QOS = "sacctmgr -i modify qos where name=gpuhub-borrow set".split()
ADD_TO_ACCOUNT = "sacctmgr -i modify account where name=gpuhub set QOS+=gpuhub-borrow".split()


@pytest.mark.parametrize("changes, account_qos, want", [
    ({}, ["normal", "gpuhub-borrow"], []),  # as wanted: nothing
    ({"grace_seconds": 4.2}, ["gpuhub-borrow"], []),  # rounded up: 5 s, as written
    ({"grace_seconds": 120}, ["gpuhub-borrow"], [[*MODIFY_QOS, "GraceTime=120"]]),
    ({"per_user": 5, "total_gpus": 16}, ["gpuhub-borrow"],
     [[*MODIFY_QOS, "MaxTRESPerUser=gres/gpu=5", "GrpTRES=gres/gpu=16"]]),
    ({}, ["normal"], [ADD_TO_ACCOUNT]),
    ({}, None, [ADD_TO_ACCOUNT]),
    ({"preemptor": "high"}, ["gpuhub-borrow"],
     [["sacctmgr", "-i", "modify", "qos", "where", "name=high", "set", "Preempt+=gpuhub-borrow"]]),
])  # fmt: skip
def test_borrow_qos_plan_changes_only_what_differs(changes, account_qos, want):
    qos = accounting.parse_qos(QOS_TEXT)
    assert accounting.borrow_qos_plan(qos, **{**BORROW, **changes}, account_qos=account_qos) == want


def test_borrow_qos_plan_from_nothing():
    assert accounting.borrow_qos_plan({}, **BORROW, account_qos=[]) == [
        ["sacctmgr", "-i", "add", "qos", "gpuhub-borrow"],
        [*MODIFY_QOS, "PreemptMode=cancel", "GraceTime=5", "MaxTRESPerUser=gres/gpu=3",
         "GrpTRES=gres/gpu=8", "Flags=DenyOnLimit"],
        ["sacctmgr", "-i", "modify", "qos", "where", "name=normal", "set", "Preempt+=gpuhub-borrow"],
        ["sacctmgr", "-i", "modify", "account", "where", "name=gpuhub", "set", "QOS+=gpuhub-borrow"],
    ]  # fmt: skip


@pytest.mark.parametrize("changes, words", [
    ({"name": "a,b"}, "QOS name"),
    ({"preemptor": "-x"}, "starts with '-'"),
    ({"preemptor": "gpuhub-borrow"}, "cannot be the QOS that preempts it"),
    ({"grace_seconds": -1}, "GraceTime must be 0 or more"),
    ({"grace_seconds": float("nan")}, "GraceTime must be 0 or more"),
])  # fmt: skip
def test_borrow_qos_plan_refuses(changes, words):
    with pytest.raises(SlurmError) as e:
        accounting.borrow_qos_plan({}, **{**BORROW, **changes}, account_qos=[])
    assert words in str(e.value)


@pytest.mark.parametrize(
    "borrowed, qos, want", [(0, "gpuhub-borrow", ""), (1, "gpuhub-borrow", "gpuhub-borrow"), (2, "", "")]
)
def test_job_qos(borrowed, qos, want):
    assert commands.job_qos(borrowed, qos) == want


def test_sync_writes_the_borrow_qos_only_when_someone_may_borrow(monkeypatch):
    class Ledger:
        def effective_limits(self, users=None):
            return {"alice": eff(2)}

        def known_groups(self, users):
            return {u: [] for u in users}

        def gpu_table(self):
            return [type("G", (), {"present": True})()] * 4

    for borrow, wanted in ((0, False), (1, True)):
        config = Config()
        config.GpuHub.user_borrow = {"alice": borrow}
        config.GpuHub.preempt_grace_seconds = 7.5
        acc = accounting.SlurmAccounting(enabled=True, config=config)
        ran = []
        monkeypatch.setattr(acc, "_run", lambda argv, ran=ran: ran.append(argv) or "")
        acc.sync(Ledger())
        modify = [
            a for a in ran if a[:4] == ["sacctmgr", "-i", "modify", "qos"] and "name=gpuhub-borrow" in a
        ]
        assert bool(modify) == wanted
        if wanted:
            assert (
                "GraceTime=8" in modify[0]
                and "MaxTRESPerUser=gres/gpu=3" in modify[0]
                and "GrpTRES=gres/gpu=4" in modify[0]
            )


def test_a_borrowed_server_is_submitted_under_the_borrow_qos():
    from spawner.slurm.spawner import GpuSlurmSpawner, submitted_message
    from spawner.spawners import form

    sp = GpuSlurmSpawner(config=Config())
    opts = form.GpuOptions(count=2, model=None, partition="gpu")
    text = sp.script_for(
        "alice", "/home/alice", ["PATH"], ["jupyterhub-singleuser"], opts, "gpu", "gpuhub-borrow"
    )
    assert "#SBATCH --qos=gpuhub-borrow\n" in text
    assert "--qos" not in sp.script_for("alice", "/home/alice", ["PATH"], ["x"], opts, "gpu")
    assert submitted_message("7", 0, "", 300) == "Submitted to Slurm as job 7"
    assert submitted_message("7", 1, "gpuhub-borrow", 300) == (
        "Submitted to Slurm as job 7 (preemptible: 1 GPU borrowed beyond your limit, Slurm QOS "
        "gpuhub-borrow; when a job within its limit needs the GPUs, Slurm ends this server after 300 s)"
    )


@pytest.mark.parametrize("env, want", [
    ({"GPUHUB_AUTOSAVE_NAMES": "model opt", "GPUHUB_AUTOSAVE_DIR": "/d"}, (["model", "opt"], "/d")),
    ({"GPUHUB_AUTOSAVE_NAMES": "model 1x", "GPUHUB_AUTOSAVE_DIR": "/d"}, (["model"], "/d")),
    ({"GPUHUB_AUTOSAVE_NAMES": "", "GPUHUB_AUTOSAVE_DIR": "/d"}, None),
    ({"GPUHUB_AUTOSAVE_NAMES": "model", "GPUHUB_AUTOSAVE_DIR": "rel"}, None),
    ({}, None),
])  # fmt: skip
def test_autosave_request(env, want):
    from gpu_magics.engine.main import autosave_request

    assert autosave_request(env) == want


def test_the_engines_job_carries_qos_and_autosave():
    from gpu_magics.launch.slurm import SlurmLauncher, autosave_env

    assert autosave_env(None) == {"GPUHUB_AUTOSAVE_NAMES": "", "GPUHUB_AUTOSAVE_DIR": ""}
    launcher = SlurmLauncher("job", 1, 2, "/home/alice", "gpu", "gpuhub")
    launcher.borrow_qos = "gpuhub-borrow"
    assert "--qos" not in launcher.job_script(["python"])
    launcher.borrowed, launcher.autosave = 1, (["model"], "/ck")
    assert "#SBATCH --qos=gpuhub-borrow\n" in launcher.job_script(["python"])
    env = launcher.job_environ({"SLURM_JOB_ID": "3", "GPUHUB_AUTOSAVE_NAMES": "stale", "PATH": "/bin"})
    assert env == {"PATH": "/bin", "GPUHUB_AUTOSAVE_NAMES": "model", "GPUHUB_AUTOSAVE_DIR": "/ck"}


@pytest.mark.parametrize("env, want", [
    ({"RANK": "1", "WORLD_SIZE": "4", "SLURM_PROCID": "0"}, (1, 4)),
    ({"SLURM_PROCID": "2", "SLURM_NTASKS": "3"}, (2, 3)),
    ({}, (0, 1)),
])  # fmt: skip
def test_preempt_rank(env, want):
    from gpu_magics.engine.checkpoints import preempt_rank

    assert preempt_rank(env) == want


def test_the_sigterm_handler_saves_once_from_rank_0_and_ends(tmp_path):
    import torch

    from gpu_magics.engine.main import on_sigterm
    from gpu_magics.launch.slurm import preemption_report

    exits = []
    ns = {"w": torch.ones(2)}
    os.environ.update(SLURM_JOB_ID="55", SLURM_PROCID="0")
    try:
        handler = on_sigterm(["w", "gone"], str(tmp_path), lambda: ns, exit=exits.append)
        handler(15, None)
        handler(15, None)  # srun forwards the signal too
    finally:
        del os.environ["SLURM_JOB_ID"], os.environ["SLURM_PROCID"]
    assert exits == [0]
    assert torch.equal(torch.load(tmp_path / "w.pt", weights_only=True)["state"], torch.ones(2))
    assert preemption_report(str(tmp_path), "55") == (
        f"gpuhub: engine rank 0 preempted by Slurm (job 55): saved w to {tmp_path}; not defined: gone"
    )
    assert preemption_report(str(tmp_path), "56") is None
