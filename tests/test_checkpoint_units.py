"""Pure and in-process parts of ``%distributed save/restore``: names, files, kinds, messages, and
the engine-side functions run here on a namespace dict (the real kernel: test_checkpoint.py)."""

import errno
import os
import socket
import subprocess

import pytest
import torch
from IPython.core.error import UsageError
from torch import nn

from gpu_magics.common import checkpoint as cp
from gpu_magics.engine import checkpoints as cpe
from gpu_magics.kernel import checkpoints as cpk


@pytest.mark.parametrize(
    "names, expected",
    [(["model"], ["model"]), (["model", "opt", "model"], ["model", "opt"]), (["_x1"], ["_x1"])],
)
def test_check_names(names, expected):
    assert cpk.check_names(names, "save") == expected


@pytest.mark.parametrize("names", [[], ["../x"], ["a/b"], ["class"], ["1a"], [""], ["model", "a.b"]])
def test_check_names_refuses(names):
    with pytest.raises(UsageError, match="save"):
        cpk.check_names(names, "save")


def test_files_and_directories(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cp.resolve_dir(None) == str(tmp_path / ".local/share/gpuhub/checkpoints")
    assert cp.resolve_dir("~/ck") == str(tmp_path / "ck")
    monkeypatch.chdir(tmp_path)
    assert cp.resolve_dir("rel") == str(tmp_path / "rel")
    assert cp.checkpoint_path("/d", "model") == "/d/model.pt"


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 * 2**20, "5.0 MiB"),
        (3 * 2**40, "3.0 TiB"),
    ],
)
def test_human_size(n, text):
    assert cp.human_size(n) == text


def _objects():
    model = nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    return [
        (model, "module"),
        (nn.Sequential(nn.Linear(2, 2)), "module"),
        (opt, "optimizer"),
        (torch.optim.lr_scheduler.StepLR(opt, 1), "scheduler"),
        (torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "scheduler"),
        (torch.ones(2), "tensor"),
        (nn.Parameter(torch.ones(2)), "tensor"),
        ({"epoch": 3}, "value"),
        ([1, 2], "value"),
        (lambda x: x, "value"),  # a value: found unsaveable when pickled
    ]


def test_kind_of():
    for obj, kind in _objects():
        assert cp.kind_of(obj) == kind, obj


@pytest.mark.parametrize(
    "err, expected",
    [
        (errno.ENOSPC, "no space left for /d/model.pt"),
        (errno.EDQUOT, "free some space, or choose a directory with room: --dir DIR"),
        (errno.EACCES, "cannot write to /d"),
        (errno.EROFS, "choose a directory of your own that every rank reaches"),
        (errno.ENOTDIR, "/d is not a directory"),
        (errno.EIO, "could not write /d/model.pt"),
    ],
)
def test_os_error_messages(err, expected):
    text = cp.os_error_message("save", err, os.strerror(err), "/d", "model")
    assert expected in text and "Nothing was written" in text


def test_missing_message():
    text = cp.missing_message("save", {"opt": [1], "x": [0, 1]}, 2)
    assert text == (
        "save: 'opt' is not defined on rank 1; 'x' is not defined on any rank. Nothing was written: "
        "define them on every rank (a %%distributed cell without --targets), or leave them out."
    )
    assert "ranks 1, 2" in cp.missing_message("save", {"opt": [2, 1]}, 4)


def test_restore_problem_message():
    text = cp.restore_problem_message({("model", "is not defined: re-run"): [1], ("opt", "bad"): [0, 1]}, 2)
    assert text == "restore: 'model' (on rank 1): is not defined: re-run\n  'opt': bad\nNothing was restored."


# the engine side, on a plain namespace -------------------------------------------------------


def _trained(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 4)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return {"model": model, "opt": opt, "sched": sched, "w": torch.randn(3), "meta": {"epoch": 2}}


def _same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif isinstance(x, dict):
            if not _same_state(x, y):
                return False
        elif x != y:
            return False
    return True


