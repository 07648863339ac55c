"""Save and restore a ``%%distributed`` pool's objects: ``%distributed save|restore NAME...``
and ``--autosave NAME...``.

Two halves, as in ``engine.py`` and ``pool.py``:

- **Engine side** (``engine_*`` functions): run inside the ranks' engines through ipyparallel,
  on the names of the engine's IPython user namespace. They never raise for a user's mistake;
  they answer plain dicts that the kernel side turns into a ``UsageError``.
- **Kernel side** (``Checkpointer``): given an ``EnginePool``, checks every rank, saves from one
  rank (rank 0: DDP keeps the ranks identical) and restores into every rank, all or nothing.

The format: one file per name, ``DIR/NAME.pt``, written by ``torch.save`` as a dict
``{"format": "gpuhub-checkpoint", "version": 1, "name", "kind", "type", "state", "saved",
"rank", "world_size"}``. ``state`` is the object's ``state_dict()`` for modules (a DDP model:
its ``.module``'s, so a checkpoint fits a wrapped or unwrapped model alike), optimizers and LR
schedulers, else the tensor or value itself. Durable: each file is written to a temporary file
in the same directory (``.NAME.pt.HOST.PID.*.tmp``, mode 0600), flushed and fsynced, and only
when every name of the save is written are they renamed into place (``os.replace``) and the
directory fsynced; any failure removes every temporary file of that save.
"""

from __future__ import annotations

import errno
import glob
import keyword
import os
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from .procs import alive

FORMAT = "gpuhub-checkpoint"
VERSION = 1
SUFFIX = ".pt"
DEFAULT_DIR = "~/.local/share/gpuhub/checkpoints"
CHECK_TIMEOUT = 30.0  # asking each rank what its names are
SAVE_TIMEOUT = 3600.0  # writing or reading checkpoints: as long as a big model needs

# what each kind is called, and how it is restored
KINDS = {
    "ddp": "DDP module",
    "module": "module",
    "optimizer": "optimizer",
    "scheduler": "LR scheduler",
    "tensor": "tensor",
    "value": "value",
}
STATEFUL = ("ddp", "module", "optimizer", "scheduler")  # restored by load_state_dict in place


# pure parts ------------------------------------------------------------------------------


def check_names(names: list[str], what: str) -> list[str]:
    """The names as given, once each; each must be a Python identifier (so it is also a safe
    file name: no ``/``, no ``..``)."""
    if not names:
        raise UsageError(f"{what}: name the objects, e.g. %distributed {what} model opt")
    bad = [n for n in names if not n.isidentifier() or keyword.iskeyword(n)]
    if bad:
        raise UsageError(
            f"{what}: {', '.join(map(repr, bad))} {'is not a name' if len(bad) == 1 else 'are not names'}"
            " of the ranks' variables (Python identifiers, like model or opt)"
        )
    return list(dict.fromkeys(names))


def resolve_dir(directory: str | None) -> str:
    """``--dir`` (or the default) as an absolute path: ``~`` expanded, relative to the kernel."""
    return os.path.abspath(os.path.expanduser(directory or DEFAULT_DIR))


def checkpoint_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + SUFFIX)


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def missing_message(what: str, missing: dict[str, list[int]], world: int) -> str:
    """``save``: which names are not defined on which ranks."""
    parts = []
    for name, ranks in missing.items():
        where = "any rank" if len(ranks) == world else ranks_text(ranks)
        parts.append(f"{name!r} is not defined on {where}")
    return (
        f"{what}: {'; '.join(parts)}. Nothing was written: define "
        + ("it" if len(missing) == 1 else "them")
        + " on every rank (a %%distributed cell without --targets), or leave "
        + ("it" if len(missing) == 1 else "them")
        + " out."
    )


