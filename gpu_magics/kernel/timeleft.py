"""A ``%%distributed`` pool's time limit: :class:`TimeLeft` warns at the hub's warning times
(``c.GpuHub.time_warning_minutes``, given with each allocation's ``time_limit``), in the running
cell or the next one, and before the end saves the pool's ``--autosave`` names and stops its
engines, saying what was kept and where, like a preemption. The end itself is the hub's: it ends
a burst in the ledger and stops a server at its time (``docs/time-limits.md``).

The pool's end is the earliest of its allocations' ends: the server's own (when the pool runs on
the server's GPUs) and each part of its burst. They are read from the broker before each cell
(an extension moves them), and kept for the cell's ticks and for the timer of an idle pool.

:func:`due_warnings` and :func:`warning_text` are pure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_magics.common.session import server_gpus
from gpu_magics.common.words import clock, duration
from gpu_magics.kernel.checkpoints import saved_lines, say
from gpu_magics.kernel.notices import parse_due
from gpu_magics.kernel.outcome import NOT_RUN, DistributedError

if TYPE_CHECKING:
    from gpu_magics.kernel.lifecycle import Lifecycle


class DistributedTimeUp(DistributedError):
    """The pool was stopped because its time limit runs out."""

    def _render_traceback_(self):
        return ["Time is up: the pool's time limit ran out.", *self.report.splitlines()]


class TimeUpNow(KeyboardInterrupt):
    """Raised in the running cell's loop when the pool must save and stop before its end: the
    cell is interrupted as the stop button does, every rank keeping its state for the save."""


@dataclass(frozen=True)
class End:
    """One allocation's time limit: whose (``what``: ``the server's`` / ``the burst's``), its
    length and its end (Unix time), and the hub's warning times (minutes before it)."""

    allocation_id: int
    what: str
    seconds: float
    ends: float
    warnings: tuple[float, ...] = ()


def end_of(allocation: dict, what: str) -> End | None:
    """The broker's allocation JSON's time limit, or None when it has none."""
    limit = allocation.get("time_limit") or None
    if not limit or not limit.get("ends"):
        return None
    warnings = tuple(float(m) for m in limit.get("warnings") or () if isinstance(m, int | float))
    return End(allocation["id"], what, float(limit["seconds"]), parse_due(limit["ends"]), warnings)


def due_warnings(end: End, now: float, said: Iterable[float]) -> list[float]:
    """The warning times (minutes before the end) that have come and were not said yet; only
    the latest of them is worth saying (pure)."""
    said = set(said)
    return sorted((m for m in end.warnings if now >= end.ends - m * 60 and m not in said), reverse=True)


def warning_text(end: End, now: float, names: list[str], autosave_dir: str, save_seconds: float) -> str:
    """``gpuhub: TIME: ...``: when the pool's end comes, and what happens to its work then."""
    left = duration(max(0.0, end.ends - now))
    head = (
        f"gpuhub: TIME: {end.what} time limit ({duration(end.seconds)}, allocation #{end.allocation_id}) "
        f"runs out at {clock(end.ends)} (in {left})."
    )
    if names:
        at = clock(max(now, end.ends - save_seconds))
        tail = (
            f"At {at} a running cell is interrupted, {', '.join(names)} autosaved to {autosave_dir}, "
            "and the engines stopped."
        )
    else:
        tail = (
            "Then the engines stop and their variables are lost (this pool has no --autosave): "
            "run %distributed save NAME... before then to keep them."
        )
    return f"{head} {tail}"