def _listing(d):
    return sorted(os.listdir(d)) if os.path.isdir(d) else []


def _size(path):
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def test_save_and_restore_are_bit_identical(tmp_path):
    saved = _trained(0)
    d = str(tmp_path / "ck")
    result = cpe.engine_save(list(saved), d, {"saved": 1.0, "rank": 0, "world_size": 1}, ns=saved)
    assert result["ok"], result
    assert _listing(d) == ["meta.pt", "model.dcp", "opt.dcp", "sched.pt", "w.pt"]  # no temporary file
    assert {f["name"]: f["kind"] for f in result["files"]} == {
        "model": "module",
        "opt": "optimizer",
        "sched": "scheduler",
        "w": "tensor",
        "meta": "value",
    }
    assert all(f["bytes"] == _size(f["path"]) for f in result["files"])
    assert os.stat(d).st_mode & 0o777 == 0o700
    assert all(os.stat(f["path"]).st_mode & 0o077 == 0 for f in result["files"])
    assert sorted(os.listdir(f"{d}/model.dcp")) == [".metadata", "__0_0.distcp", "gpuhub.json"]
    assert [f.get("model") for f in result["files"]] == [None, "model", None, None, None]

    fresh = _trained(1)  # the definitions re-run: other values
    fresh.pop("w"), fresh.pop("meta")
    assert not _same_state(fresh["model"].state_dict(), saved["model"].state_dict())
    prepared = cpe.engine_prepare_restore("t", list(saved), d, ns=fresh)
    assert prepared["ok"], prepared
    assert cpe.engine_apply_restore("t", ns=fresh) == {
        "model": "dcp.load",
        "opt": "dcp.load",
        "sched": "load_state_dict",
        "w": "assigned",
        "meta": "assigned",
    }
    for name in ("model", "opt", "sched"):
        assert _same_state(fresh[name].state_dict(), saved[name].state_dict()), name
    assert torch.equal(fresh["w"], saved["w"]) and fresh["meta"] == {"epoch": 2}


def test_a_ddp_checkpoint_fits_a_plain_module_and_back(tmp_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DDP(nn.Linear(3, 2))
        assert cp.kind_of(ddp) == "ddp"
        d = str(tmp_path / "ck")
        assert cpe.engine_save(["ddp"], d, {}, ns={"ddp": ddp})["ok"]
        plain = {"ddp": nn.Linear(3, 2)}
        assert cpe.engine_prepare_restore("t", ["ddp"], d, ns=plain)["ok"]
        cpe.engine_apply_restore("t", ns=plain)
        assert _same_state(plain["ddp"].state_dict(), ddp.module.state_dict())  # no "module." prefix
        assert cpe.engine_save(["ddp"], d, {}, ns=plain)["ok"]
        torch.manual_seed(1)
        again = {"ddp": DDP(nn.Linear(3, 2))}
        assert cpe.engine_prepare_restore("t", ["ddp"], d, ns=again)["ok"]
        cpe.engine_apply_restore("t", ns=again)
        assert _same_state(again["ddp"].module.state_dict(), ddp.module.state_dict())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "bad, type_name",
    [
        (lambda: 1, "function"),
        ((i for i in range(3)), "generator"),
        (None, "_io.BufferedReader"),  # an open file
        ({"f": lambda: 1}, "dict"),
    ],
)
def test_an_unsaveable_object_writes_nothing(tmp_path, bad, type_name):
    if bad is None:
        bad = open(__file__, "rb")
    d = str(tmp_path)
    ns = {"model": nn.Linear(2, 2), "bad": bad}
    try:
        result = cpe.engine_save(["model", "bad"], d, {}, ns=ns)
    finally:
        if hasattr(bad, "close"):
            bad.close()
    assert result["ok"] is False and result["error"] == "unsaveable" and result["name"] == "bad"
    assert result["type"] == type_name
    assert _listing(d) == []  # not even model.pt: all or nothing
    text = cp.unsaveable_message("save", result["name"], result["type"], result["detail"])
    assert text.startswith(f"save: cannot save 'bad' (a {type_name}): ")
    assert "Nothing was written" in text and "re-running the cell that defines it" in text