def os_error_message(what: str, err: int | None, strerror: str, directory: str, name: str | None) -> str:
    """A failed write or directory, said with what to do about it."""
    where = checkpoint_path(directory, name) if name else directory
    if err in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"{what}: no space left for {where} ({strerror}). Nothing was written: free some space, "
            "or choose a directory with room: --dir DIR."
        )
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"{what}: cannot write to {directory} ({strerror}). Nothing was written: choose a "
            "directory of your own that every rank reaches: --dir DIR (default "
            f"{DEFAULT_DIR})."
        )
    if err in (errno.ENOTDIR, errno.EEXIST):
        return f"{what}: {directory} is not a directory ({strerror}). Nothing was written: --dir DIR."
    return f"{what}: could not write {where}: {strerror}. Nothing was written."


def unsaveable_message(what: str, name: str, type_name: str, detail: str) -> str:
    return (
        f"{what}: cannot save {name!r} (a {type_name}): {detail}. Nothing was written. Save what it "
        "holds instead (a state_dict, tensors, lists, numbers), or leave it out and re-create it by "
        "re-running the cell that defines it."
    )


def restore_problem_message(problems: dict[tuple[str, str], list[int]], world: int) -> str:
    """``restore``: each (name, problem) with the ranks it was found on."""
    parts = []
    for (name, text), ranks in problems.items():
        where = "" if len(ranks) == world else f" (on {ranks_text(ranks)})"
        parts.append(f"{name!r}{where}: {text}")
    return "restore: " + "\n  ".join(parts) + "\nNothing was restored."


def kind_of(obj) -> str:
    """What a rank's object is, for saving: see ``KINDS`` (imports torch: engine side)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(obj, DistributedDataParallel):
        return "ddp"
    if isinstance(obj, torch.nn.Module):
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
        return "scheduler"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    return "value"


def type_name(obj) -> str:
    t = type(obj)
    return t.__name__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"


def state_of(obj, kind: str):
    if kind == "ddp":
        return obj.module.state_dict()
    if kind in STATEFUL:
        return obj.state_dict()
    if kind == "tensor" and not obj.is_leaf:
        return obj.detach()
    return obj


def fits(kind: str, saved_type: str, state, target) -> str | None:
    """Why a checkpoint of ``kind`` cannot be loaded into ``target`` (None: it can)."""
    what = KINDS[kind] if kind != "ddp" else "module"
    rerun = f"re-run the cell that defines the {what} first, then restore"
    if target is _MISSING:
        return f"is not defined: {rerun}"
    have = kind_of(target)
    if kind in ("ddp", "module"):
        if have not in ("ddp", "module"):
            return f"is a {type_name(target)}, not a module: {rerun}"
        module = target.module if have == "ddp" else target
        mine = module.state_dict()
        missing = [k for k in mine if k not in state]
        extra = [k for k in state if k not in mine]
        shapes = [
            f"{k} saved {tuple(state[k].shape)}, here {tuple(mine[k].shape)}"
            for k in mine
            if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(mine[k].shape)
        ]
        if missing or extra or shapes:
            said = []
            if missing:
                said.append("not in the checkpoint: " + ", ".join(missing[:5]))
            if extra:
                said.append("not in the module: " + ", ".join(extra[:5]))
            if shapes:
                said.append("; ".join(shapes[:5]))
            return f"the checkpoint does not fit this module ({'; '.join(said)}): {rerun} as it was saved"
        return None
    if have != kind:
        return f"is a {type_name(target)}, not an {KINDS[kind]} ({saved_type}): {rerun}"
    if type_name(target) != saved_type:
        return f"is a {type_name(target)}; the checkpoint is of a {saved_type}: {rerun} as it was saved"
    if kind == "optimizer":
        groups = target.state_dict()["param_groups"]
        saved = state.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved]:
            return (
                f"its parameter groups ({[len(g['params']) for g in groups]} parameters) differ from the "
                f"checkpoint's ({[len(g['params']) for g in saved]}): {rerun} over the same model"
            )
    return None


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()


# engine side -------------------------------------------------------------------------------


def _user_ns(ns: dict | None) -> dict:
    if ns is not None:
        return ns
    from IPython import get_ipython

    return get_ipython().user_ns


def engine_inspect(names: list[str], ns: dict | None = None) -> dict:
    """Each name's kind and type on this rank; None where it is not defined."""
    ns = _user_ns(ns)
    return {n: ({"kind": kind_of(ns[n]), "type": type_name(ns[n])} if n in ns else None) for n in names}


