"""The kernel side of ``%distributed save|restore`` and ``--autosave``: ``Checkpointer``
(given an ``EnginePool``: checks every rank, saves from rank 0, restores into every rank, all
or nothing) and ``CheckpointCommands``, the magic's part (``DistributedMagics`` inherits it)."""

from __future__ import annotations

import keyword
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

from IPython.core.error import UsageError

from gpu_magics.common.checkpoint import (
    CHECK_TIMEOUT,
    DCP_KINDS,
    DCP_SUFFIX,
    KINDS,
    SAVE_TIMEOUT,
    SUFFIX,
    dir_problem,
    human_size,
    missing_message,
    no_model_message,
    ranks_text,
    resolve_dir,
    restore_problem_message,
    save_error_text,
    stale_temps,
    temp_name,
)
from gpu_magics.common.procs import alive
from gpu_magics.common.words import count, stamp
from gpu_magics.engine.checkpoints import (
    MARK,
    engine_apply_restore,
    engine_commit,
    engine_discard,
    engine_inspect,
    engine_prepare_dir,
    engine_prepare_restore,
    engine_remove,
    engine_stat,
    engine_write,
)

# kernel side -------------------------------------------------------------------------------


@dataclass
class Saved:
    directory: str
    rank: int
    files: list[dict]
    unseen: dict[int, list[str]] = field(default_factory=dict)  # rank: files it cannot see
    skipped: dict[str, list[int]] = field(default_factory=dict)  # autosave: name: ranks lacking it
    left_out: dict[str, str] = field(default_factory=dict)  # autosave: name: why it was not saved
    writers: int = 1  # how many ranks wrote (every rank: models and optimizers, their shards)

    def warnings(self) -> list[str]:
        """What the user must know of this save (names left out, ranks that cannot see it)."""
        lines = [
            f"  not saved: {name!r} is not defined on {ranks_text(ranks)}"
            for name, ranks in self.skipped.items()
        ]
        lines += [f"  not saved: {name!r}: {why}" for name, why in self.left_out.items()]
        for rank, paths in sorted(self.unseen.items()):
            lines.append(
                f"  warning: rank {rank} does not see {', '.join(map(os.path.basename, paths))}: restore "
                "reads the files on every rank; choose a --dir that every node shares (on Slurm: your home)"
            )
        return lines

    def brief(self) -> str:
        """``model, w autosaved to DIR (1.2 KiB)``: one clause, for a resize's one line."""
        total = sum(f["bytes"] for f in self.files)
        names = ", ".join(f["name"] for f in self.files)
        return f"{names} autosaved to {self.directory} ({human_size(total)})"

    def source(self) -> str:
        """Who wrote it: ``from rank 0``, or ``by 2 ranks (each its own shards)``."""
        if self.writers > 1:
            return f"by {self.writers} ranks (each its own shards of models and optimizers)"
        return f"from rank {self.rank}"

    def text(self, before: str | None = None) -> str:
        total = sum(f["bytes"] for f in self.files)
        head = "gpuhub: " + (f"autosaved before {before}" if before else "saved")
        lines = [f"{head} {self.source()} to {self.directory} ({human_size(total)}):"]
        width = max(len(os.path.basename(f["path"])) for f in self.files)
        for f in self.files:
            base = os.path.basename(f["path"])
            what = f"{KINDS[f['kind']]} ({f['type']})"
            if f["kind"] == "optimizer" and f.get("model"):
                what += f" of {f['model']}"
            lines.append(f"  {base:<{width}}  {human_size(f['bytes']):>10}  {what}")
        return "\n".join(lines + self.warnings())


def _saved_by(rec: dict) -> str:
    if rec.get("version") == 2:
        return f"by {count(rec.get('world_size') or 1, 'rank')}"
    return f"from rank {rec.get('rank', 0)}"