def test_a_failed_write_keeps_its_errno_and_leaves_nothing(tmp_path, monkeypatch):
    def full(self, data):
        self.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise self.error

    monkeypatch.setattr(cpe._Recorder, "write", full)
    old = str(tmp_path / "w.pt")
    with open(old, "wb") as f:
        f.write(b"the last checkpoint")
    result = cpe.engine_save(["w"], str(tmp_path), {}, ns={"w": torch.ones(3)})
    assert result == {
        "ok": False,
        "error": "os",
        "errno": errno.ENOSPC,
        "strerror": os.strerror(errno.ENOSPC),
        "name": "w",
        "suffix": ".pt",
    }
    assert _listing(tmp_path) == ["w.pt"]
    with open(old, "rb") as f:
        assert f.read() == b"the last checkpoint"  # the previous checkpoint is untouched


def test_a_failed_dcp_write_keeps_its_errno_and_the_previous_checkpoint(tmp_path, monkeypatch):
    """DCP wraps a rank's OSError in a CheckpointException: its errno still reaches the message."""
    from torch.distributed.checkpoint import filesystem

    d = str(tmp_path)
    first = _trained(0)
    assert cpe.engine_save(["model", "opt"], d, {}, ns=first)["ok"]
    before = {p: open(p, "rb").read() for p in (f"{d}/model.dcp/__0_0.distcp", f"{d}/opt.dcp/__0_0.distcp")}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(filesystem, "_write_files_from_queue", full)
    result = cpe.engine_save(["model", "opt"], d, {}, ns=_trained(1))
    assert result["ok"] is False and result["errno"] == errno.ENOSPC and result["name"] == "model", result
    assert f"no space left for {d}/model.dcp (No space left" in cp.save_error_text("save", result, d, 1)
    assert _listing(d) == ["model.dcp", "opt.dcp"]  # no temporary directory
    assert {p: open(p, "rb").read() for p in before} == before


def test_a_directory_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    result = cpe.engine_save(["x"], str(tmp_path / "f"), {}, ns={"x": 1})
    assert (
        result["ok"] is False and result["errno"] in (errno.ENOTDIR, errno.EEXIST) and result["name"] is None
    )


def test_stale_temporary_files_of_dead_writers_go(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    stale = tmp_path / f".model.pt.{host}.{dead.pid}.abc_12.tmp"
    live = tmp_path / f".model.pt.{host}.{os.getppid()}.abc_13.tmp"
    other = tmp_path / f".model.pt.otherhost.{dead.pid}.abc_14.tmp"
    for p in (stale, live, other):
        p.write_bytes(b"x")
    assert cpe.engine_save(["x"], str(tmp_path), {}, ns={"x": 1})["ok"]
    assert _listing(tmp_path) == sorted([live.name, other.name, "x.pt"])


def _problems(d, names, ns):
    answer = cpe.engine_prepare_restore("t", names, d, ns=ns)
    assert answer["ok"] is False
    return {p["name"]: (p["problem"], p["text"]) for p in answer["problems"]}


def test_restore_refuses_what_does_not_fit_and_changes_nothing(tmp_path):
    saved = _trained(0)
    d = str(tmp_path)
    assert cpe.engine_save(["model", "opt", "sched"], d, {}, ns=saved)["ok"]
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    torch.save({"a": 1}, str(tmp_path / "other.pt"))
    wrong = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 1))
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    ns = {"model": wrong, "sched": 3}
    problems = _problems(d, ["model", "opt", "sched", "gone", "junk", "other"], ns)
    assert problems["model"][0] == "target" and "does not fit this module" in problems["model"][1]
    assert "0.weight saved (8, 4), yours (9, 4)" in problems["model"][1]
    assert "define model as it was saved (same layers) in a cell, then restore" in problems["model"][1]
    assert problems["opt"] == (
        "target",
        "is not defined: re-run the cell that defines the optimizer first, then restore",
    )
    assert problems["sched"][0] == "target" and "is a int, not an LR scheduler" in problems["sched"][1]
    assert problems["gone"] == ("missing", f"no checkpoint {d}/gone.dcp or {d}/gone.pt")
    assert problems["junk"][0] == "unreadable"
    assert problems["other"] == ("foreign", f"{d}/other.pt is not a gpuhub checkpoint")
    assert _same_state(wrong.state_dict(), before)
    # another optimizer class over the same model: refused, not silently mixed
    other_opt = {"opt": torch.optim.SGD(saved["model"].parameters(), lr=0.1)}
    [(kind, text)] = _problems(d, ["opt"], other_opt).values()
    assert kind == "target" and "the checkpoint is of a torch.optim.adam.Adam" in text