class _Recorder:
    """The file torch.save writes to, keeping the OSError of a failed write (torch wraps it
    in a RuntimeError that has lost its errno)."""

    def __init__(self, f):
        self.f = f
        self.error: OSError | None = None

    def write(self, data):
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        try:
            return self.f.flush()
        except OSError as e:
            self.error = e
            raise


class _Unsaveable(Exception):
    def __init__(self, name: str, type_name: str, detail: str):
        super().__init__(detail)
        self.name, self.type_name, self.detail = name, type_name, detail


def _make_dir(directory: str) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.abspath(directory) == resolve_dir(None):
        st = os.stat(directory)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(directory, 0o700)  # the default directory is private


def _temp_prefix(name: str) -> str:
    return f".{name}{SUFFIX}.{socket.gethostname()}.{os.getpid()}."


def _clean_stale(directory: str) -> None:
    """Temporary files of saves on this host whose process is gone (an engine killed mid-write)."""
    host = socket.gethostname()
    for path in glob.glob(os.path.join(glob.escape(directory), f".*{SUFFIX}.{glob.escape(host)}.*.tmp")):
        parts = os.path.basename(path).rsplit(".", 3)  # [".NAME.pt.HOST", PID, RANDOM, "tmp"]
        if (
            len(parts) == 4
            and parts[1].isdigit()
            and int(parts[1]) != os.getpid()
            and not alive(int(parts[1]))
        ):
            try:
                os.unlink(path)
            except OSError:
                pass


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def engine_save(names: list[str], directory: str, meta: dict, ns: dict | None = None) -> dict:
    """Write each name to ``DIRECTORY/NAME.pt``, all or nothing (see the module's docstring).

    ``{"ok": True, "files": [{name, path, bytes, kind, type}]}``, or ``{"ok": False, "error":
    "missing"|"unsaveable"|"os", ...}`` with nothing written and no temporary file left."""
    import torch

    ns = _user_ns(ns)
    pending: list[dict] = []
    current = None
    try:
        _make_dir(directory)
        _clean_stale(directory)
        for name in names:
            current = name
            if name not in ns:
                raise KeyError(name)
            obj = ns[name]
            kind = kind_of(obj)
            record = {
                "format": FORMAT,
                "version": VERSION,
                "name": name,
                "kind": kind,
                "type": type_name(obj),
                "state": state_of(obj, kind),
                **meta,
            }
            fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(name), suffix=".tmp", dir=directory)
            entry = {"name": name, "path": checkpoint_path(directory, name), "tmp": tmp, "kind": kind}
            entry["type"] = record["type"]
            pending.append(entry)
            with os.fdopen(fd, "wb") as raw:
                out = _Recorder(raw)
                try:
                    torch.save(record, out)
                except Exception as e:
                    if out.error is not None:
                        raise out.error from e
                    raise _Unsaveable(name, record["type"], f"{type(e).__name__}: {e}") from e
                raw.flush()
                os.fsync(raw.fileno())
            entry["bytes"] = os.path.getsize(tmp)
        current = None
        for entry in pending:
            os.replace(entry.pop("tmp"), entry["path"])
        _fsync_dir(directory)
    except KeyError as e:
        _discard(pending)
        return {"ok": False, "error": "missing", "name": e.args[0]}
    except _Unsaveable as e:
        _discard(pending)
        return {"ok": False, "error": "unsaveable", "name": e.name, "type": e.type_name, "detail": e.detail}
    except OSError as e:
        _discard(pending)
        return {
            "ok": False,
            "error": "os",
            "errno": e.errno,
            "strerror": e.strerror or str(e),
            "name": current,
        }
    except BaseException:  # an interrupt too: never leave a temporary file behind
        _discard(pending)
        raise
    return {"ok": True, "files": pending}