@dataclass
class Restored:
    directory: str
    ranks: int
    records: dict[str, dict]
    ways: dict[str, str]
    skipped: list[dict] = field(default_factory=list)  # state-dict kinds not defined yet

    def brief(self) -> str:
        """A resize's restore in one line: what the new ranks got back, and what waits for
        the user's cells to define it again (left out of autosave until then)."""
        parts = []
        if self.records:
            parts.append(
                f"{', '.join(self.records)} restored into the {self.ranks} new ranks from {self.directory}"
            )
        if self.skipped:
            names = " ".join(s["name"] for s in self.skipped)
            which = ", ".join(f"{s['name']} ({KINDS[s['kind']]})" for s in self.skipped)
            it = "it" if len(self.skipped) == 1 else "them"
            parts.append(
                f"not yet {which}: re-run the cells that define {it}, then %distributed restore {names} "
                f"--dir {self.directory} (autosave leaves {it} out until then)"
            )
        return "gpuhub: " + "; ".join(parts) + "." if parts else ""

    def text(self) -> str:
        lines = [f"gpuhub: restored into {self.ranks} ranks from {self.directory}:"] if self.records else []
        for name, rec in self.records.items():
            way = self.ways[name]
            saved_world = rec.get("world_size")
            if way == "dcp.load" and saved_world and saved_world != self.ranks:
                way += f", resharded from {saved_world} to {self.ranks} ranks"
            saved = stamp(rec["saved"]) if rec.get("saved") else "?"
            lines.append(
                f"  {name}: {KINDS[rec['kind']]} ({rec['type']}), {way}; saved {saved} {_saved_by(rec)}"
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
        self.lost: list[int] = []  # ranks whose process ended while they wrote or read
        self.freed: list[int] = []  # ranks freed from a collective that a failed rank never joined

    def _call(
        self, ranks: list[int], timeout: float, fn, *args, together: bool = False
    ) -> tuple[dict[int, object], dict[int, str]]:
        """``fn(*args)`` on each rank's engine, together: each rank's answer, or why it gave none.
        ``together``: the ranks run collectives with each other (DCP): a rank whose process
        ends is noticed at once (the others cannot finish without it: the pool is broken), and
        ranks still waiting ``check_timeout`` s after another failed are freed (SIGUSR1)."""
        client = self.pool.client
        if client is None:
            raise UsageError("the engines are stopped: start them with a %%distributed cell")
        started, errors = {}, {}
        for r in ranks:
            try:
                started[r] = client[self.pool.engine_ids[r]].apply_async(fn, *args)
            except Exception as e:  # an engine the controller dropped (its process is gone)
                errors[r] = f"its engine is gone ({type(e).__name__}: {e})"
        if started and not together:
            try:
                client.wait(list(started.values()), timeout=timeout)
            except Exception:
                pass  # each rank's own state is read below
        elif started:
            self._wait_together(started, errors, timeout)
        answers = {}
        for r, ar in started.items():
            if r in errors:
                continue
            if not ar.ready():
                errors[r] = f"did not answer within {timeout:.0f} s"
            elif not ar.successful():
                e = ar.exception()
                errors[r] = f"{getattr(e, 'ename', type(e).__name__)}: {getattr(e, 'evalue', e)}"
            else:
                answers[r] = ar.get()
        return answers, errors

    def _wait_together(self, started: dict, errors: dict[int, str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        failed_at = None
        while time.monotonic() < deadline:
            pending = [r for r, ar in started.items() if not ar.ready()]
            if not pending:
                return
            try:
                self.pool.client.wait([started[r] for r in pending], timeout=0.2)
            except Exception:
                pass
            gone = [r for r in self._gone(list(started)) if r not in errors]
            if gone:
                for r in gone:
                    errors[r] = "'s engine process ended (killed?) before it finished"
                self.lost = sorted(set(self.lost) | set(gone))
                self.pool.broken = True  # the others wait for it in a collective
                return
            failed = [
                r
                for r, ar in started.items()
                if ar.ready() and (not ar.successful() or not ar.get().get("ok", True))
            ]
            if failed and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > self.check_timeout:
                self.freed = self._free([r for r, ar in started.items() if not ar.ready()])
                failed_at = time.monotonic() + self.save_timeout  # once
        return

    def _gone(self, ranks: list[int]) -> list[int]:
        gone = getattr(self.pool, "_gone", None)
        if gone is None:
            return []
        try:
            return gone(ranks)
        except Exception:
            return []

    def _free(self, ranks: list[int]) -> list[int]:
        """Ranks stuck in a collective that a failed rank never joined: freed as an interrupt
        frees them (SIGUSR1, ``engine.recovery``)."""
        import signal as _signal

        ranks = [r for r in ranks if getattr(self.pool, "can_free", lambda r: False)(r)]
        if ranks:
            try:
                self.pool.signal(_signal.SIGUSR1, ranks)
            except Exception:
                return []
        return ranks

    def _settle(self) -> str:
        """After ranks were freed from a collective: the process groups checked and, where
        needed, reconnected in place (the pool's own ``settle``), said in a sentence."""
        if not self.freed or not hasattr(self.pool, "settle"):
            return ""
        try:
            notes = self.pool.settle()
        except Exception as e:
            return f" Freeing {ranks_text(self.freed)} from the save's collectives failed ({e})."
        return f" {ranks_text(self.freed).capitalize()} waited for the others and were freed." + (
            " " + " ".join(notes) if notes else ""
        )

    def _unreachable(self, what: str, errors: dict[int, str], done: str) -> UsageError:
        said = "; ".join(
            f"rank {r}{'' if e.startswith(chr(39)) else ' '}{e}" for r, e in sorted(errors.items())
        )
        lost = ""
        if self.lost:
            lost = (
                f" The pool lost {ranks_text(self.lost)}: the next %%distributed cell starts fresh "
                "engines (re-run the cells that define your objects, then restore)."
            )
        return UsageError(f"{what}: {said}. {done}{lost}")

    def _live_ranks(self) -> list[int]:
        ranks = list(range(self.pool.size))
        if getattr(self.pool, "_remote", False):
            return ranks
        return [r for r in ranks if r >= len(self.pool.infos) or alive(self.pool.infos[r]["pid"])]

    def save(self, names: list[str], directory: str, autosave: bool = False) -> Saved:
        """Check the names on every rank; every rank writes its shards of the models and
        optimizers, rank 0 the other names, all into one temporary directory; once every
        rank's answer is checked, rank 0 moves them into place (autosave: the names rank 0
        has, from the ranks that answer; models and optimizers only with every rank)."""
        what = "autosave" if autosave else "save"
        world = self.pool.size
        ranks = self._live_ranks() if autosave else list(range(world))
        found, errors = self._call(ranks, self.check_timeout, engine_inspect, names)
        if errors and (not autosave or 0 in errors):
            raise self._unreachable(what, errors, "Nothing was written.")
        missing = {n: [r for r in sorted(found) if found[r][n] is None] for n in names}
        missing = {n: rs for n, rs in missing.items() if rs}
        skipped: dict[str, list[int]] = {}
        left_out: dict[str, str] = {}
        if missing and not autosave:
            raise UsageError(missing_message(what, missing, world))
        if autosave:
            skipped = {n: rs for n, rs in missing.items() if 0 in rs}
            names = [n for n in names if n not in skipped]
            if not names:
                raise UsageError(missing_message(what, skipped, world))
        kinds = {n: found[0][n]["kind"] for n in names}
        sharded = [n for n in names if kinds[n] in DCP_KINDS]
        silent = sorted(set(range(world)) - set(found))  # autosave: ranks gone or not answering
        if sharded and (silent or missing):  # every rank holds a part of these
            absent = {n: rs for n, rs in missing.items() if n in sharded}
            if silent or absent:
                if not autosave:
                    raise UsageError(missing_message(what, absent, world))
                for n in sharded:
                    left_out[n] = "a model or optimizer needs every rank, and " + (
                        f"{ranks_text(silent)} did not answer" if silent else "some ranks lack it"
                    )
                names = [n for n in names if n not in left_out]
                sharded = []
        differ = [n for n in sharded if len({found[r][n]["kind"] for r in found}) > 1]
        if differ:
            raise UsageError(
                f"{what}: {', '.join(map(repr, differ))} differ in kind between the ranks (a module on "
                "some, something else on others). Nothing was written: define them the same way on every "
                "rank."
            )
        models = {}
        for n in [n for n in sharded if kinds[n] == "optimizer"]:
            model = found[0][n].get("model")
            if model is None:
                if not autosave:
                    raise UsageError(no_model_message(what, n, found[0][n].get("suggest")))
                model = found[0][n].get("suggest") or "model"
                left_out[n] = f"its model is not autosaved with it (--autosave {model} {n})"
                continue
            models[n] = model
        names = [n for n in names if n not in left_out]
        sharded = [n for n in sharded if n in names]
        if not names:
            raise UsageError(
                f"{what}: nothing to save: "
                + "; ".join(f"{n}: {why}" for n, why in left_out.items())
                + ". Nothing was written."
            )
        token = uuid.uuid4().hex[:12]
        temp = os.path.join(directory, temp_name(socket.gethostname(), os.getpid(), token))
        writers = list(range(world)) if sharded else [0]
        meta = {"saved": time.time(), "rank": 0, "world_size": world, "save": token}
        try:
            self._prepare(what, temp, writers, world)
            answers, errors = self._call(
                writers, self.save_timeout, engine_write, temp, names, models, meta, together=len(writers) > 1
            )
            failed = {r: a for r, a in answers.items() if not a["ok"]}
            if errors:
                raise self._unreachable(
                    what, errors, f"Nothing was written; the checkpoints in {directory} are as they were."
                )
            if failed:
                r = min(failed, key=lambda r: (failed[r]["error"] != "os", r))
                raise UsageError(save_error_text(what, failed[r], directory, world) + self._settle())
            files = answers[0]["files"]
            committed, errors = self._call([0], self.save_timeout, engine_commit, temp, files)
            if errors:
                raise self._unreachable(
                    what, errors, f"The checkpoints in {directory} may be partly replaced."
                )
            if not committed[0]["ok"]:
                raise UsageError(save_error_text(what, committed[0], directory, world))
        except BaseException:
            self._remove(temp)
            raise
        plain = [f for f in files if f["kind"] not in DCP_KINDS]
        paths = [f["path"] for f in plain]
        unseen = {}
        if paths and not sharded:
            seen, _ = self._call([r for r in ranks if r != 0], self.check_timeout, engine_stat, paths)
            for r, sizes in seen.items():
                lost = [p for p, s, f in zip(paths, sizes, plain, strict=True) if s != f["bytes"]]
                if lost:
                    unseen[r] = lost
        return Saved(directory, 0, files, unseen, skipped, left_out, writers=len(writers))

    def _prepare(self, what: str, temp: str, writers: list[int], world: int) -> None:
        """The temporary directory, made by rank 0, must be seen by every rank that writes
        into it (a directory that is not shared would split a checkpoint between nodes)."""
        import shutil

        directory = os.path.dirname(temp)
        try:  # a killed kernel's (this host's) temporary directories, where this kernel sees them
            listing = os.listdir(directory)
        except OSError:
            listing = []
        for b in stale_temps(listing, socket.gethostname(), alive, os.path.basename(temp)):
            shutil.rmtree(os.path.join(directory, b), ignore_errors=True)
        made, errors = self._call([0], self.check_timeout, engine_prepare_dir, temp)
        if errors:
            raise self._unreachable(what, errors, "Nothing was written.")
        if not made[0]["ok"]:
            raise UsageError(save_error_text(what, made[0], directory, world))
        others = [r for r in writers if r != 0]
        if not others:
            return
        seen, errors = self._call(others, self.check_timeout, engine_stat, [os.path.join(temp, MARK)])
        blind = sorted(set(errors) | {r for r, sizes in seen.items() if sizes[0] is None})
        if blind:
            raise UsageError(
                f"{what}: {ranks_text(blind)} cannot see {directory}, where rank 0 writes: each rank "
                "writes its own shards there, so it must be one directory that every rank reaches. "
                "Nothing was written: choose a --dir that every node shares (on Slurm: your home)."
            )

    def _remove(self, temp: str) -> None:
        """A failed save's temporary directory: removed here where the kernel sees it, else by
        rank 0 (and by the next save on that host, should both fail)."""
        import shutil

        if os.path.isdir(os.path.dirname(temp)):
            shutil.rmtree(temp, ignore_errors=True)
            if not os.path.exists(temp):
                return
        if 0 not in self.lost:
            try:
                self._call([0], self.check_timeout, engine_remove, temp)
            except Exception:
                pass

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
        if not errors and not failed:
            failed = uneven_dcp(prepared)  # a model defined on some ranks only: DCP needs every rank
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
        together = bool(prepared[0]["dcp"]) and world > 1
        ways, errors = self._call(ranks, self.save_timeout, engine_apply_restore, token, together=together)
        if errors:
            said = "; ".join(
                f"rank {r}{'' if e.startswith(chr(39)) else ' '}{e}" for r, e in sorted(errors.items())
            )
            if prepared[0]["dcp"]:
                raise UsageError(
                    f"restore: {said}. {', '.join(prepared[0]['dcp'])} may be partly loaded: run the "
                    "restore again"
                    + (
                        " once the pool has restarted (the next %%distributed cell starts "
                        "fresh engines; re-run the cells that define your objects first)"
                        if self.lost
                        else ""
                    )
                    + "."
                )
            raise UsageError(
                f"restore: {said}. The other ranks were restored: run the restore again, or restart "
                "the engines (%distributed shutdown) if a rank is gone."
            )
        return Restored(directory, world, prepared[0]["records"], ways[0], prepared[0]["skipped"])


def uneven_dcp(prepared: dict[int, dict]) -> dict[int, dict]:
    """The ranks of a restore that would skip a DCP name that other ranks load (it is not
    defined there, with ``skip_undefined``), each with its problems (pure)."""
    every = {n for a in prepared.values() for n in a["dcp"]}
    text = (
        "is not defined: re-run the cell that defines it on every rank (a %%distributed cell without "
        "--targets), then restore"
    )
    return {
        r: {
            "ok": False,
            "problems": [{"name": n, "problem": "target", "text": text} for n in sorted(every - set(d))],
        }
        for r, d in ((r, a["dcp"]) for r, a in prepared.items())
        if set(d) != every
    }


def list_checkpoints(directory: str) -> list[str]:
    try:
        return sorted(
            {
                f[: -len(suffix)]
                for f in os.listdir(directory)
                for suffix in (SUFFIX, DCP_SUFFIX)
                if f.endswith(suffix) and not f.startswith(".")
            }
        )
    except OSError:
        return []


# JupyterLab shows a stream's text in a <pre> with ``word-break: break-all``, which breaks
# long lines anywhere ("UT C", "checkpoi nts"); the same text as HTML wraps at spaces only
WRAP_AT_SPACES = "margin: 0; white-space: pre-wrap; word-break: normal; overflow-wrap: normal"


def as_html(text: str) -> str:
    """``text`` as a <pre> that wraps long lines at spaces only (a long path scrolls instead)."""
    import html

    return f'<pre style="{WRAP_AT_SPACES}">{html.escape(text)}</pre>'


def show(text: str) -> None:
    """A message of the cell that runs now, wrapped at spaces only in the notebook: shown as
    text and HTML in a kernel's main thread (where the output belongs to that cell), else
    printed (a timer's thread, kernel exit, a terminal)."""
    if threading.current_thread() is threading.main_thread():
        try:
            from IPython import get_ipython
            from IPython.display import display

            shell = get_ipython()
            if shell is not None and getattr(shell, "kernel", None) is not None:
                display({"text/plain": text, "text/html": as_html(text)}, raw=True)
                return
        except Exception:
            pass
    say(text)


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
    "preempt": "the borrowed GPUs are taken back",
    "time": "the time limit's end",
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
        show(text)

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
        problem = dir_problem(where)
        if problem:
            raise UsageError(
                f"--autosave: {problem}; choose another --dir (the checkpoints' directory, "
                "made when first saved)"
            )
        if (names, where) != (self.autosave, self.autosave_dir) and not quiet:
            show(
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

    def _save_before_stop(self, why: str, full: bool = True) -> Saved | None:
        """Save the autosave names of the pool before its processes end (``why``: a key of
        ``WHY``). Raises UsageError when it could not (the callers that stop anyway report it);
        saves once however often it is called while no cell ran. Answers what it wrote (the
        earlier save when that one still holds; None when there was nothing to save).
        ``full`` False: only its warnings are said (the caller says the save in its own line)."""
        pool, names = self.pool, [n for n in self.autosave if n not in self._pending]
        if self.autosave and not names:
            say(f"gpuhub: not autosaved: {', '.join(self.autosave)} not restored since the resize.", err=True)
        if pool is None or not names or getattr(pool, "client", None) is None:
            return None
        if self._autosaved and self._autosaved[0] is pool and self._autosaved[1] == self.last_used:
            return getattr(self, "_last_saved", None)
        before = WHY.get(why, why)
        if pool.broken:
            raise UsageError(
                f"autosave skipped before {before}: the last cell lost a rank, so the other ranks may "
                f"have stopped half-way through a step; the checkpoints in {self.autosave_dir} are "
                "kept as they were."
            )
        saved = Checkpointer(pool).save(names, self.autosave_dir, autosave=True)
        self._autosaved = (pool, self.last_used, why)
        self._last_saved = saved
        self.last_autosave = ([f["name"] for f in saved.files], self.autosave_dir)
        if full:
            show(saved.text(before))
        elif saved.warnings():
            say("\n".join(saved.warnings()))
        if self._pending & set(self.autosave):
            later = ", ".join(sorted(self._pending & set(self.autosave)))
            say(f"  not saved: {later} (not restored since the resize: the checkpoints are kept)")
        return saved

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
        verbose = getattr(self, "verbose", True)
        if restored.text():
            show(restored.text() if verbose else restored.brief())
        self._pending = {s["name"] for s in restored.skipped}
        if self._pending & set(self.autosave) and verbose:
            show(f"gpuhub: autosave leaves out {', '.join(sorted(self._pending))} until they are restored.")

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


def saved_lines(
    saved: Saved | None,
    names: list,
    problem: str | None,
    defined: list | None,
    interrupted: bool,
    before: str,
) -> tuple[list[str], list[str]]:
    """What a stop's report says of the work (a preemption's, a time limit's): the names kept
    (checked: the files written) and the lines saying where each is, what failed to save, and
    what was lost; ``before``: "the due time", "the end"."""
    kept = [f["name"] for f in saved.files] if saved else []
    lines = []
    if saved:
        lines.append(f"Kept: {', '.join(kept)}, saved {saved.source()} before {before}:")
        lines += [f"  {f['name']}: {f['path']}" for f in saved.files]
    elif names:
        lines.append(f"Not saved: the autosave of {', '.join(names)} failed: {problem or 'nothing to save'}")
    else:
        lines.append("Nothing was saved: this pool had no --autosave.")
    if defined is None:
        lines.append("Lost: every variable of the ranks" + (" not saved above." if kept else "."))
    else:
        others = [x for x in defined if x not in kept]
        lines.append(f"Lost: the ranks' other variables: {', '.join(others) or 'none'}.")
    if interrupted:
        lines.append("The running cell was interrupted (its work up to then is in what was saved).")
    return kept, lines