def test_a_pickled_value_loads_only_from_a_private_file(tmp_path):
    class Point:  # not a type torch's safe loader knows
        pass

    import pickle

    d = str(tmp_path)
    torch.save(
        {
            "format": cp.FORMAT,
            "version": 1,
            "name": "p",
            "kind": "value",
            "type": "x",
            "state": pickle.dumps(1),
        },
        str(tmp_path / "ok.pt"),
    )
    assert cpe.engine_prepare_restore("t", ["ok"], d, ns={})["ok"]  # bytes: the safe loader
    assert cpe.engine_save(["p"], d, {}, ns={"p": Point()})["ok"] is False  # a local class: unpicklable
    assert cpe.engine_save(["p"], d, {}, ns={"p": socket.AddressFamily.AF_INET})["ok"]
    assert cpe.engine_prepare_restore("t", ["p"], d, ns={})["ok"]  # pickled, and only we can write it
    os.chmod(tmp_path / "p.pt", 0o666)
    [(kind, text)] = _problems(d, ["p"], {}).values()
    assert kind == "unreadable" and "is not a file only you can write" in text


def test_restore_can_leave_undefined_state_dicts_for_later(tmp_path):
    saved = _trained(0)
    d = str(tmp_path)
    assert cpe.engine_save(["model", "w"], d, {}, ns=saved)["ok"]
    ns = {}
    answer = cpe.engine_prepare_restore("t", ["model", "w"], d, ns=ns, skip_undefined=True)
    assert answer["ok"] and list(answer["records"]) == ["w"]
    assert answer["skipped"] == [
        {"name": "model", "kind": "module", "type": "torch.nn.modules.container.Sequential"}
    ]
    assert cpe.engine_apply_restore("t", ns=ns) == {"w": "assigned"}
    text = cpk.Restored(d, 2, answer["records"], {"w": "assigned"}, answer["skipped"]).text()
    assert text.startswith(
        f"gpuhub: restored into 2 ranks from {d}:\n  w: tensor (torch.Tensor), assigned; saved "
    )
    assert text.endswith(
        f"gpuhub: not restored yet: model (module): re-run the cells that define them, then "
        f"%distributed restore model --dir {d}"
    )


class _Pool:
    def __init__(self, broken=False):
        self.broken = broken
        self.client = object()
        self.size = 2


class _Magics(cpk.CheckpointCommands):
    """The parts of DistributedMagics the mixin uses."""

    def __init__(self, pool):
        import threading

        self.pool, self.lock, self.busy, self.last_used = pool, threading.RLock(), 0, 1.0

    def _lease_lost(self):
        return False

    def _touch(self):
        self.last_used += 1


def test_a_failed_autosave_is_reported_and_the_stop_goes_on(capsys, monkeypatch):
    m = _Magics(_Pool(broken=True))
    m._set_autosave(["model"], "/ck")
    assert m._autosave_text() == "autosave: model to /ck"
    with pytest.raises(UsageError, match="autosave skipped before the idle stop: the last cell lost a rank"):
        m._save_before_stop("idle")
    assert m._save_then_forget("idle") == "idle"  # reported, not raised
    assert "The engines are stopped anyway." in capsys.readouterr().err

    def boom(self, names, directory, autosave=False):
        raise KeyboardInterrupt

    monkeypatch.setattr(cpk.Checkpointer, "save", boom)
    m.pool = _Pool()
    assert m._save_then_forget(None) == "restart"  # even an interrupt never stops the stop
    m._forget_autosave("restart")
    assert m.autosave == [] and m._autosave_text() is None