def _discard(pending: list[dict]) -> None:
    for entry in pending:
        if "tmp" in entry:
            try:
                os.unlink(entry["tmp"])
            except OSError:
                pass


def engine_stat(paths: list[str]) -> list[int | None]:
    """The size of each file as this rank sees it (None: it cannot see it)."""
    out = []
    for p in paths:
        try:
            out.append(os.stat(p).st_size)
        except OSError:
            out.append(None)
    return out


def _load(path: str):
    """A checkpoint: torch's safe loader first (tensors, state dicts, plain containers); a
    plain value of another type only from a file of this account that no one else can write."""
    import pickle

    import torch

    location = None if torch.cuda.is_available() else "cpu"
    try:
        return torch.load(path, map_location=location, weights_only=True)
    except pickle.UnpicklingError:
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PermissionError(
                f"{path} holds pickled objects and is not a file only you can write: not loaded"
            ) from None
        return torch.load(path, map_location=location, weights_only=False)


_PENDING: dict[str, dict] = {}  # loaded checkpoints between engine_prepare_restore and apply


def engine_prepare_restore(
    token: str, names: list[str], directory: str, ns: dict | None = None, skip_undefined: bool = False
) -> dict:
    """Load every name's checkpoint and check it fits this rank's object; keep them for
    ``engine_apply_restore``. ``{"ok": True, "records": {name: {kind, type, saved}}, "skipped":
    [...]}`` or ``{"ok": False, "problems": [{name, problem, text}]}``. ``skip_undefined``: a
    state-dict kind whose object is not defined here is skipped, not a problem."""
    ns = _user_ns(ns)
    problems, loaded, skipped = [], {}, []
    for name in names:
        path = checkpoint_path(directory, name)
        try:
            record = _load(path)
        except FileNotFoundError:
            problems.append({"name": name, "problem": "missing", "text": f"no checkpoint {path}"})
            continue
        except Exception as e:
            problems.append({"name": name, "problem": "unreadable", "text": f"cannot read {path}: {e}"})
            continue
        if not (isinstance(record, dict) and record.get("format") == FORMAT and record.get("kind") in KINDS):
            problems.append(
                {"name": name, "problem": "foreign", "text": f"{path} is not a gpuhub checkpoint"}
            )
            continue
        if record["kind"] in STATEFUL:
            if skip_undefined and name not in ns:
                skipped.append({"name": name, "kind": record["kind"], "type": record["type"]})
                continue
            why = fits(record["kind"], record["type"], record["state"], ns.get(name, _MISSING))
            if why:
                problems.append({"name": name, "problem": "target", "text": why})
                continue
        loaded[name] = record
    if problems:
        return {"ok": False, "problems": problems}
    _PENDING.clear()  # only one restore at a time
    _PENDING[token] = loaded
    return {
        "ok": True,
        "records": {n: {k: r.get(k) for k in ("kind", "type", "saved", "rank")} for n, r in loaded.items()},
        "skipped": skipped,
    }


def engine_apply_restore(token: str, ns: dict | None = None) -> dict:
    """Load what ``engine_prepare_restore`` kept into this rank: state dicts in place, tensors
    and values assigned. Answers each name's way."""
    ns = _user_ns(ns)
    done = {}
    for name, record in _PENDING.pop(token).items():
        kind, state = record["kind"], record["state"]
        if kind in ("ddp", "module"):
            target = ns[name]
            (target.module if kind_of(target) == "ddp" else target).load_state_dict(state)
            done[name] = "load_state_dict"
        elif kind in STATEFUL:
            ns[name].load_state_dict(state)
            done[name] = "load_state_dict"
        else:
            ns[name] = state
            done[name] = "assigned"
    return done


