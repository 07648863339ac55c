"""The engine side of ``%distributed save|restore`` (``common/checkpoint.py`` has the format
and the pure parts, ``kernel/checkpoints.py`` the kernel side): functions that run inside the
ranks' engines through ipyparallel, on the names of the engine's IPython user namespace. They
never raise for a user's mistake; they answer plain dicts that the kernel side turns into a
``UsageError``."""

from __future__ import annotations

import glob
import os
import socket
import tempfile

from gpu_magics.common.checkpoint import (
    _MISSING,
    FORMAT,
    KINDS,
    STATEFUL,
    SUFFIX,
    VERSION,
    checkpoint_path,
    fits,
    kind_of,
    resolve_dir,
    state_of,
    type_name,
)
from gpu_magics.common.procs import alive

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


def engine_preempt_save(names: list[str], directory: str, ns: dict, environ) -> dict:
    """At preemption: rank 0 saves the names it has (as ``--autosave`` does: a name this rank
    lacks is skipped), into ``directory`` in the ``%distributed save`` format, and records the
    answer in :func:`preempt_report_path`; other ranks save nothing. Answers
    ``{"rank", "saved": [names], "skipped": [names], "ok", "text"}``."""
    import json
    import time

    rank, world = preempt_rank(environ)
    job = environ.get("SLURM_JOB_ID", "")
    if rank != 0:
        return {"rank": rank, "ok": True, "saved": [], "skipped": [],
                "text": f"gpuhub: engine rank {rank} preempted (rank 0 saves)"}  # fmt: skip
    have = [n for n in names if n in ns]
    skipped = [n for n in names if n not in ns]
    meta = {"saved": time.time(), "rank": 0, "world_size": world, "reason": "preempted"}
    result = engine_save(have, directory, meta, ns) if have else {"ok": True, "files": []}
    saved = [f["name"] for f in result.get("files", [])] if result["ok"] else []
    if result["ok"]:
        text = (
            f"gpuhub: engine rank 0 preempted by Slurm (job {job}): saved {', '.join(saved) or 'nothing'}"
            f" to {directory}" + (f"; not defined: {', '.join(skipped)}" if skipped else "")
        )
    else:
        text = f"gpuhub: engine rank 0 preempted by Slurm (job {job}): autosave failed: {result}"
    report = {"job": job, "rank": 0, "ok": result["ok"], "saved": saved, "skipped": skipped,
              "directory": directory, "time": meta["saved"], "text": text}  # fmt: skip
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