def test_autosave_saves_once_until_a_cell_runs_and_a_resize_keeps_it(capsys, monkeypatch):
    calls = []

    def save(self, names, directory, autosave=False):
        calls.append((names, directory, autosave))
        return cpk.Saved(
            directory,
            0,
            [{"name": "m", "path": f"{directory}/m.pt", "bytes": 10, "kind": "module", "type": "T"}],
        )

    monkeypatch.setattr(cpk.Checkpointer, "save", save)
    m = _Magics(_Pool())
    m._set_autosave(["m"], "/ck")
    m._save_before_stop("resize")
    m._save_before_stop("resize")
    assert calls == [(["m"], "/ck", True)]
    assert (
        "gpuhub: autosaved before the resize from rank 0 to /ck (10 B):\n  m.pt        10 B  module (T)"
        in capsys.readouterr().out
    )
    assert m._stop_reason(None) == "resize"  # the resize saved, then stops the pool
    m._forget_autosave("resize")
    assert m.autosave == ["m"] and m.last_autosave == (["m"], "/ck")
    m._touch()  # a cell ran
    m._save_before_stop("shutdown")
    assert len(calls) == 2
    m._set_autosave([], None)
    assert m.autosave == [] and "gpuhub: autosave off." in capsys.readouterr().out


def test_names_a_resize_could_not_restore_are_not_autosaved_until_restored(capsys, monkeypatch):
    calls = []

    def save(self, names, directory, autosave=False):
        calls.append(names)
        return cpk.Saved(
            directory,
            0,
            [
                {"name": n, "path": f"{directory}/{n}.pt", "bytes": 1, "kind": "value", "type": "int"}
                for n in names
            ],
        )

    monkeypatch.setattr(cpk.Checkpointer, "save", save)
    m = _Magics(_Pool())
    m._set_autosave(["model", "w"], "/ck")
    m._pending = {"model"}
    m._save_before_stop("idle")
    assert calls == [["w"]]
    assert (
        "not saved: model (not restored since the resize: the checkpoints are kept)"
        in capsys.readouterr().out
    )
    m._touch()
    m.autosave = ["model"]
    m._save_before_stop("idle")
    assert (
        calls == [["w"]] and "not autosaved: model not restored since the resize" in capsys.readouterr().err
    )
    m._forget_autosave("idle")
    assert m._pending == set() and m.autosave == []


# version 2: models and optimizers as DCP directories (pure parts) ----------------------------


@pytest.mark.parametrize(
    "basename, parsed",
    [
        (cp.temp_name("node1", 42, "ab12"), ("node1", 42, "ab12")),
        (cp.temp_name("node1.cluster.org", 7, "x"), ("node1.cluster.org", 7, "x")),  # dots in the host
        (".gpuhub-save.node1.42.tmp", None),  # no token
        (".gpuhub-save.node1.pid.ab.tmp", None),
        (".model.pt.node1.42.ab.tmp", None),  # a version 1 temporary file: not a save's directory
        ("model.dcp", None),
    ],
)
def test_temp_names(basename, parsed):
    assert cp.parse_temp(basename) == parsed


def test_stale_temporary_directories():
    listing = [
        cp.temp_name("here", 10, "dead"),  # its kernel is gone
        cp.temp_name("here", 11, "live"),  # a live kernel's save in progress
        cp.temp_name("here", 12, "old"),  # this kernel's earlier save
        cp.temp_name("here", 12, "now"),  # this kernel's save now
        cp.temp_name("there", 10, "other"),  # another host's: not ours to judge
        "model.dcp",
        "w.pt",
    ]
    live = {11, 12}.__contains__
    assert cp.stale_temps(listing, "here", live, cp.temp_name("here", 12, "now")) == [
        cp.temp_name("here", 10, "dead"),
        cp.temp_name("here", 12, "old"),
    ]
    assert cp.stale_temps(listing, "here", live) == [cp.temp_name("here", 10, "dead")]