def engine_discard(token: str) -> None:
    _PENDING.pop(token, None)


# kernel side -------------------------------------------------------------------------------


@dataclass
class Saved:
    directory: str
    rank: int
    files: list[dict]
    unseen: dict[int, list[str]] = field(default_factory=dict)  # rank: files it cannot see
    skipped: dict[str, list[int]] = field(default_factory=dict)  # autosave: name: ranks lacking it

    def text(self, before: str | None = None) -> str:
        total = sum(f["bytes"] for f in self.files)
        head = "gpuhub: " + (f"autosaved before {before}" if before else "saved")
        lines = [f"{head} from rank {self.rank} to {self.directory} ({human_size(total)}):"]
        width = max(len(os.path.basename(f["path"])) for f in self.files)
        for f in self.files:
            base = os.path.basename(f["path"])
            lines.append(f"  {base:<{width}}  {human_size(f['bytes']):>10}  {KINDS[f['kind']]} ({f['type']})")
        for name, ranks in self.skipped.items():
            lines.append(f"  not saved: {name!r} is not defined on {ranks_text(ranks)}")
        for rank, paths in sorted(self.unseen.items()):
            lines.append(
                f"  warning: rank {rank} does not see {', '.join(map(os.path.basename, paths))}: restore "
                "reads the files on every rank; choose a --dir that every node shares (on Slurm: your home)"
            )
        return "\n".join(lines)


@dataclass
class Restored:
    directory: str
    ranks: int
    records: dict[str, dict]
    ways: dict[str, str]
    skipped: list[dict] = field(default_factory=list)  # state-dict kinds not defined yet

    def text(self) -> str:
        lines = [f"gpuhub: restored into {self.ranks} ranks from {self.directory}:"] if self.records else []
        for name, rec in self.records.items():
            way = "load_state_dict" if self.ways[name] == "load_state_dict" else "assigned"
            saved = (
                time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(rec["saved"])) if rec.get("saved") else "?"
            )
            lines.append(
                f"  {name}: {KINDS[rec['kind']]} ({rec['type']}), {way}; "
                f"saved {saved} from rank {rec.get('rank', 0)}"
            )
        if self.skipped:
            names = " ".join(s["name"] for s in self.skipped)
            which = ", ".join(f"{s['name']} ({KINDS[s['kind']]})" for s in self.skipped)
            lines.append(
                f"gpuhub: not restored yet: {which}: re-run the cells that define them, then "
                f"%distributed restore {names} --dir {self.directory}"
            )
        return "\n".join(lines)


