"""The engine side of ``%distributed save|restore`` (``common/checkpoint.py`` has the format
and the pure parts, ``kernel/checkpoints.py`` the kernel side): functions that run inside the
ranks' engines through ipyparallel, on the names of the engine's IPython user namespace. They
never raise for a user's mistake; they answer plain dicts that the kernel side turns into a
``UsageError``."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import tempfile

from gpu_magics.common.checkpoint import (
    _MISSING,
    DCP_KINDS,
    DCP_SUFFIX,
    DCP_VERSION,
    FORMAT,
    KINDS,
    META_FILE,
    MODULES,
    STATEFUL,
    SUFFIX,
    VERSION,
    checkpoint_path,
    dcp_path,
    fits,
    kind_of,
    match_optimizers,
    module_fit,
    no_model_here,
    optimizer_fit,
    resolve_dir,
    stale_temps,
    state_of,
    temp_name,
    type_name,
)
from gpu_magics.common.procs import alive
from gpu_magics.engine.dcp import fsync_dir

MARK = "mark"  # in a save's temporary directory: what every rank must see before it writes

# engine side -------------------------------------------------------------------------------


def _user_ns(ns: dict | None) -> dict:
    if ns is not None:
        return ns
    from IPython import get_ipython

    return get_ipython().user_ns


def _modules(ns: dict, names) -> dict[str, list[int]]:
    from gpu_magics.engine.dcp import param_ids

    out = {}
    for n in names:
        obj = ns.get(n, _MISSING)
        if obj is not _MISSING and not n.startswith("_") and _is_module(obj):
            out[n] = param_ids(obj)
    return out


def _is_module(obj) -> bool:
    try:
        import torch

        return isinstance(obj, torch.nn.Module)
    except ImportError:
        return False


def engine_inspect(names: list[str], ns: dict | None = None) -> dict:
    """Each name's kind and type on this rank; None where it is not defined. An optimizer's
    ``model``: the name among ``names`` of the module that holds its parameters (None: none
    does), and ``suggest``: a name of this namespace that does."""
    from gpu_magics.engine.dcp import param_ids

    ns = _user_ns(ns)
    out = {}
    saved_modules = _modules(ns, names)
    for n in names:
        if n not in ns:
            out[n] = None
            continue
        kind = kind_of(ns[n])
        out[n] = {"kind": kind, "type": type_name(ns[n])}
        if kind == "optimizer":
            ids = {n: param_ids(ns[n])}
            out[n]["model"] = match_optimizers(ids, saved_modules)[n]
            if out[n]["model"] is None:
                out[n]["suggest"] = match_optimizers(ids, _modules(ns, list(ns)))[n]
    return out


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


class _Failed(Exception):
    """A rank's DCP write that failed for another reason than the file system."""

    def __init__(self, name: str, detail: str):
        super().__init__(detail)
        self.name, self.detail = name, detail


def _make_dir(directory: str) -> None:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.abspath(directory) == resolve_dir(None):
        st = os.stat(directory)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(directory, 0o700)  # the default directory is private


def _temp_prefix(name: str) -> str:
    return f".{name}{SUFFIX}.{socket.gethostname()}.{os.getpid()}."


def _clean_stale(directory: str, current: str | None = None) -> None:
    """Temporary files and directories of saves on this host that can no longer finish (an
    engine or kernel killed mid-write; this kernel's own earlier ones)."""
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
    try:
        listing = os.listdir(directory)
    except OSError:
        return
    for b in stale_temps(listing, host, alive, current):
        shutil.rmtree(os.path.join(directory, b), ignore_errors=True)


def engine_prepare_dir(temp: str) -> dict:
    """Rank 0, before a save: the checkpoints' directory and the save's temporary directory in
    it, with a mark that every other rank must see (``engine_stat``) before any writes."""
    directory = os.path.dirname(temp)
    try:
        _make_dir(directory)
        _clean_stale(directory, os.path.basename(temp))
        os.makedirs(temp, mode=0o700)
        with open(os.path.join(temp, MARK), "w") as f:
            f.write(socket.gethostname())
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        return _os_error(e, None)
    return {"ok": True}