@pytest.mark.parametrize(
    "optimizers, modules, expected",
    [
        ({"opt": [1, 2]}, {"model": [1, 2, 3]}, {"opt": "model"}),
        ({"opt": [1, 2]}, {"head": [1], "model": [1, 2]}, {"opt": "model"}),  # all of its parameters
        ({"opt": [1, 2]}, {"model": [1, 2], "inner": [1, 2]}, {"opt": "model"}),  # the first that does
        ({"opt": [9]}, {"model": [1, 2]}, {"opt": None}),
        ({"g_opt": [1], "d_opt": [5]}, {"g": [1, 2], "d": [5]}, {"g_opt": "g", "d_opt": "d"}),
        ({"opt": [1, 5]}, {"g": [1, 2], "d": [5]}, {"opt": None}),  # across two models: none holds it
    ],
)
def test_match_optimizers(optimizers, modules, expected):
    assert cp.match_optimizers(optimizers, modules) == expected


@pytest.mark.parametrize(
    "model, expected",
    [
        ("model", "save the model with it: %distributed save model opt."),
        (None, "save the model with it: %distributed save model opt (your model's name for model)."),
    ],
)
def test_no_model_message(model, expected):
    text = cp.no_model_message("save", "opt", model)
    assert text.startswith("save: 'opt' is an optimizer whose model is not saved with it")
    assert "Nothing was written" in text and text.endswith(expected)


@pytest.mark.parametrize(
    "saved, mine, expected",
    [
        ({"0.weight": (2, 3), "0.bias": (2,)}, {"0.weight": (2, 3), "0.bias": (2,)}, None),
        (
            {"0.weight": (2, 3)},
            {"0.weight": (4, 3)},
            "the checkpoint does not fit this module (0.weight saved (2, 3), yours (4, 3)): define m as it "
            "was saved (same layers) in a cell, then restore",
        ),
        (
            {"0.weight": (2, 3), "1.weight": (2, 2)},
            {"0.weight": (2, 3), "2.weight": (2, 2)},
            "the checkpoint does not fit this module (the checkpoint has 1.weight, missing in yours; yours "
            "has 2.weight, not in the checkpoint): define m as it was saved (same layers) in a cell, then "
            "restore",
        ),
        ({"extra": None, "w": (1,)}, {"extra": None, "w": (1,)}, None),  # a non-tensor entry
    ],
)
def test_module_fit(saved, mine, expected):
    assert cp.module_fit("m", saved, mine) == expected


def test_module_fit_lists_at_most_five_keys():
    text = cp.module_fit("m", {f"l{i}.w": (1,) for i in range(8)}, {})
    assert "the checkpoint has l0.w, l1.w, l2.w, l3.w, l4.w and 3 more, missing in yours" in text


OPT_KEYS = [
    "state.0.weight.step",
    "state.0.weight.exp_avg",
    "state.layers.1.bias.exp_avg",
    "param_groups.0.lr",
    "param_groups.0.params",
    "param_groups.1.lr",
]


def test_optimizer_keys():
    assert cp.optimizer_fqns(OPT_KEYS) == {"0.weight", "layers.1.bias"}
    assert cp.optimizer_groups(OPT_KEYS) == 2


@pytest.mark.parametrize(
    "fqns, groups, expected",
    [
        (["0.weight", "layers.1.bias", "other"], 2, None),
        (["0.weight"], 2, "the checkpoint has state for parameters model does not have (layers.1.bias)"),
        (["0.weight", "layers.1.bias"], 1, "it has 1 parameter groups, the checkpoint 2"),
    ],
)
def test_optimizer_fit(fqns, groups, expected):
    got = cp.optimizer_fit("opt", OPT_KEYS, "model", fqns, groups)
    assert got == expected if expected is None else got.startswith(expected), got