class Checkpointer:
    """Save and restore names of a pool's ranks (the kernel side of this module)."""

    def __init__(self, pool, check_timeout: float = CHECK_TIMEOUT, save_timeout: float = SAVE_TIMEOUT):
        self.pool = pool
        self.check_timeout = check_timeout
        self.save_timeout = save_timeout

    def _call(self, ranks: list[int], timeout: float, fn, *args) -> tuple[dict[int, object], dict[int, str]]:
        """``fn(*args)`` on each rank's engine, together: each rank's answer, or why it gave none."""
        client = self.pool.client
        if client is None:
            raise UsageError("the engines are stopped: start them with a %%distributed cell")
        started, errors = {}, {}
        for r in ranks:
            try:
                started[r] = client[self.pool.engine_ids[r]].apply_async(fn, *args)
            except Exception as e:  # an engine the controller dropped (its process is gone)
                errors[r] = f"its engine is gone ({type(e).__name__}: {e})"
        if started:
            try:
                client.wait(list(started.values()), timeout=timeout)
            except Exception:
                pass  # each rank's own state is read below
        answers = {}
        for r, ar in started.items():
            if not ar.ready():
                errors[r] = f"did not answer within {timeout:.0f} s"
            elif not ar.successful():
                e = ar.exception()
                errors[r] = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
            else:
                answers[r] = ar.get()
        return answers, errors

    def _unreachable(self, what: str, errors: dict[int, str], done: str) -> UsageError:
        said = "; ".join(f"rank {r} {e}" for r, e in sorted(errors.items()))
        return UsageError(f"{what}: {said}. {done}")

    def _live_ranks(self) -> list[int]:
        ranks = list(range(self.pool.size))
        if getattr(self.pool, "_remote", False):
            return ranks
        return [r for r in ranks if r >= len(self.pool.infos) or alive(self.pool.infos[r]["pid"])]

    def save(self, names: list[str], directory: str, autosave: bool = False) -> Saved:
        """Check the names on every rank, then write them from rank 0 (autosave: the names
        rank 0 has, from the ranks that answer)."""
        what = "autosave" if autosave else "save"
        world = self.pool.size
        ranks = self._live_ranks() if autosave else list(range(world))
        found, errors = self._call(ranks, self.check_timeout, engine_inspect, names)
        if errors and (not autosave or 0 in errors):
            raise self._unreachable(what, errors, "Nothing was written.")
        missing = {n: [r for r in sorted(found) if found[r][n] is None] for n in names}
        missing = {n: rs for n, rs in missing.items() if rs}
        skipped = {}
        if missing and not autosave:
            raise UsageError(missing_message(what, missing, world))
        if autosave:
            skipped = {n: rs for n, rs in missing.items() if 0 in rs}
            names = [n for n in names if n not in skipped]
            if not names:
                raise UsageError(missing_message(what, skipped, world))
        meta = {"saved": time.time(), "rank": 0, "world_size": world}
        answers, errors = self._call([0], self.save_timeout, engine_save, names, directory, meta)
        if errors:
            raise self._unreachable(what, errors, "It may have left a temporary file in " + directory + ".")
        result = answers[0]
        if not result["ok"]:
            raise UsageError(self._save_error(what, result, directory, world))
        paths = [f["path"] for f in result["files"]]
        seen, _ = self._call([r for r in ranks if r != 0], self.check_timeout, engine_stat, paths)
        unseen = {}
        for r, sizes in seen.items():
            lost = [p for p, s, f in zip(paths, sizes, result["files"], strict=True) if s != f["bytes"]]
            if lost:
                unseen[r] = lost
        return Saved(directory, 0, result["files"], unseen, skipped)

    @staticmethod
    def _save_error(what: str, result: dict, directory: str, world: int) -> str:
        if result["error"] == "missing":
            return missing_message(what, {result["name"]: [0]}, world)
        if result["error"] == "unsaveable":
            return unsaveable_message(what, result["name"], result["type"], result["detail"])
        return os_error_message(what, result["errno"], result["strerror"], directory, result["name"])

    def restore(self, names: list[str], directory: str, skip_undefined: bool = False) -> Restored:
        """Load every name into every rank, or nothing anywhere (``skip_undefined``: leave out
        the state-dict kinds whose objects no rank defines yet)."""
        world = self.pool.size
        ranks = list(range(world))
        token = uuid.uuid4().hex
        prepared, errors = self._call(
            ranks, self.save_timeout, engine_prepare_restore, token, names, directory, None, skip_undefined
        )
        failed = {r: a for r, a in prepared.items() if not a["ok"]}
        if errors or failed:
            self._call([r for r in prepared if r not in failed], self.check_timeout, engine_discard, token)
            if errors:
                raise self._unreachable("restore", errors, "Nothing was restored.")
            problems: dict[tuple[str, str], list[int]] = {}
            for r, a in sorted(failed.items()):
                for p in a["problems"]:
                    problems.setdefault((p["name"], p["text"]), []).append(r)
            text = restore_problem_message(problems, world)
            if any(p["problem"] == "missing" for a in failed.values() for p in a["problems"]):
                text += f"\nCheckpoints in {directory}: {', '.join(list_checkpoints(directory)) or 'none'}."
            raise UsageError(text)
        ways, errors = self._call(ranks, self.save_timeout, engine_apply_restore, token)
        if errors:
            said = "; ".join(f"rank {r} {e}" for r, e in sorted(errors.items()))
            raise UsageError(
                f"restore: {said}. The other ranks were restored: run the restore again, or restart "
                "the engines (%distributed shutdown) if a rank is gone."
            )
        return Restored(directory, world, prepared[0]["records"], ways[0], prepared[0]["skipped"])