@dataclass
class TimeLeft:
    """The pool's time limit (``lifecycle.pool``'s), followed around its cells."""

    lifecycle: Lifecycle
    autosave: object  # the magic's checkpoint part (``autosave``, ``autosave_dir``, ``_save_before_stop``)
    settings: object  # ``preempt_save_seconds``: how long before the end the save starts
    end: End | None = None
    said: set = field(default_factory=set)  # (allocation id, end, minutes) of the warnings said
    acted: bool = False
    interrupted: bool = False
    report: str | None = None  # the stop of an idle pool, told at the next cell
    _timer: threading.Timer | None = None
    _read_for: tuple = ()  # what the pool held when its ends were last read (``_holding``)

    def refresh(self) -> None:
        """Read the ends of the pool's allocations from the broker (before a cell)."""
        from gpu_magics.kernel.broker import BrokerClient, BrokerError

        life = self.lifecycle
        if life.pool is None:
            self.end = None
            return
        client = BrokerClient.from_env()
        if client is None:
            return
        ends = []
        server = server_gpus().allocation_id
        if life.own and server:
            try:
                ends.append(end_of(client.get(server), "the server's"))
            except BrokerError:
                pass
        for p in life.burst.parts if life.burst is not None else ():
            if p.released or p.lost:
                continue
            try:
                ends.append(end_of(client.get(p.id), "the burst's"))
            except BrokerError:
                continue
        ends = [e for e in ends if e is not None]
        self._read_for = self._holding()
        end = min(ends, key=lambda e: e.ends, default=None)
        if end != self.end:
            self.end, self.acted, self.interrupted = end, False, False
            self._arm()

    def _holding(self) -> tuple:
        """What the pool holds now: its pool, and the burst's live parts."""
        life = self.lifecycle
        parts = life.burst.parts if life.burst is not None else ()
        return (id(life.pool), tuple(p.id for p in parts if not (p.released or p.lost)))

    def refresh_if_changed(self) -> None:
        """:meth:`refresh` only when the pool or its burst changed since the last read (a new
        or resized pool made by the cell's start): a cell asks the broker once, not twice."""
        if self._holding() != self._read_for:
            self.refresh()

    def act_at(self) -> float:
        """When the pool saves and stops: ``preempt_save_seconds`` before the end with autosave."""
        save = self.settings.preempt_save_seconds if self.autosave.autosave else 0.0
        return self.end.ends - save - 1.0  # a second early: done before the hub's end

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.end is None:
            return
        self._timer = threading.Timer(max(0.0, self.act_at() - time.time()), self._on_timer)
        self._timer.daemon = True
        self._timer.start()

    def _warn(self) -> None:
        end = self.end
        key = (end.allocation_id, end.ends)  # an extension's new end is warned of again
        due = due_warnings(end, time.time(), {m for i, e, m in self.said if (i, e) == key})
        if not due:
            return
        self.said |= {(*key, m) for m in due}
        names = list(self.autosave.autosave)
        say(
            warning_text(
                end, time.time(), names, self.autosave.autosave_dir, self.settings.preempt_save_seconds
            ),
            err=True,
        )

    # around a cell ----------------------------------------------------------------------

    def before_cell(self) -> None:
        if self.report:
            text, self.report = self.report, None
            raise DistributedTimeUp(f"{text}\n{NOT_RUN}")
        with self.lifecycle.lock:
            self.refresh()
            if self.end is None or self.acted:
                return
            if time.time() >= self.act_at():
                raise DistributedTimeUp(f"{self.stop()}\n{NOT_RUN}")
        self._warn()

    def tick(self) -> None:
        if self.end is None or self.acted:
            return
        self._warn()
        if time.time() >= self.act_at():
            self.interrupted = True
            names = self.autosave.autosave
            what = f"save {', '.join(names)}" if names else "stop the engines"
            say(f"gpuhub: interrupting the cell to {what} before the time limit runs out.", err=True)
            raise TimeUpNow()

    def after_cell(self) -> None:
        with self.lifecycle.lock:
            if self.end is not None and not self.acted and (self.interrupted or time.time() >= self.act_at()):
                raise DistributedTimeUp(self.stop()) from None

    def _on_timer(self) -> None:
        """With no cell running, save and stop the pool at its time."""
        with self.lifecycle.lock:
            if self.end is None or self.acted or self.lifecycle.pool is None:
                return
            if self.lifecycle.busy:  # the cell's tick acts
                return
            if time.time() < self.act_at():
                self._arm()
                return
            before = self.end
            self.refresh()  # an extension (%gpus --extend, My GPUs) moves the end: re-armed
            if self.end is None or self.end != before:
                return
            self.report = text = self.stop()
        say(text, err=True)

    # the stop -----------------------------------------------------------------------------

    def stop(self) -> str:
        """Save (with autosave) and stop the engines; release the burst (its time is up); the
        report of what was kept, where, and what was lost. Under the lifecycle's lock."""
        end, self.acted = self.end, True
        life = self.lifecycle
        names, where = list(self.autosave.autosave), self.autosave.autosave_dir
        defined = life.user_names() if life.pool is not None and life.pool.view is not None else None
        saved, problem = None, None
        if life.pool is not None and names:
            try:
                saved = self.autosave._save_before_stop("time")
            except BaseException as e:  # never keeps the engines past the end
                problem = str(e)
        self.autosave.autosave = []  # saved above: the stop does not try again
        burst = life.burst
        released = [f"#{p.id}" for p in (burst.parts if burst is not None else ()) if not p.released]
        life.stop_pool(release=True, why="time")
        lines = [
            f"gpuhub: {end.what} time limit ({duration(end.seconds)}, allocation #{end.allocation_id}) "
            f"runs out at {clock(end.ends)}."
        ]
        kept, said = saved_lines(saved, names, problem, defined, self.interrupted, "the end")
        lines += said
        lines.append(
            "The engines were stopped"
            + (f"; burst allocation {', '.join(released)} was released" if released else "")
            + (f"; the hub stops the server at {clock(end.ends)}." if end.what == "the server's" else ".")
        )
        if kept:
            lines.append(
                f"To go on in a new session: re-run the cells that define {', '.join(kept)}, then "
                f"%distributed restore {' '.join(kept)} --dir {where}"
            )
        return "\n".join(lines)
