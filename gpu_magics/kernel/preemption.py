"""A ``%%distributed`` pool's borrowed GPUs taken back: :class:`Preemption`, the one object
that follows the broker's notice for the pool's burst (:class:`Notice`), shows it, interrupts a
running cell at its time, saves (with ``--autosave``) and stops the pool, and gives the parts
back; :func:`parse_due` reads the broker's due time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_magics.common.words import clock, count
from gpu_magics.kernel import resize, resizing
from gpu_magics.kernel.burst import Part
from gpu_magics.kernel.checkpoints import Saved, saved_lines, say
from gpu_magics.kernel.notices import parse_due, taken, taken_back
from gpu_magics.kernel.outcome import NOT_RUN, DistributedPreempted, report

if TYPE_CHECKING:
    from gpu_magics.kernel.lifecycle import Lifecycle
    from gpu_magics.kernel.pool import CellOutcome, EnginePool


@dataclass
class Notice:
    """The broker's notice that a part of the pool's burst (its borrowed GPUs) is taken back."""

    part: Part  # the allocation with the borrowed GPUs
    reason: str
    due: float  # Unix time
    shown: bool = False  # printed in the cell that runs now
    acted: bool = False  # saved (with autosave) and stopped
    interrupted: bool = False  # the running cell was interrupted for it

    @property
    def due_text(self) -> str:
        return clock(self.due)


class PreemptNow(KeyboardInterrupt):
    """Raised in the running cell's loop when the borrowed GPUs' time is up: the cell is
    interrupted as the stop button does, every rank keeping its state."""


def _taken(part) -> str:
    """What of a burst may be taken back: its borrowed GPUs, or all of one that started ahead
    of the queue (backfill)."""
    return taken(part.borrowed, part.size)


def _notice(n: Notice, whose: str) -> str:
    """``1 borrowed GPU of this pool (allocation #5) is taken back at 07:46:38 UTC for ...``."""
    return taken_back(_taken(n.part), n.part.borrowed or n.part.size, n.part.id, n.due, n.reason, whose)


def _names(names) -> str:
    return ", ".join(names) or "none"


class Preemption:
    """The preemption of the pool's burst (``lifecycle.burst``). ``autosave`` is the magic's
    checkpoint part (its ``autosave``, ``autosave_dir`` and ``_save_before_stop``);
    ``settings`` has ``preempt_save_seconds``."""

    def __init__(self, lifecycle: Lifecycle, autosave, settings):
        self.lifecycle = lifecycle
        self.autosave = autosave
        self.settings = settings
        self.notice: Notice | None = None  # a preemption notice for the pool's burst
        self.report: str | None = None  # a preemption that stopped the idle pool
        self.releasing: list[Part] = []  # preempted parts released at their due time

    def on_notice(self, part: Part, notice: dict) -> None:
        """The lease's thread saw a preemption notice for ``part``: remember it, and act at
        its time even if no cell runs then. A withdrawal (``{"withdrawn": {"at", "reason"}}``,
        the ledger's) forgets it: its timer then finds it is no longer the current notice."""
        withdrawn = notice.get("withdrawn")
        if withdrawn is not None:
            with self.lifecycle.lock:
                n = self.notice
                if n is None or n.part is not part or n.acted:
                    return
                self.notice = None
            say(
                f"gpuhub: the notice for {_taken(part)} of this pool (allocation #{part.id}) was "
                f"{withdrawn.get('reason') or 'withdrawn'}. Nothing is taken back: the pool keeps them.",
                err=True,
            )
            return
        self.notice = Notice(part, notice.get("reason") or "preempted", parse_due(notice.get("due")))
        self._arm_timer(self.notice)

    def _arm_timer(self, n: Notice, delay: float | None = None) -> None:
        if delay is None:
            delay = max(0.0, self.act_at(n) - time.time())
        t = threading.Timer(delay, self._act_on_notice, args=(n,))
        t.daemon = True
        t.start()

    def act_at(self, n: Notice) -> float:
        """When the pool saves and stops: ``preempt_save_seconds`` before the due time with
        autosave (so that the save is done before it), else at the due time."""
        return n.due - (self.settings.preempt_save_seconds if self.autosave.autosave else 0.0)

    def current(self) -> Notice | None:
        """The notice for the pool's burst, if any; a burst whose renewal was refused as
        preempted before any notice was seen counts as one due now."""
        b = self.lifecycle.burst
        if b is None:
            return None
        n = self.notice
        if n is not None and any(n.part is p for p in b.parts):
            return n
        for p in b.parts:
            if p.lost and (p.preemption or "preempted" in p.reason):
                got = p.preemption or {}
                self.notice = Notice(p, got.get("reason") or p.reason, parse_due(got.get("due")))
                return self.notice
        return None

    def shrink_plan(self, n: Notice) -> tuple[list[int], str | None]:
        """The ranks that leave when ``n`` is acted on, and why the pool cannot shrink in place
        (None: it can)."""
        pool = self.lifecycle.pool
        if not getattr(self.settings, "resize_in_place", False):
            return [], "resizing in place is off (DistributedMagics.resize_in_place)"
        if pool is None or pool.view is None:
            return [], "no engines run"
        leaving = resizing.leaving_ranks(pool.specs, [s.label for s in n.part.slots])
        return leaving, resizing.shrink_problem(pool.specs, leaving, remote=pool._remote)

    def text(self, n: Notice) -> str:
        head = "gpuhub: NOTICE: " + _notice(n, "of this pool")
        names = self.autosave.autosave
        leaving, problem = self.shrink_plan(n)
        if problem is None:
            pool = self.lifecycle.pool
            at = clock(max(time.time(), n.due - (self.settings.preempt_save_seconds if names else 0.0)))
            return (
                f"{head}\nAt {at} a running cell is interrupted and the pool shrinks in place to "
                f"{count(pool.size - len(leaving), 'rank')} ({resizing.ranks_text(leaving)} leave"
                f"{'s' if len(leaving) == 1 else ''}): the others keep their processes and every variable."
            )
        if names:
            at = max(time.time(), self.act_at(n))
            when = clock(at)
            tail = (
                f"A pool cannot go on without some of its ranks: at {when} a running cell is "
                f"interrupted, {_names(names)} autosaved to {self.autosave.autosave_dir}, and the "
                "engines stopped."
            )
        else:
            tail = (
                f"At {n.due_text} the engines stop and their variables are lost (this pool has no "
                "--autosave): run %distributed save NAME... before then to keep them."
            )
        return f"{head}\n{tail}"

    def pending_text(self) -> str | None:
        """The notice not acted on yet, for ``%distributed status``."""
        n = self.current()
        if n is None or n.acted:
            return None
        return self.text(n).replace("gpuhub: ", "", 1)

    # around a cell ----------------------------------------------------------------------

    def engines_gone(self, n: Notice) -> bool:
        """Every engine of the pool here has ended already (the reaper stopped them at the due
        time while the kernel was paused): nothing is left to save or shrink, so ``n`` is done
        with, and the pool's check before the cell finds the burst ended and says what was lost."""
        pool = self.lifecycle.pool
        if pool is None or pool._remote or not pool.infos or len(pool.ended_for_sure()) < len(pool.infos):
            return False
        n.acted = True
        return True

    def before_cell(self) -> None:
        """At the start of a cell: a preemption that stopped the idle pool is reported (and the
        cell does not run on new engines unasked); a pending notice is shown; one whose time
        has come is acted on now."""
        if self.report:
            text, self.report = self.report, None
            raise DistributedPreempted(f"{text}\n{NOT_RUN}")
        with self.lifecycle.lock:
            n = self.current()
            if n is None or n.acted:
                return
            if time.time() >= self.act_at(n) and not self.engines_gone(n):
                text = self.stop(n)
                raise DistributedPreempted(f"{text}\n{NOT_RUN}")
            if n.acted:
                return
        n.shown = True
        say(self.text(n), err=True)

    def tick(self) -> None:
        """Called in the running cell's loop: shows a notice that came during the cell, and
        interrupts the cell once its time to save and stop has come."""
        n = self.current()
        if n is None or n.acted:
            return
        if not n.shown:
            n.shown = True
            say(self.text(n), err=True)
        if time.time() >= self.act_at(n):
            n.interrupted = True
            names = self.autosave.autosave
            if self.shrink_plan(n)[1] is None:
                what = "shrink the pool in place"
            else:
                what = f"save {_names(names)}" if names else "stop the engines"
            say(f"gpuhub: interrupting the cell to {what} before the borrowed GPUs are taken back.", err=True)
            raise PreemptNow()

    def after_cell(self, outcome: CellOutcome, pool: EnginePool) -> None:
        """After a cell: a notice whose time came during it (or that interrupted it) saves and
        stops the pool now (raises :class:`DistributedPreempted`); else it is shown again by
        the next cell."""
        with self.lifecycle.lock:
            n = self.current()
            if n is not None and not n.acted and (n.interrupted or time.time() >= self.act_at(n)):
                ranks = report(outcome, pool) if outcome.failed and not outcome.interrupted else ""
                text = self.stop(n)
                raise DistributedPreempted("\n".join(filter(None, [ranks, text]))) from None
            if n is not None:
                n.shown = False  # the next cell shows it again

    # the stop -----------------------------------------------------------------------------

    def _act_on_notice(self, n: Notice) -> None:
        """The notice's timer: with no cell running, save and stop the pool at its time."""
        with self.lifecycle.lock:
            if n.acted or self.current() is not n:
                return
            if self.lifecycle.busy or time.time() < self.act_at(n):  # a cell's tick acts; or autosave changed
                self._arm_timer(n, min(1.0, max(0.05, self.act_at(n) - time.time())))
                return
            if self.engines_gone(n):
                return
            text = self.stop(n)
            self.report = text
        say(text, err=True)

    def stop(self, n: Notice) -> str:
        """Shrink the pool in place where it can (:meth:`shrink`); else save (with autosave),
        stop the engines, release what is within the limit now and the preempted part at its
        due time (so that the hub records it as preempted); the report of what was kept and
        what was lost. Called under the lifecycle's lock."""
        n.acted = True
        n.part.unguard()  # acted on here: the reaper leaves this pool to the kernel
        shrunk, why_not = self.shrink(n)
        if shrunk is not None:
            return shrunk
        life = self.lifecycle
        pool, burst = life.pool, life.burst
        names, where = list(self.autosave.autosave), self.autosave.autosave_dir
        defined = life.user_names() if pool is not None and pool.view is not None else None
        saved: Saved | None = None
        problem = None
        if pool is not None and names:
            try:
                saved = self.autosave._save_before_stop("preempt")
            except BaseException as e:  # never keeps the engines running past the due time
                problem = str(e)
        self.autosave.autosave = []  # saved above: the stop below does not try again
        parts = burst.parts if burst is not None else []
        if pool is not None:
            life.stop_pool(release=False, why="preempt")
        life.burst = None
        now = [p for p in parts if not p.preemption and not p.lost]
        for p in now:
            p.release()
        later = [p for p in parts if p not in now]
        self.releasing += later
        # saved and stopped: the borrowed GPUs go back now, not at the due time (the ledger
        # records a give-back after the notice as the preemption's, saying it came early)
        t = threading.Timer(0.0, self.release_preempted)
        t.daemon = True
        t.start()

        lines = ["gpuhub: " + _notice(n, "of the pool")]
        if why_not:
            lines.append(f"The pool could not shrink in place: {why_not}.")
        kept, said = saved_lines(saved, names, problem, defined, n.interrupted, "the due time")
        lines += said
        held = ", ".join(f"#{p.id}" for p in now)
        lines.append(
            "The engines were stopped"
            + (f"; allocation {held} (within your limit) was released" if held else "")
            + "; the borrowed GPUs are given back now (they were due at "
            + f"{n.due_text})."
        )
        if kept:
            lines.append(
                "To go on: start a pool within your limit, re-run the cells that define "
                f"{_names(kept)}, then %distributed restore {' '.join(kept)} --dir {where}"
            )
        else:
            lines.append(
                "Next time start the pool with --autosave NAME... (saved by itself before such a "
                "stop), or run %distributed save NAME... when a notice comes."
            )
        return "\n".join(lines)

    def shrink(self, n: Notice) -> tuple[str | None, str | None]:
        """The pool without the ranks on ``n``'s GPUs, in the same processes: the report, or
        None and why not (then the caller stops the pool as before; a failure after the
        departure has left the pool broken, which that stop ends)."""
        leaving, problem = self.shrink_plan(n)
        if problem is not None:
            return None, None if "is off" in problem or "no engines" in problem else problem
        life = self.lifecycle
        pool = life.pool
        try:
            shrunk = resize.shrink(pool, leaving)
        except resize.ShrinkFailed as e:
            return None, str(e)
        burst = life.burst
        if burst is not None:
            burst.parts = [p for p in burst.parts if p is not n.part]
            if not burst.parts:
                life.burst = None
        n.part.release()  # the borrowed GPUs back now, after the notice: recorded as its preemption
        if life.key is not None:
            (_, nodes, per_node), backend_name, timeout = life.key
            life.key = ((pool.size, nodes, per_node), backend_name, timeout)
        lines = ["gpuhub: " + _notice(n, "of the pool"), *resizing.shrink_text(shrunk)]
        if n.interrupted:
            lines.append("The running cell was interrupted at the notice's time; what it had done is kept.")
        gave = count(n.part.borrowed or n.part.size, "borrowed GPU")
        lines.append(f"{gave} given back now (due at {n.due_text}).")
        return "\n".join(lines), None

    def release_preempted(self) -> None:
        """Give back the preempted parts (at their due time, or at shutdown)."""
        while self.releasing:
            self.releasing.pop().release()