@pytest.mark.parametrize(
    "result, expected",
    [
        (
            {
                "error": "os",
                "errno": errno.ENOSPC,
                "strerror": "No space left on device",
                "name": "m",
                "suffix": ".dcp",
            },
            "save: no space left for /d/m.dcp (No space left on device). Nothing was written",
        ),
        (
            {"error": "os", "errno": errno.EROFS, "strerror": "Read-only file system", "name": None},
            "save: cannot write to /d (Read-only file system). Nothing was written",
        ),
        ({"error": "missing", "name": "x", "rank": 1}, "save: 'x' is not defined on rank 1."),
        (
            {"error": "failed", "name": "m", "detail": "rank 1: RuntimeError: boom"},
            "save: m: rank 1: RuntimeError: boom.",
        ),
    ],
)
def test_save_error_text(result, expected):
    assert cp.save_error_text("save", {"ok": False, **result}, "/d", 2).startswith(expected)


def test_exchange_swaps_two_directories_in_one_step(tmp_path):
    from gpu_magics.engine import dcp

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "new").write_text("")
    (b / "old").write_text("")
    assert dcp.exchange(str(a), str(b)) is True  # renameat2 on this file system
    assert os.listdir(b) == ["new"] and os.listdir(a) == ["old"]
    with pytest.raises(FileNotFoundError):
        dcp.exchange(str(tmp_path / "gone"), str(b))


def test_first_os_error_and_describe_look_under_dcp_s_exception():
    from torch.distributed.checkpoint.api import CheckpointException

    from gpu_magics.engine import dcp

    full = OSError(errno.ENOSPC, "No space left on device")
    e = CheckpointException("save failed", {1: (full, None), 0: (RuntimeError("peer\n  went away"), None)})
    assert dcp.first_os_error(e) is full
    assert dcp.describe(e) == (
        "rank 0: RuntimeError: peer went away; rank 1: OSError: [Errno 28] No space left on device"
    )
    assert dcp.first_os_error(RuntimeError("x")) is None


def test_a_second_save_replaces_the_first_whole_and_the_other_format_goes(tmp_path):
    d = str(tmp_path)
    old = torch.save(
        {"format": cp.FORMAT, "version": 1, "kind": "value", "type": "int", "state": 1}, f"{d}/model.pt"
    )
    assert old is None
    first, second = _trained(0), _trained(1)
    assert cpe.engine_save(["model"], d, {}, ns=first)["ok"]
    assert _listing(d) == ["model.dcp"]  # the version 1 file of the same name went
    assert cpe.engine_save(["model"], d, {}, ns=second)["ok"]
    assert _listing(d) == ["model.dcp"]
    ns = {"model": _trained(2)["model"]}
    assert cpe.engine_prepare_restore("t", ["model"], d, ns=ns)["ok"]
    cpe.engine_apply_restore("t", ns=ns)
    assert _same_state(ns["model"].state_dict(), second["model"].state_dict())
    assert cpe.engine_save(["model"], d, {}, ns={"model": 3})["ok"]  # now a value: the directory goes
    assert _listing(d) == ["model.pt"]


def test_an_optimizer_needs_its_model_to_save_and_to_restore(tmp_path):
    d = str(tmp_path)
    saved = _trained(0)
    answer = cpe.engine_save(["opt"], d, {}, ns=saved)
    assert answer == {"ok": False, "error": "no model", "name": "opt", "suggest": "model"}
    assert _listing(d) == []
    assert cpe.engine_save(["model", "opt"], d, {}, ns=saved)["ok"]
    lone = {"opt": torch.optim.Adam([nn.Parameter(torch.ones(2))])}
    [(kind, text)] = _problems(d, ["opt"], lone).values()
    assert kind == "target" and text.startswith(
        "none of your modules holds its parameters: define the model it"
    )
    # the model under another name now: found by its parameters
    fresh = _trained(3)
    renamed = {"net": fresh["model"], "opt": fresh["opt"]}
    assert cpe.engine_prepare_restore("t", ["opt"], d, ns=renamed)["ok"]
    cpe.engine_apply_restore("t", ns=renamed)
    mine, want = renamed["opt"].state_dict()["state"], saved["opt"].state_dict()["state"]
    assert all(torch.equal(mine[i][k], want[i][k]) for i in want for k in want[i])