def _write_record(name: str, obj, kind: str, meta: dict, path: str) -> int:
    """One name in the one-file format (version 1) at ``path``: written, flushed, fsynced."""
    import torch

    record = {
        "format": FORMAT,
        "version": VERSION,
        "name": name,
        "kind": kind,
        "type": type_name(obj),
        "state": state_of(obj, kind),
        **{k: v for k, v in meta.items() if k != "save"},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
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
    return os.path.getsize(path)


def _tree_size(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def engine_write(
    temp: str, names: list[str], models: dict, meta: dict, ns: dict | None = None, solo: bool = False
) -> dict:
    """Every rank, together: each model and optimizer of ``names`` into ``TEMP/NAME.dcp`` (its
    own shards, ``dcp.save``); rank 0 also writes the other names (``TEMP/NAME.pt``) and each
    DCP directory's ``gpuhub.json``. ``models``: each optimizer's model's name. ``solo``: this
    process writes alone (as rank 0 of a world of one: state that it holds whole).

    ``{"ok": True, "files": [{name, path, kind, type, bytes}]}`` (``path``: where the name
    goes once committed), or ``{"ok": False, "error": "missing"|"unsaveable"|"os"|"failed",
    ...}``; on failure this rank removes the temporary directory."""
    from gpu_magics.engine import dcp

    ns = _user_ns(ns)
    rank, world = (0, 1) if solo else dcp.rank_and_world()
    directory = os.path.dirname(temp)
    files, current, kinds = [], None, {}
    try:
        os.makedirs(temp, mode=0o700, exist_ok=True)
        for name in names:
            if name not in ns:
                raise KeyError(name)
        kinds = {n: kind_of(ns[n]) for n in names}
        for name in [n for n in names if kinds[n] in DCP_KINDS]:
            current = name
            obj, kind = ns[name], kinds[name]
            if kind == "optimizer":
                state = dcp.optimizer_state(ns[models[name]], obj)
            else:
                state = dcp.model_state(obj)
            path = os.path.join(temp, name + DCP_SUFFIX)
            try:
                dcp.save(state, path, solo)
            except OSError:
                raise
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException is a BaseException
                found = dcp.first_os_error(e)
                if found is not None:
                    raise found from e
                raise _Failed(name, dcp.describe(e)) from e
            entry = {"name": name, "kind": kind, "type": type_name(obj), "path": dcp_path(directory, name)}
            if kind == "optimizer":
                entry["model"] = models[name]
            if rank == 0:
                record = {"format": FORMAT, "version": DCP_VERSION, **entry, **meta}
                record.pop("path")
                with open(os.path.join(path, META_FILE), "w") as f:
                    json.dump(record, f)
                    f.flush()
                    os.fsync(f.fileno())
                entry["bytes"] = _tree_size(path)
            files.append(entry)
        if rank == 0:
            for name in [n for n in names if kinds[n] not in DCP_KINDS]:
                current = name
                size = _write_record(name, ns[name], kinds[name], meta, os.path.join(temp, name + SUFFIX))
                files.append(
                    {
                        "name": name,
                        "kind": kinds[name],
                        "type": type_name(ns[name]),
                        "path": checkpoint_path(directory, name),
                        "bytes": size,
                    }
                )
        current = None
    except KeyError as e:
        shutil.rmtree(temp, ignore_errors=True)
        return {"ok": False, "error": "missing", "name": e.args[0], "rank": rank}
    except _Unsaveable as e:
        shutil.rmtree(temp, ignore_errors=True)
        return {"ok": False, "error": "unsaveable", "name": e.name, "type": e.type_name, "detail": e.detail}
    except _Failed as e:
        shutil.rmtree(temp, ignore_errors=True)
        return {"ok": False, "error": "failed", "name": e.name, "detail": e.detail}
    except OSError as e:
        shutil.rmtree(temp, ignore_errors=True)
        suffix = DCP_SUFFIX if current is not None and kinds.get(current) in DCP_KINDS else SUFFIX
        return {**_os_error(e, current), "suffix": suffix}
    except BaseException:  # an interrupt too: never leave a temporary directory behind
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return {"ok": True, "files": files, "rank": rank, "world": world}


def _os_error(e: OSError, name: str | None) -> dict:
    return {"ok": False, "error": "os", "errno": e.errno, "strerror": e.strerror or str(e), "name": name}


def _short(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def engine_commit(temp: str, files: list[dict]) -> dict:
    """Rank 0, once every rank's part is written: each name into place with one atomic rename
    (a DCP directory that exists is swapped with the new one; a name's file of the other
    format goes), the directory fsynced, the temporary directory (now holding what was
    replaced) removed. ``{"ok": True}`` or ``{"ok": False, "error": "os", ...}``."""
    from gpu_magics.engine import dcp

    directory = os.path.dirname(temp)
    current = None
    try:
        for f in files:
            staged = os.path.join(temp, os.path.basename(f["path"]))
            if os.path.isdir(staged):
                dcp.fsync_tree(staged)
        fsync_dir(temp)
        for f in files:
            current = f["name"]
            final = f["path"]
            staged = os.path.join(temp, os.path.basename(final))
            other = (
                checkpoint_path(directory, f["name"])
                if final.endswith(DCP_SUFFIX)
                else dcp_path(directory, f["name"])
            )
            if os.path.isdir(final) and not os.path.islink(final):
                if not dcp.exchange(staged, final):  # no RENAME_EXCHANGE here: aside, then in
                    os.rename(final, staged + ".old")
                    os.rename(staged, final)
            else:
                os.replace(staged, final)
            if os.path.lexists(other):  # the same name in the other format: replaced too
                os.rename(other, os.path.join(temp, "old." + os.path.basename(other)))
        fsync_dir(directory)
    except OSError as e:
        return {
            "ok": False,
            "error": "os",
            "errno": e.errno,
            "strerror": e.strerror or str(e),
            "name": current,
        }
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return {"ok": True}


def engine_remove(temp: str) -> None:
    """A failed save's temporary directory (any rank that sees it)."""
    shutil.rmtree(temp, ignore_errors=True)


def engine_save(
    names: list[str],
    directory: str,
    meta: dict,
    ns: dict | None = None,
    temp: str | None = None,
    solo: bool = False,
) -> dict:
    """A whole save in this process (every rank calls it together where there are several;
    rank 0 makes it visible once its DCP writes returned, which is once every rank's are
    written): for a namespace without a kernel (the preemption's save, tests). An optimizer's
    model must be among ``names``. Answers as ``engine_write``."""
    import uuid

    from gpu_magics.engine import dcp

    ns = _user_ns(ns)
    rank, _ = (0, 1) if solo else dcp.rank_and_world()
    found = engine_inspect(names, ns)
    for n, info in found.items():
        if info is None:
            return {"ok": False, "error": "missing", "name": n, "rank": rank}
        if info["kind"] == "optimizer" and info["model"] is None:
            return {"ok": False, "error": "no model", "name": n, "suggest": info.get("suggest")}
    models = {n: i["model"] for n, i in found.items() if i["kind"] == "optimizer"}
    if temp is None:
        temp = os.path.join(directory, temp_name(socket.gethostname(), os.getpid(), uuid.uuid4().hex[:12]))
    try:
        _make_dir(directory)
    except OSError as e:
        return _os_error(e, None)
    if rank == 0:
        _clean_stale(directory, os.path.basename(temp))
    result = engine_write(temp, names, models, meta, ns, solo)
    if not result["ok"] or rank != 0:
        return result
    committed = engine_commit(temp, result["files"])
    if not committed["ok"]:
        return committed
    return result


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


def _prepare_dcp(name: str, path: str, ns: dict, skip_undefined: bool):
    """A version 2 checkpoint: (record, None), (None, problem), or ("skip", None)."""
    from gpu_magics.engine import dcp

    try:
        with open(os.path.join(path, META_FILE)) as f:
            record = json.load(f)
        keys = dcp.saved_keys(path)
    except FileNotFoundError as e:
        return None, {
            "problem": "unreadable",
            "text": f"{path} is not a whole checkpoint ({e.filename} is missing)",
        }
    except Exception as e:
        return None, {"problem": "unreadable", "text": f"cannot read {path}: {_short(e)}"}
    if not (isinstance(record, dict) and record.get("format") == FORMAT and record.get("kind") in DCP_KINDS):
        return None, {"problem": "foreign", "text": f"{path} is not a gpuhub checkpoint"}
    record["path"] = path
    kind = record["kind"]
    if name not in ns:
        if skip_undefined:
            return "skip", None
        return None, {"problem": "target", "text": fits(kind, record["type"], None, _MISSING)}
    target = ns[name]
    if kind in MODULES:
        if kind_of(target) not in MODULES:
            return None, {
                "problem": "target",
                "text": f"is a {type_name(target)}, not a module: define {name} as it was saved (same "
                "layers) in a cell, then restore",
            }
        why = module_fit(name, keys, dcp.shapes(dcp.model_state(target)))
        return (None, {"problem": "target", "text": why}) if why else (record, None)
    why = (
        fits(kind, record["type"], None, target)
        if kind_of(target) != "optimizer" or type_name(target) != record["type"]
        else None
    )
    if why:
        return None, {"problem": "target", "text": why}
    from gpu_magics.engine.dcp import param_ids

    modules = _modules(ns, list(ns))
    if record.get("model") in modules:  # the model it was saved with first
        modules = {record["model"]: modules.pop(record["model"]), **modules}
    model = match_optimizers({name: param_ids(target)}, modules)[name]
    if model is None:
        return None, {"problem": "target", "text": no_model_here(name, record.get("model"))}
    why = optimizer_fit(name, keys, model, dcp.model_state(ns[model]).keys(), len(target.param_groups))
    if why:
        return None, {"problem": "target", "text": why}
    record["model_here"] = model
    return record, None


def engine_prepare_restore(
    token: str, names: list[str], directory: str, ns: dict | None = None, skip_undefined: bool = False
) -> dict:
    """Read every name's checkpoint (a DCP directory's description and keys; a version 1
    file whole) and check it fits this rank's object; keep them for ``engine_apply_restore``.
    ``{"ok": True, "records": {name: {kind, type, saved, rank, world_size, version}}, "skipped":
    [...], "dcp": [names]}`` or ``{"ok": False, "problems": [{name, problem, text}]}``.
    ``skip_undefined``: a state-dict kind whose object is not defined here is skipped."""
    ns = _user_ns(ns)
    problems, loaded, skipped = [], {}, []
    for name in names:
        dpath, path = dcp_path(directory, name), checkpoint_path(directory, name)
        if os.path.isdir(dpath):
            record, problem = _prepare_dcp(name, dpath, ns, skip_undefined)
            if problem:
                problems.append({"name": name, **problem})
            elif record == "skip":
                with open(os.path.join(dpath, META_FILE)) as f:
                    meta = json.load(f)
                skipped.append({"name": name, "kind": meta["kind"], "type": meta["type"]})
            else:
                loaded[name] = record
            continue
        try:
            record = _load(path)
        except FileNotFoundError:
            problems.append({"name": name, "problem": "missing", "text": f"no checkpoint {dpath} or {path}"})
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
            if not why and record["kind"] in MODULES and kind_of(ns[name]) == "sharded":
                from gpu_magics.engine import dcp

                why = module_fit(name, dcp.shapes(record["state"]), dcp.shapes(dcp.model_state(ns[name])))
            if not why and record["kind"] == "optimizer" and _sharded_model_of(ns, ns[name]):
                why = (
                    "is an optimizer of a sharded model, and this checkpoint is of gpuhub's first format "
                    "(one file, before sharded checkpoints): restore it into the model unsharded, then "
                    "shard it and save again"
                )
            if why:
                problems.append({"name": name, "problem": "target", "text": why})
                continue
        loaded[name] = record
    if problems:
        return {"ok": False, "problems": problems}
    _PENDING.clear()  # only one restore at a time
    _PENDING[token] = loaded
    keep = ("kind", "type", "saved", "rank", "world_size", "version", "model")
    return {
        "ok": True,
        "records": {n: {k: r.get(k) for k in keep} for n, r in loaded.items()},
        "skipped": skipped,
        "dcp": [n for n, r in loaded.items() if r.get("version") == DCP_VERSION],
    }


def _sharded_model_of(ns: dict, opt) -> bool:
    from gpu_magics.engine.dcp import param_ids

    ids = set(param_ids(opt))
    return any(kind_of(ns[m]) == "sharded" and ids & set(p) for m, p in _modules(ns, list(ns)).items())


def engine_apply_restore(token: str, ns: dict | None = None) -> dict:
    """Load what ``engine_prepare_restore`` kept into this rank (every rank together: DCP's
    loads are collectives): models, then optimizers, through ``dcp.load`` and
    ``set_state_dict``; version 1 state dicts in place; tensors and values assigned. Answers
    each name's way."""
    from gpu_magics.engine import dcp

    ns = _user_ns(ns)
    done = {}
    pending = _PENDING.pop(token)
    order = sorted(
        pending, key=lambda n: (pending[n].get("version") != DCP_VERSION, pending[n]["kind"] == "optimizer")
    )
    for name in order:
        record = pending[name]
        kind = record["kind"]
        if record.get("version") == DCP_VERSION:
            try:
                if kind == "optimizer":
                    dcp.restore_optimizer(ns[record["model_here"]], ns[name], record["path"])
                else:
                    dcp.restore_model(ns[name], record["path"])
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # DCP's CheckpointException: one line, no tracebacks
                raise RestoreFailed(f"{name} from {record['path']}: {dcp.describe(e)}") from None
            done[name] = "dcp.load"
            continue
        state = record["state"]
        if kind in MODULES:
            target = ns[name]
            have = kind_of(target)
            if have == "sharded":
                dcp.restore_full_model(target, state)
            else:
                (target.module if have == "ddp" else target).load_state_dict(state)
            done[name] = "load_state_dict"
        elif kind in STATEFUL:
            ns[name].load_state_dict(state)
            done[name] = "load_state_dict"
        else:
            ns[name] = state
            done[name] = "assigned"
    return done


class RestoreFailed(RuntimeError):
    """A rank's DCP load that failed (said in one line)."""


def engine_discard(token: str) -> None:
    _PENDING.pop(token, None)


# preemption: the engine's own save at Slurm's SIGTERM (gpu_magics.engine.main) ---------------


AUTOSAVE_NAMES = "GPUHUB_AUTOSAVE_NAMES"  # the engines' job: names saved at Slurm's SIGTERM
AUTOSAVE_DIR = "GPUHUB_AUTOSAVE_DIR"


def preempt_rank(environ) -> tuple[int, int]:
    """(rank, world size) of this engine: the pool's ``RANK``/``WORLD_SIZE`` once it set them,
    else Slurm's task id and count."""
    rank = environ.get("RANK") or environ.get("SLURM_PROCID") or "0"
    world = environ.get("WORLD_SIZE") or environ.get("SLURM_NTASKS") or "1"
    return (int(rank) if rank.isdigit() else 0), (int(world) if world.isdigit() else 1)


def preempt_report_path(directory: str, job_id: str) -> str:
    """Where the engines' save at preemption is recorded (JSON) for the kernel to show."""
    return os.path.join(directory, f".gpuhub-preempted-{job_id or 'nojob'}.json")


PREEMPT_GATHER = "GPUHUB_PREEMPT_GATHER_SECONDS"  # how long a preempted rank waits for the others


def engine_preempt_save(names: list[str], directory: str, ns: dict, environ) -> dict:
    """At preemption, on every rank that gets Slurm's SIGTERM: the names this rank has (as
    ``--autosave`` does: a name it lacks is skipped, and so is an optimizer whose model is not
    among the names) into ``directory`` in the ``%distributed save`` format. Where every rank
    of the pool is preempted together (they meet in the process group's store within
    ``GPUHUB_PREEMPT_GATHER_SECONDS``, 10 s), every rank writes its shards of the models and
    optimizers, rank 0 the other names, and rank 0 makes the save visible once every rank's
    part is written. Where only some ranks are (another job's ranks go on), rank 0 saves
    alone what it holds whole (unsharded models and their optimizers, values); sharded ones
    are named as not saved. Rank 0 records the answer in :func:`preempt_report_path`.
    Answers ``{"rank", "saved": [names], "skipped": [names], "ok", "text"}``."""
    import time

    from gpu_magics.engine import dcp

    rank, world = preempt_rank(environ)
    job = environ.get("SLURM_JOB_ID", "")
    found = engine_inspect([n for n in names if n in ns], ns)
    skipped = [n for n in names if n not in ns]
    no_model = [n for n, i in found.items() if i["kind"] == "optimizer" and i["model"] is None]
    have = [n for n in found if n not in no_model]
    try:
        wait = float(environ.get(PREEMPT_GATHER) or 10.0)
    except ValueError:
        wait = 10.0
    together = not any(found[n]["kind"] in DCP_KINDS for n in have) or dcp.everyone_here(
        f"gpuhub-preempt-{job}", world, wait
    )
    sharded: list[str] = []
    if not together:
        if rank != 0:
            return {"rank": rank, "ok": True, "saved": [], "skipped": [],
                    "text": f"gpuhub: engine rank {rank} preempted by Slurm (job {job}) without the other "
                            "ranks: rank 0 saves what it holds whole"}  # fmt: skip
        sharded = [n for n in have if found[n]["kind"] == "sharded"]
        sharded += [n for n in have if found[n]["kind"] == "optimizer" and found[n]["model"] in sharded]
        have = [n for n in have if n not in sharded]
    meta = {"saved": time.time(), "rank": 0, "world_size": world, "reason": "preempted", "save": f"job-{job}"}
    temp = os.path.join(directory, temp_name(f"job-{job or 'none'}", 0, "preempt"))
    if have:
        result = engine_save(have, directory, meta, ns, temp=temp, solo=not together)
    else:
        result = {"ok": True, "files": []}
    saved = [f["name"] for f in result.get("files", [])] if result["ok"] else []
    left = (
        (f"; not defined: {', '.join(skipped)}" if skipped else "")
        + (f"; not saved (its model is not autosaved with it): {', '.join(no_model)}" if no_model else "")
        + (
            f"; not saved (sharded, and not every rank was preempted with this one): {', '.join(sharded)}"
            if sharded
            else ""
        )
    )
    if rank != 0:
        done = [n for n in saved if found[n]["kind"] in DCP_KINDS]
        text = (
            f"gpuhub: engine rank {rank} preempted by Slurm (job {job}): "
            + (f"wrote its shards of {', '.join(done)} (rank 0 saves the rest)" if done else "rank 0 saves")
            if result["ok"]
            else f"gpuhub: engine rank {rank} preempted by Slurm (job {job}): autosave failed: {result}"
        )
        return {"rank": rank, "ok": result["ok"], "saved": saved, "skipped": skipped, "text": text}
    if result["ok"]:
        text = (
            f"gpuhub: engine rank 0 preempted by Slurm (job {job}): saved {', '.join(saved) or 'nothing'}"
            f" to {directory}" + left
        )
    else:
        text = f"gpuhub: engine rank 0 preempted by Slurm (job {job}): autosave failed: {result}"
    report = {
        "job": job,
        "rank": 0,
        "ok": result["ok"],
        "saved": saved,
        "skipped": skipped + no_model + sharded,
        "directory": directory,
        "time": meta["saved"],
        "text": text,
    }
    try:
        _make_dir(directory)
        path = preempt_report_path(directory, job)
        fd, tmp = tempfile.mkstemp(prefix=".gpuhub-preempted.", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)
    except OSError as e:
        report["text"] += f" (report not written: {e})"
    return {"rank": 0, **report}