def list_checkpoints(directory: str) -> list[str]:
    try:
        return sorted(
            f[: -len(SUFFIX)] for f in os.listdir(directory) if f.endswith(SUFFIX) and not f.startswith(".")
        )
    except OSError:
        return []


def say(text: str, err: bool = False) -> None:
    """Print, and never fail (at kernel exit the notebook's streams may be closed)."""
    try:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)
    except Exception:
        try:
            sys.__stderr__.write(text + "\n")
        except Exception:
            pass


# the magic's side ----------------------------------------------------------------------------

# what stops a pool, as the autosave's message says it
WHY = {
    "idle": "the idle stop",
    "reclaim": "the burst allocation ended",
    "shutdown": "%distributed shutdown",
    "exit": "kernel shutdown",
    "resize": "the resize",
    "restart": "restarting the engines",
}


class CheckpointCommands:
    """``DistributedMagics``' save, restore and autosave (a mixin: it uses the magic's
    ``pool``, ``lock``, ``busy``, ``last_used``, ``_touch`` and ``_lease_lost``).

    Autosave names are remembered for the pool: a pool that stops (idle, reclaim, shutdown,
    kernel exit, a restart) forgets them, so that a fresh pool's new objects never overwrite
    the checkpoints of the old one; only a resize keeps them for the new pool."""

    autosave: list[str] = []
    autosave_dir: str = ""
    last_autosave: tuple[list[str], str] | None = None  # the last autosave that wrote: names, dir
    _autosaved: tuple | None = None  # (pool, last_used, why) of the last autosave
    _exit_hook = None  # the pool the kernel-exit autosave was registered after
    _pending: frozenset | set = frozenset()  # names a resize could not restore yet: not autosaved

    def _checkpoint_command(self, command: str, names: list[str], directory: str | None) -> None:
        """``%distributed save|restore NAME... [--dir D]``."""
        names = check_names(names, command)
        if self.pool is None:
            first = " and re-run the cells that define them" if command == "restore" else ""
            raise UsageError(
                f"{command}: no engines are running: start them with a %%distributed cell{first}"
            )
        where = resolve_dir(directory)
        with self.lock:
            self.busy += 1  # the idle timer waits for it
        try:
            checkpointer = Checkpointer(self.pool)
            if command == "save":
                text = checkpointer.save(names, where).text()
            else:
                text = checkpointer.restore(names, where).text()
            self._pending = self._pending - set(names)  # restored (or saved on purpose): autosaved again
        finally:
            with self.lock:
                self.busy -= 1
                self._touch()
        print(text)

    def _set_autosave(self, names: list[str] | None, directory: str | None, quiet: bool = False) -> None:
        """A cell's ``--autosave NAME... [--dir D]`` (None: not given; []: ``--autosave`` alone, off)."""
        if names is None:
            return
        if not names:
            if self.autosave and not quiet:
                say("gpuhub: autosave off.")
            self.autosave = []
            return
        names, where = check_names(names, "--autosave"), resolve_dir(directory)
        if (names, where) != (self.autosave, self.autosave_dir) and not quiet:
            say(
                f"gpuhub: autosave of {', '.join(names)} to {where} before the engines stop "
                "(idle stop, reclaim, shutdown, resize, kernel exit)."
            )
        self.autosave, self.autosave_dir = names, where
        self._hook_exit()

    def _hook_exit(self) -> None:
        """(Re)register the kernel-exit autosave after the pool's start: ipyparallel registers
        its own exit hook (which stops the engines) each time a cluster starts, and exit hooks
        run last registered first, so this one must come after it to save while the engines
        still live."""
        if self.pool is None or not self.autosave or self._exit_hook is self.pool:
            return
        import atexit

        atexit.unregister(self._autosave_at_exit)
        atexit.register(self._autosave_at_exit)
        self._exit_hook = self.pool

    def _autosave_text(self) -> str | None:
        if not self.autosave:
            return None
        return f"autosave: {', '.join(self.autosave)} to {self.autosave_dir}"

    def _stop_reason(self, why: str | None) -> str:
        if why:
            return why
        if self._lease_lost():
            return "reclaim"
        if self._autosaved and self._autosaved[0] is self.pool and self._autosaved[2] == "resize":
            return "resize"  # the resize saved first, then stops the pool
        return "restart"

    def _save_before_stop(self, why: str) -> None:
        """Save the autosave names of the pool before its processes end (``why``: a key of
        ``WHY``). Raises UsageError when it could not (the callers that stop anyway report it);
        saves once however often it is called while no cell ran."""
        pool, names = self.pool, [n for n in self.autosave if n not in self._pending]
        if self.autosave and not names:
            say(f"gpuhub: not autosaved: {', '.join(self.autosave)} not restored since the resize.", err=True)
        if pool is None or not names or getattr(pool, "client", None) is None:
            return
        if self._autosaved and self._autosaved[0] is pool and self._autosaved[1] == self.last_used:
            return
        before = WHY.get(why, why)
        if pool.broken:
            raise UsageError(
                f"autosave skipped before {before}: the last cell lost a rank, so the other ranks may "
                f"have stopped half-way through a step; the checkpoints in {self.autosave_dir} are "
                "kept as they were."
            )
        saved = Checkpointer(pool).save(names, self.autosave_dir, autosave=True)
        self._autosaved = (pool, self.last_used, why)
        self.last_autosave = ([f["name"] for f in saved.files], self.autosave_dir)
        say(saved.text(before))
        if self._pending & set(self.autosave):
            later = ", ".join(sorted(self._pending & set(self.autosave)))
            say(f"  not saved: {later} (not restored since the resize: the checkpoints are kept)")

    def _save_then_forget(self, why: str | None) -> str:
        """For ``_stop_pool``: the autosave, never failing the stop; answers the reason."""
        why = self._stop_reason(why)
        try:
            self._save_before_stop(why)
        except BaseException as e:  # an interrupt too: the engines are stopped regardless
            say(f"gpuhub: {e} The engines are stopped anyway.", err=True)
        return why

    def _restore_after_resize(self) -> None:
        """The new pool of a resize gets back what the old one autosaved: tensors and values
        now; modules, optimizers and schedulers once the user's cells define them again (said,
        and left out of autosave until they are restored, so that fresh objects never
        overwrite their checkpoints)."""
        if not self.last_autosave or self.pool is None:
            return
        names, where = self.last_autosave
        try:
            restored = Checkpointer(self.pool).restore(names, where, skip_undefined=True)
        except Exception as e:
            say(f"gpuhub: could not restore {', '.join(names)} into the new engines: {e}", err=True)
            self._pending = set(names)
            return
        if restored.text():
            say(restored.text())
        self._pending = {s["name"] for s in restored.skipped}
        if self._pending & set(self.autosave):
            say(f"gpuhub: autosave leaves out {', '.join(sorted(self._pending))} until they are restored.")

    def _forget_autosave(self, why: str) -> None:
        if why != "resize":
            self.autosave = []
            self._pending = set()

    def _autosave_at_exit(self) -> None:
        try:
            if not self.lock.acquire(timeout=30):
                return
            try:
                if self.pool is not None and self.autosave:
                    self._save_before_stop("exit")
            finally:
                self.lock.release()
        except BaseException as e:
            say(f"gpuhub: autosave at kernel shutdown failed: {e}", err=True)