def test_old_checkpoints_still_restore(tmp_path):
    """Files of gpuhub's first format (written by that code: tests/golden/checkpoint-v1)."""
    import shutil

    golden = os.path.join(os.path.dirname(__file__), "golden", "checkpoint-v1")
    d = str(tmp_path / "old")
    shutil.copytree(golden, d)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ns = {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=0.01)}
    answer = cpe.engine_prepare_restore("t", ["model", "opt", "steps"], d, ns=ns)
    assert answer["ok"] and answer["dcp"] == [], answer
    assert answer["records"]["model"]["version"] == 1 and answer["records"]["model"]["saved"] == 1764806400.0
    assert cpe.engine_apply_restore("t", ns=ns) == {
        "model": "load_state_dict",
        "opt": "load_state_dict",
        "steps": "assigned",
    }
    want = {n: torch.load(f"{d}/{n}.pt", weights_only=True)["state"] for n in ("model", "opt")}
    assert _same_state(model.state_dict(), want["model"]) and ns["steps"] == 2
    assert _same_state(ns["opt"].state_dict()["state"], want["opt"]["state"])


def test_saved_and_restored_say_who_wrote_and_what_was_resharded():
    files = [
        {
            "name": "model",
            "path": "/ck/model.dcp",
            "bytes": 2048,
            "kind": "sharded",
            "type": "FSDPSequential",
        },
        {
            "name": "opt",
            "path": "/ck/opt.dcp",
            "bytes": 4096,
            "kind": "optimizer",
            "type": "Adam",
            "model": "model",
        },
        {"name": "step", "path": "/ck/step.pt", "bytes": 10, "kind": "value", "type": "int"},
    ]
    text = cpk.Saved("/ck", 0, files, writers=2, left_out={"sched": "why"}).text()
    assert text.splitlines() == [
        "gpuhub: saved by 2 ranks (each its own shards of models and optimizers) to /ck (6.0 KiB):",
        "  model.dcp     2.0 KiB  sharded module (FSDP2) (FSDPSequential)",
        "  opt.dcp       4.0 KiB  optimizer (Adam) of model",
        "  step.pt          10 B  value (int)",
        "  not saved: 'sched': why",
    ]
    records = {
        "model": {"kind": "sharded", "type": "F", "saved": 1.0, "world_size": 2, "version": 2},
        "step": {"kind": "value", "type": "int", "saved": 1.0, "rank": 0, "world_size": 2, "version": 1},
    }
    text = cpk.Restored("/ck", 4, records, {"model": "dcp.load", "step": "assigned"}).text()
    assert text.splitlines() == [
        "gpuhub: restored into 4 ranks from /ck:",
        "  model: sharded module (FSDP2) (F), dcp.load, resharded from 2 to 4 ranks; saved 1970-01-01 "
        "00:00:01 UTC by 2 ranks",
        "  step: value (int), assigned; saved 1970-01-01 00:00:01 UTC from rank 0",
    ]


def test_a_restore_that_some_ranks_would_skip_is_refused_on_those_ranks():
    even = {0: {"dcp": ["model", "opt"]}, 1: {"dcp": ["model", "opt"]}}
    assert cpk.uneven_dcp(even) == {}
    uneven = cpk.uneven_dcp({0: {"dcp": ["model", "opt"]}, 1: {"dcp": ["opt"]}, 2: {"dcp": []}})
    assert sorted(uneven) == [1, 2]
    assert [p["name"] for p in uneven[2]["problems"]] == ["model", "opt"]
    assert uneven[1]["problems"][0]["text"].startswith(
        "is not defined: re-run the cell that defines it on every"
    )
