"""``%%distributed``: run a cell on one warm engine per GPU with torch.distributed ready.

    %%distributed --gpus 4 [--nodes M] [--gpus-per-node K] [--backend gloo|nccl]
                  [--timeout S] [--output all|rank0] [--targets 0,2-3]
    %distributed shutdown | status | save NAME... [--dir D] | restore NAME... [--dir D]

GPUs come from the server's own allocation first; beyond it, only the difference comes as a
burst allocation of the gpuhub broker on the same node (within the user's limit), whose lease is
renewed while the pool lives and released when the pool stops or has been idle for
``idle_seconds`` (``burst.Burst``). A change that needs new engines is checked first (the
broker asked, the engines' variables looked at): a refusal leaves the pool as it is, and a pool
holding the user's variables is only replaced with ``--restart`` or autosave (``plan``).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display, update_display
from traitlets import Float

from gpu_magics.common.checkpoint import DEFAULT_DIR
from gpu_magics.common.ranks import Slot, make_rank_specs
from gpu_magics.common.session import server_gpus
from gpu_magics.kernel.arguments import COUNT, SECONDS
from gpu_magics.kernel.broker import LeaseKeeper
from gpu_magics.kernel.burst import Burst, SplitBurst, burst_size
from gpu_magics.kernel.checkpoints import CheckpointCommands, Saved, check_names, say
from gpu_magics.kernel.plan import (
    OTHER_SETTINGS,
    describe_settings,
    may_retry_after_release,
    plan_gpus,
    refuse_discard,
    why_new_engines,
)
from gpu_magics.kernel.pool import CellOutcome, EnginePool


class DistributedError(Exception):
    """One or more ranks failed; rendered as each rank's report, not the magic's traceback."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report

    def _render_traceback_(self):
        return self.report.splitlines()


def parse_targets(text: str, world: int) -> list[int]:
    """``0,2-3`` to ``[0, 2, 3]``: ranks only, never evaluated as code."""
    ranks: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise UsageError(f"--targets takes ranks like 0,2-3; got {text!r}")
        a, b = int(lo), int(hi or lo)
        if a > b or b >= world:
            raise UsageError(f"--targets: ranks run from 0 to {world - 1}; got {part!r}")
        ranks.update(range(a, b + 1))
    if not ranks:
        raise UsageError("--targets names no rank")
    return sorted(ranks)


def _burst_size(burst: dict) -> int:
    """GPUs a burst was admitted for (a Slurm burst holds none until its job runs)."""
    return burst_size(burst)


def _text(line: str) -> dict:
    """A status line shown as plain text (a str passed to display() shows as its repr)."""
    return {"text/plain": line}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_preemption(pool: EnginePool) -> str | None:
    """The engines' own line when Slurm preempted their job and they saved at its SIGTERM."""
    launcher = getattr(pool, "launcher", None)
    job, autosave = getattr(launcher, "job_id", ""), getattr(launcher, "autosave", None)
    if not job or not autosave or not autosave[0]:
        return None
    from gpu_magics.launch.slurm import preemption_report

    return preemption_report(autosave[1], job)


def report(outcome: CellOutcome, pool: EnginePool) -> str:
    """What happened to each rank that did not finish, and to the pool: plain lines."""
    lines = []
    for r in outcome.failed:
        info = pool.infos[r.rank] if r.rank < len(pool.infos) else {}
        slot = pool.specs[r.rank].slot
        where = f"node {slot.node}, GPU {slot.label}, pid {info.get('pid', '?')}"
        if r.status == "died":
            lines.append(f"rank {r.rank} ({where}) died: its engine process ended during the cell.")
        elif r.status == "gone":
            lines.append(
                f"rank {r.rank} ({where}) is gone: its engine process ended before the cell; nothing ran."
            )
        elif r.status == "killed":
            lines.append(f"rank {r.rank} ({where}) did not stop when asked and freed; it was killed.")
        elif r.rank in outcome.freed:
            lines.append(
                f"rank {r.rank} ({where}) was waiting in a collective the other ranks did not reach; "
                "it was freed from it."
            )
        elif r.status == "interrupted":
            lines.append(f"rank {r.rank} ({where}) was interrupted.")
        else:
            lines.append(f"rank {r.rank} ({where}) raised {r.ename}: {r.evalue}")
            if r.traceback:
                lines += ["    " + t for t in r.traceback.splitlines()]
    lines += outcome.notes
    preempted = slurm_preemption(pool) if outcome.broken else None
    if preempted:
        lines += [
            preempted,
            "gpuhub: the engines' Slurm job was preempted (borrowed GPUs taken back); restore what "
            "was saved with %distributed restore NAME... in a pool within your limit.",
        ]
    if outcome.broken:
        lost = [r.rank for r in outcome.ranks if r.status in ("died", "killed", "gone")]
        which = ", ".join(map(str, lost)) or "a rank"
        lines.append(
            f"Lost: the process of rank {which} and its variables. A process group cannot go on "
            "without a rank, so the next %%distributed cell starts fresh engines on every rank: "
            "re-run the cells that define your objects, then %distributed restore NAME... what "
            "you saved."
        )
    elif outcome.failed or outcome.interrupted:
        lines.append("Every rank's variables are kept, in the same processes.")
    return "\n".join(lines)


class DistributedInterrupt(KeyboardInterrupt):
    """The kernel's interrupt, shown as the ranks' report rather than the magic's frames."""

    def __init__(self, report: str):
        super().__init__(report)
        self.report = report

    def _render_traceback_(self):
        return ["KeyboardInterrupt: the cell was interrupted.", *self.report.splitlines()]


DistributedInterrupt.__name__ = DistributedInterrupt.__qualname__ = (
    "KeyboardInterrupt"  # as notebooks name it
)


class PreemptNow(KeyboardInterrupt):
    """Raised in the running cell's loop when the borrowed GPUs' time is up: the cell is
    interrupted as the stop button does, every rank keeping its state."""


class DistributedPreempted(DistributedError):
    """The pool was stopped because its borrowed GPUs were taken back."""

    def _render_traceback_(self):
        return ["Preempted: the pool's borrowed GPUs were taken back.", *self.report.splitlines()]


DistributedPreempted.__name__ = DistributedPreempted.__qualname__ = "Preempted"


@dataclass
class Notice:
    """The broker's notice that a part of the pool's burst (its borrowed GPUs) is taken back."""

    part: Burst  # the allocation with the borrowed GPUs
    reason: str
    due: float  # Unix time
    shown: bool = False  # printed in the cell that runs now
    acted: bool = False  # saved (with autosave) and stopped
    interrupted: bool = False  # the running cell was interrupted for it

    @property
    def due_text(self) -> str:
        return datetime.fromtimestamp(self.due, UTC).strftime("%H:%M:%S UTC")


def _taken(part) -> str:
    """What of a burst may be taken back: its borrowed GPUs, or all of one that started ahead
    of the queue (backfill)."""
    if part.borrowed:
        return f"{part.borrowed} borrowed GPU(s)"
    return f"{part.size} GPU(s) that started ahead of the queue"


def parse_due(text: str | None) -> float:
    """The broker's ISO time (UTC) as Unix time; now when there is none."""
    if not text:
        return time.time()
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


NOT_RUN = "This cell did not run; run it again to start new engines."


def _names(names) -> str:
    return ", ".join(names) or "none"


@magics_class
class DistributedMagics(CheckpointCommands, Magics):
    idle_seconds = Float(
        1800.0,
        help="Stop the pool and release burst GPUs after this many idle seconds. "
        "%config DistributedMagics.idle_seconds = 600",
    ).tag(config=True)
    lease_seconds = Float(
        300.0,
        help="Lease asked for burst GPUs, renewed every third of it. "
        "%config DistributedMagics.lease_seconds = 120",
    ).tag(config=True)
    timeout = Float(
        300.0,
        help="Default collective timeout in seconds (--timeout). %config DistributedMagics.timeout = 60",
    ).tag(config=True)
    notice_check_seconds = Float(
        5.0,
        help="How often a pool on borrowed GPUs asks the broker whether they are being taken back "
        "(between lease renewals); a grace period shorter than this may be seen late. "
        "%config DistributedMagics.notice_check_seconds = 2",
    ).tag(config=True)
    preempt_save_seconds = Float(
        30.0,
        help="With --autosave: how long before a preemption is due the running cell is interrupted "
        "and the names saved (at once when the notice leaves less). "
        "%config DistributedMagics.preempt_save_seconds = 60",
    ).tag(config=True)

    def __init__(self, shell=None, **kw):
        super().__init__(shell=shell, **kw)
        self.pool: EnginePool | None = None
        self.burst: dict | None = None
        self.lease: LeaseKeeper | None = None
        self.key: tuple | None = None
        self.busy = 0  # cells running now: the idle timer never stops a busy pool
        self.last_used = time.monotonic()
        self.lock = threading.RLock()
        self._idle_timer: threading.Timer | None = None
        self._notice: Notice | None = None  # a preemption notice for the pool's burst
        self._preempt_report: str | None = None  # a preemption that stopped the idle pool
        self._releasing: list[Burst] = []  # preempted parts released at their due time
        atexit.register(self._at_exit)  # kernel shutdown: no orphaned engines, GPUs back

    def _touch(self) -> None:
        self.last_used = time.monotonic()

    def _idle_seconds(self) -> float:
        """Seconds since the engines last ran a cell (0 while one runs): the broker's idle
        reclaim counts a burst busy while it is used."""
        return 0.0 if self.busy else time.monotonic() - self.last_used

    # GPUs -----------------------------------------------------------------------------

    _burst: Burst | None = None  # the burst the pool's engines use (its lifecycle)
    _own: tuple[Slot, ...] = ()  # the server's own GPUs the pool's engines use

    def _set_burst(self, burst: Burst | None) -> None:
        """Make ``burst`` the pool's; ``self.burst``/``self.lease`` are its allocation and lease."""
        self._burst = burst
        self.burst = burst.allocation if burst is not None else None
        self.lease = burst.lease if burst is not None else None

    def _request_burst(self, n: int, held: int, wanted: int, wait: bool = True, **where) -> Burst:
        """``wait``: join the queue when the GPUs are all taken (never while the pool still
        holds a burst: waiting for GPUs behind its own would never end)."""
        return Burst.request(
            "%%distributed",
            n,
            wait=wait,
            lease_seconds=self.lease_seconds,
            held=held,
            wanted=wanted,
            activity=self._idle_seconds,
            check_seconds=self.notice_check_seconds,
            on_notice=self._on_notice,
            **where,
        )

    def _room(self) -> int | None:
        """GPUs the user may still take within their limit, when they could borrow beyond it
        (None: no limit, nothing to borrow, or unknown: one allocation, refused as such)."""
        from gpu_magics.kernel.broker import BrokerClient

        client = BrokerClient.from_env()
        if client is None:
            return None
        try:
            me = client.me()
        except Exception:  # unknown: asked for as one allocation, as before
            return None
        room, borrow = me.get("may_take"), me.get("borrow") or {}
        left = (borrow.get("allowance") or 0) - (borrow.get("borrowed") or 0)
        return room if isinstance(room, int) and left > 0 else None

    def _request_local_burst(self, n: int, held: int, wanted: int, wait: bool, node: str | None):
        """A local burst of ``n`` GPUs on one node. Where only part of it fits the user's limit
        it is asked for as two allocations, the part within the limit and the borrowed rest
        (a :class:`SplitBurst`): a preemption then takes back only the borrowed GPUs."""
        room = self._room()
        if room is None or room <= 0 or room >= n:
            return self._request_burst(n, held, wanted, wait=wait, nodes=1, node=node)
        first = self._request_burst(room, held, wanted, wait=wait, nodes=1, node=node)
        try:
            node = node or (first.slots[0].node if first.slots else None)
            second = self._request_burst(n - room, held + room, wanted, wait=False, nodes=1, node=node)
        except UsageError as e:
            first.release()
            text = str(e).split(": ", 1)[-1]
            err = UsageError(
                f"gpuhub refused the {n - room} GPU(s) beyond your limit for %%distributed --gpus "
                f"{wanted} ({room} within it were granted and are given back): {text}"
            )
            err.refusal = getattr(e, "refusal", None)
            raise err from None
        except BaseException:
            first.release()
            raise
        return SplitBurst([first, second])

    def _acquire(self, gpus: int, old: Burst | None = None) -> tuple[tuple[Slot, ...], Burst | None]:
        """The GPUs of a local pool of ``gpus`` ranks: the server's own, and a burst of only
        what they lack, on their node. ``old`` (the pool's burst) is kept where it is the size
        needed; else a new burst is asked for while ``old`` is still held (the caller decides
        what a refusal means). Raises UsageError with the broker's reason; nothing is taken."""
        own = server_gpus()
        plan = plan_gpus(own.gpus, gpus)
        if not plan.burst:
            return plan.own, None
        if (
            old is not None
            and not old.lost
            and old.size == plan.burst
            and (plan.node is None or {s.node for s in old.slots} == {plan.node})
        ):
            return plan.own, old
        # engines run on this machine: the burst on one node, the server's own when it has GPUs
        burst = self._request_local_burst(plan.burst, len(plan.own), gpus, old is None, plan.node)
        return plan.own, burst

    def _release_burst(self) -> None:
        if self._burst is not None:
            self._burst.release()  # says so when the broker could not be told
        self._set_burst(None)

    # pool -----------------------------------------------------------------------------

    def _slurm_launcher(self, args):
        """(launcher, GPUs of a burst job or 0): a step of this server's job when it holds the
        GPUs, else a burst job of their own (admitted by the broker, placed by Slurm over
        ``--nodes``). Checked before anything is stopped."""
        from gpu_magics.launch.slurm import SlurmLauncher, plan_launch

        own = len([g for g in os.environ.get("SLURM_JOB_GPUS", "").split(",") if g.strip()])
        try:
            mode, nodes, per_node = plan_launch(own, args.gpus, args.nodes, args.gpus_per_node)
        except ValueError as e:
            raise UsageError(str(e)) from None
        launcher = SlurmLauncher(
            mode,
            nodes,
            per_node,
            os.path.expanduser("~"),
            os.environ.get("SLURM_JOB_PARTITION", ""),
            os.environ.get("GPUHUB_SLURM_ACCOUNT", ""),
        )
        return launcher, own

    def _slurm_pool(self, args, timeout: float, launcher) -> EnginePool:
        """Engines as Slurm tasks; a burst job is tagged with the pool's burst (``self._burst``)."""
        # the engines save the pool's --autosave names at Slurm's SIGTERM (a preemption)
        launcher.autosave = (list(self.autosave), self.autosave_dir) if self.autosave else None
        if launcher.mode == "job":
            burst = self._burst
            launcher.allocation_id = burst.id
            launcher.on_submitted = burst.attach_job
            launcher.borrowed = burst.borrowed  # beyond the limit: the job runs preemptible
        return EnginePool([], args.backend, timeout, launcher=launcher, n=args.gpus)

    def _new_gpus(self, args, on_slurm: bool, old: Burst | None):
        """(own slots, burst or None, Slurm launcher or None) for a new pool, asked for while
        the current pool still runs: a refusal leaves it as it is."""
        if not on_slurm:
            own, burst = self._acquire(args.gpus, old)
            return own, burst, None
        launcher, own = self._slurm_launcher(args)
        if launcher.mode != "job":
            return (), None, launcher
        # a Slurm burst's job ends with its engines: a new pool asks anew
        burst = self._request_burst(
            args.gpus, own, args.gpus, nodes=launcher.nodes, gpus_per_node=launcher.per_node
        )
        return (), burst, launcher

    def _user_names(self) -> list[str] | None:
        """The names the user's cells defined on any rank of the pool (None: no answer)."""
        from gpu_magics.engine.namespace import user_names

        try:
            per_rank = self.pool.view.apply_async(user_names).get(timeout=15)
        except Exception:
            return None
        return sorted({name for names in per_rank for name in names})

    def _autosave_on(self, args) -> bool:
        return bool(getattr(args, "autosave", None) or getattr(self, "autosave", None))

    def _replace_pool(self, why: str | None, autosave: bool, release: bool) -> None:
        """Stop the current pool (saved first where autosave is on) so that new engines can
        start; ``release``: its burst goes too."""
        if self.pool is not None:
            save = getattr(self, "_save_before_stop", None) if autosave else None
            if save is not None:
                try:
                    save("resize")
                except Exception as e:
                    if why == OTHER_SETTINGS:
                        raise  # the pool still works: nothing is stopped unsaved
                    print(f"gpuhub: could not save before restarting the engines: {e}", file=sys.stderr)
            print(f"gpuhub: restarting the engines ({why}).")
            self._stop_pool(release=release)
        elif release:
            self._release_burst()

    def _ensure_pool(self, args) -> EnginePool:
        timeout = args.timeout or self.timeout
        shape = (args.gpus, args.nodes, args.gpus_per_node)
        on_slurm = os.environ.get("GPUHUB_BACKEND") == "slurm"
        key = (shape, args.backend, timeout)
        restart = bool(getattr(args, "restart", False))
        with self.lock:
            why = why_new_engines(
                has_pool=self.pool is not None,
                same_settings=self.key == key,
                broken=bool(self.pool is not None and self.pool.broken),
                lease_lost=self._lease_lost(),
                restart=restart,
            )
            resized = False
            if self.pool is None or why is not None:
                autosave = self._autosave_on(args)
                if why == OTHER_SETTINGS and not autosave:
                    (gpus, nodes, per_node), backend, old_timeout = self.key
                    message = refuse_discard(
                        why,
                        self._user_names(),
                        restart=restart,
                        autosave=autosave,
                        current=describe_settings(gpus, backend, old_timeout, nodes, per_node),
                        asked=describe_settings(
                            args.gpus, args.backend, timeout, args.nodes, args.gpus_per_node
                        ),
                    )
                    if message:
                        raise UsageError(message)
                old = self._burst
                if old is not None and (old.lost or (on_slurm and self.pool is None)):
                    self._release_burst()  # gone, or a Slurm job's that ended with its engines
                    old = None
                cleared = False
                try:
                    own, burst, launcher = self._new_gpus(args, on_slurm, old if not on_slurm else None)
                except UsageError as e:
                    refusal = getattr(e, "refusal", None)
                    need = args.gpus if on_slurm else plan_gpus(server_gpus().gpus, args.gpus).burst
                    if (
                        refusal is None
                        or old is None
                        or not may_retry_after_release(refusal.reason, refusal.fits, old.size, need)
                    ):
                        raise  # nothing was stopped: the pool, its processes and its state stay
                    # only the pool's own burst stands in the way: the pool goes (its user agreed,
                    # or holds nothing), then its GPUs are asked for again
                    self._replace_pool(why, autosave, release=True)
                    cleared = True
                    try:
                        own, burst, launcher = self._new_gpus(args, on_slurm, None)
                    except UsageError as again:
                        raise UsageError(
                            f"{again} (The pool's engines were stopped and its burst released "
                            "first, to make room for this one.)"
                        ) from None
                if not cleared:
                    try:
                        self._replace_pool(why, autosave, release=burst is not old)
                    except BaseException:
                        if burst is not None and burst is not old:
                            burst.release()  # the save failed: the old pool stays as it was
                        raise
                resized = why is not None and autosave  # saved: the new pool gets it back
                self._set_burst(burst)
                self._own = tuple(own)
                slots = self._current_slots()
            if self.pool is None:
                try:
                    if on_slurm:
                        pool = self._slurm_pool(args, timeout, launcher)
                    else:
                        pool = EnginePool(
                            make_rank_specs(slots, "127.0.0.1", free_port()), args.backend, timeout
                        )
                    # a burst's engines report their own GPUs; beside the server's own GPUs
                    # (which the server reports) this kernel reports the burst's
                    mixed = bool(self._own) and self._burst is not None
                    pool.report_allocation = (
                        0
                        if not self.burst or mixed
                        else self._burst.report_ids()
                        if len(self._burst.parts) > 1
                        else self.burst["id"]
                    )
                    if mixed:
                        self._burst.report_here()
                    handle = display(
                        _text(f"Starting engines: 0 of {pool.size} up"), raw=True, display_id=True
                    )

                    def progress(up, n):
                        update_display(
                            _text(f"Starting engines: {up} of {n} up"), raw=True, display_id=handle.display_id
                        )

                    try:
                        pool.start(progress)
                    except BaseException:
                        pool.stop()
                        raise
                    # exit handlers run last registered first: the engines' stop and the burst's
                    # release come before ipyparallel's own (which would take the 2.5 s Jupyter
                    # gives a kernel before its SIGTERM)
                    atexit.unregister(self._at_exit)
                    atexit.register(self._at_exit)
                except KeyboardInterrupt:
                    self._release_burst()  # nothing may keep GPUs that no engine uses
                    raise DistributedInterrupt(
                        "Interrupted while the engines started: they were stopped and any burst GPUs "
                        "released. Nothing had run on them; run the cell again to start them."
                    ) from None
                except BaseException:
                    self._release_burst()  # nothing may keep GPUs that no engine uses
                    raise
                update_display(
                    _text(
                        f"{pool.size} engines up: "
                        + ", ".join(f"rank {s.rank} on {s.slot.label}" for s in pool.specs)
                    ),
                    raw=True,
                    display_id=handle.display_id,
                )
                self.pool, self.key = pool, key
                self._arm_idle_timer()
                restore = getattr(self, "_restore_after_resize", None) if resized else None
                if restore is not None:
                    restore()
            self.busy += 1  # under the lock: the idle timer cannot slip in before the cell runs
            self._touch()
            return self.pool

    def _lease_lost(self) -> bool:
        return bool(self._burst is not None and self._burst.lost)

    def _current_slots(self) -> list[Slot]:
        """The pool's GPUs: the server's own it uses, then its burst's."""
        return [*self._own, *(self._burst.slots if self._burst is not None else ())]

    def _stop_pool(self, release: bool = True, why: str | None = None) -> None:
        if self.pool is not None:
            why = self._save_then_forget(why)  # autosave first; a failed save never keeps them
            self.pool.stop(graceful=why != "exit")
            self.pool = None
            self.key = None
            self._forget_autosave(why)
        if release:
            self._release_burst()

    def _arm_idle_timer(self) -> None:
        if self._idle_timer:
            self._idle_timer.cancel()
        # as often as the lease is renewed: a burst the hub reclaimed stops soon after
        self._idle_timer = threading.Timer(
            min(self.idle_seconds, self.lease_seconds / 3, 60), self._check_idle
        )
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _check_idle(self) -> None:
        with self.lock:
            if self.pool is None:
                return
            if self._current_notice() is not None:
                pass  # a preemption: _act_on_notice saves and stops the pool at its time
            elif self._lease_lost() and not self.busy:
                why = self.lease.reason or "released by the hub"
                print(f"gpuhub: the burst allocation was ended ({why}); stopping the engines.")
                self._stop_pool(why="reclaim")
                return
            if not self.busy and time.monotonic() - self.last_used >= self.idle_seconds:
                print(f"gpuhub: the engines were idle for {self.idle_seconds:.0f} s; stopping them.")
                self._stop_pool(why="idle")
                return
        self._arm_idle_timer()

    def _at_exit(self) -> None:
        """The kernel's exit hook: the engines' stop and the burst's release, not cut short by
        the kernel manager's SIGTERM (:func:`_hold_sigterm`)."""
        _hold_sigterm()
        self.shutdown()

    def shutdown(self, why: str = "exit") -> None:
        with self.lock:
            if self._idle_timer:
                self._idle_timer.cancel()
            self._stop_pool(why=why)
            self._release_preempted()

    # preemption -----------------------------------------------------------------------

    def _on_notice(self, part: Burst, notice: dict) -> None:
        """The lease's thread saw a preemption notice for ``part``: remember it, and act at
        its time even if no cell runs then. A withdrawal (``{"withdrawn": {"at", "reason"}}``,
        the ledger's) forgets it: its timer then finds it is no longer the current notice."""
        withdrawn = notice.get("withdrawn")
        if withdrawn is not None:
            with self.lock:
                n = self._notice
                if n is None or n.part is not part or n.acted:
                    return
                self._notice = None
            say(
                f"gpuhub: the notice for {_taken(part)} of this pool (allocation #{part.id}) was "
                f"{withdrawn.get('reason') or 'withdrawn'}. Nothing is taken back: the pool keeps them.",
                err=True,
            )
            return
        self._notice = Notice(part, notice.get("reason") or "preempted", parse_due(notice.get("due")))
        self._arm_notice_timer(self._notice)

    def _arm_notice_timer(self, n: Notice, delay: float | None = None) -> None:
        if delay is None:
            delay = max(0.0, self._act_at(n) - time.time())
        t = threading.Timer(delay, self._act_on_notice, args=(n,))
        t.daemon = True
        t.start()

    def _act_at(self, n: Notice) -> float:
        """When the pool saves and stops: ``preempt_save_seconds`` before the due time with
        autosave (so that the save is done before it), else at the due time."""
        return n.due - (self.preempt_save_seconds if self.autosave else 0.0)

    def _current_notice(self) -> Notice | None:
        """The notice for the pool's burst, if any; a burst whose renewal was refused as
        preempted before any notice was seen counts as one due now."""
        b = self._burst
        if b is None:
            return None
        n = self._notice
        if n is not None and any(n.part is p for p in b.parts):
            return n
        for p in b.parts:
            if p.lost and (p.preemption or "preempted" in p.reason):
                got = p.preemption or {}
                self._notice = Notice(p, got.get("reason") or p.reason, parse_due(got.get("due")))
                return self._notice
        return None

    def _notice_text(self, n: Notice) -> str:
        left = max(0, n.due - time.time())
        head = (
            f"gpuhub: NOTICE: {_taken(n.part)} of this pool (allocation #{n.part.id}) "
            f"are taken back at {n.due_text} (in {left:.0f} s): {n.reason}."
        )
        if self.autosave:
            at = max(time.time(), self._act_at(n))
            when = datetime.fromtimestamp(at, UTC).strftime("%H:%M:%S UTC")
            tail = (
                f"A pool cannot go on without some of its ranks: at {when} a running cell is "
                f"interrupted, {_names(self.autosave)} autosaved to {self.autosave_dir}, and the "
                "engines stopped."
            )
        else:
            tail = (
                f"At {n.due_text} the engines stop and their variables are lost (this pool has no "
                "--autosave): run %distributed save NAME... before then to keep them."
            )
        return f"{head}\n{tail}"

    def _tick(self) -> None:
        """Called in the running cell's loop: shows a notice that came during the cell, and
        interrupts the cell once its time to save and stop has come."""
        n = self._current_notice()
        if n is None or n.acted:
            return
        if not n.shown:
            n.shown = True
            say(self._notice_text(n), err=True)
        if time.time() >= self._act_at(n):
            n.interrupted = True
            what = f"save {_names(self.autosave)}" if self.autosave else "stop the engines"
            say(f"gpuhub: interrupting the cell to {what} before the borrowed GPUs are taken back.", err=True)
            raise PreemptNow()

    def _act_on_notice(self, n: Notice) -> None:
        """The notice's timer: with no cell running, save and stop the pool at its time."""
        with self.lock:
            if n.acted or self._current_notice() is not n:
                return
            if self.busy or time.time() < self._act_at(n):  # a cell's _tick acts; or autosave changed
                self._arm_notice_timer(n, min(1.0, max(0.05, self._act_at(n) - time.time())))
                return
            text = self._preempt_stop(n)
            self._preempt_report = text
        say(text, err=True)

    def _preempt_stop(self, n: Notice) -> str:
        """Save (with autosave), stop the engines, release what is within the limit now and
        the preempted part at its due time (so that the hub records it as preempted); the
        report of what was kept and what was lost. Called under ``self.lock``."""
        n.acted = True
        pool, burst = self.pool, self._burst
        names, where = list(self.autosave), self.autosave_dir
        defined = self._user_names() if pool is not None and pool.view is not None else None
        saved: Saved | None = None
        problem = None
        if pool is not None and names:
            try:
                saved = self._save_before_stop("preempt")
            except BaseException as e:  # never keeps the engines running past the due time
                problem = str(e)
        self.autosave = []  # saved above: the stop below does not try again
        parts = burst.parts if burst is not None else []
        if pool is not None:
            self._stop_pool(release=False, why="preempt")
        self._set_burst(None)
        now = [p for p in parts if not p.preemption and not p.lost]
        for p in now:
            p.release()
        later = [p for p in parts if p not in now]
        self._releasing += later
        # saved and stopped: the borrowed GPUs go back now, not at the due time (the ledger
        # records a give-back after the notice as the preemption's, saying it came early)
        t = threading.Timer(0.0, self._release_preempted)
        t.daemon = True
        t.start()

        lines = [
            f"gpuhub: the pool's {_taken(n.part)} (allocation #{n.part.id}) are taken "
            f"back at {n.due_text}: {n.reason}."
        ]
        kept = [f["name"] for f in saved.files] if saved else []
        if saved:
            lines.append(f"Kept: {_names(kept)}, saved from rank {saved.rank} before the due time:")
            lines += [f"  {f['name']}: {f['path']}" for f in saved.files]
        elif names:
            lines.append(f"Not saved: the autosave of {_names(names)} failed: {problem or 'nothing to save'}")
        else:
            lines.append("Nothing was saved: this pool had no --autosave.")
        others = [x for x in (defined or []) if x not in kept]
        if defined is None:
            lines.append("Lost: every variable of the ranks" + (" not saved above." if kept else "."))
        else:
            lines.append(f"Lost: the ranks' other variables: {_names(others)}.")
        if n.interrupted:
            lines.append("The running cell was interrupted (its work up to then is in what was saved).")
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

    def _release_preempted(self) -> None:
        """Give back the preempted parts (at their due time, or at shutdown)."""
        while self._releasing:
            self._releasing.pop().release()

    def _before_cell(self) -> None:
        """At the start of a cell: a preemption that stopped the idle pool is reported (and the
        cell does not run on new engines unasked); a pending notice is shown; one whose time
        has come is acted on now."""
        if self._preempt_report:
            text, self._preempt_report = self._preempt_report, None
            raise DistributedPreempted(f"{text}\n{NOT_RUN}")
        with self.lock:
            n = self._current_notice()
            if n is None or n.acted:
                return
            if time.time() >= self._act_at(n):
                text = self._preempt_stop(n)
                raise DistributedPreempted(f"{text}\n{NOT_RUN}")
        n.shown = True
        say(self._notice_text(n), err=True)

    # the magic ------------------------------------------------------------------------

    @magic_arguments.magic_arguments()
    @magic_arguments.argument(
        "command", nargs="?", choices=["shutdown", "status", "save", "restore"], help="line form only"
    )
    @magic_arguments.argument("names", nargs="*", metavar="NAME", help="save/restore: the ranks' variables")
    @magic_arguments.argument("--gpus", type=COUNT("--gpus"), help="ranks: one engine per GPU")
    @magic_arguments.argument(
        "--nodes", type=COUNT("--nodes"), help="nodes to spread over (default: as few as fit)"
    )
    @magic_arguments.argument(
        "--gpus-per-node", type=COUNT("--gpus-per-node"), help="GPUs (ranks) on each node"
    )
    @magic_arguments.argument(
        "--backend", choices=["nccl", "gloo"], help="default: nccl with GPUs, gloo without"
    )
    @magic_arguments.argument(
        "--timeout",
        type=SECONDS("--timeout"),
        help="collective timeout in seconds",
    )
    @magic_arguments.argument(
        "--output", choices=["all", "rank0"], default="all", help="whose output to show"
    )
    @magic_arguments.argument("--targets", help="run on these ranks only, e.g. 0 or 0,2-3")
    @magic_arguments.argument(
        "--restart",
        action="store_true",
        help="start fresh engines, discarding the pool's variables (needed to change a pool that holds them)",
    )
    @magic_arguments.argument(
        "--autosave",
        nargs="*",
        metavar="NAME",
        help="save these variables before the pool's engines stop (idle, reclaim, shutdown, resize, "
        "kernel exit); --autosave alone: off",
    )
    @magic_arguments.argument("--dir", help=f"checkpoints' directory (default {DEFAULT_DIR})")
    @line_cell_magic
    def distributed(self, line: str, cell: str | None = None):
        """Run the cell on one warm engine per GPU, with torch.distributed initialised."""
        args = self._arguments(line)
        if cell is None:
            if args.autosave is not None:
                raise UsageError("--autosave goes on a cell: %%distributed --gpus N --autosave NAME...")
            if args.command in ("save", "restore"):
                self._checkpoint_command(args.command, args.names, args.dir)
                return None
            if args.names or args.dir is not None:
                raise UsageError("NAME... and --dir go with %distributed save|restore NAME... [--dir D]")
            if args.command == "shutdown":
                had = self.pool is not None or self.burst is not None
                self.shutdown("shutdown")
                print(
                    "gpuhub: engines stopped and burst GPUs released." if had else "gpuhub: no pool to stop."
                )
                return None
            if args.command == "status":
                print(self.describe())
                return None
            raise UsageError(
                "line form: %distributed shutdown | status | save NAME... [--dir D] "
                "| restore NAME... [--dir D]"
            )
        if args.command:
            raise UsageError(f"{args.command!r} is a line command: %distributed {args.command}")
        if args.dir is not None and not args.autosave:
            raise UsageError("--dir goes with --autosave NAME... (or %distributed save|restore NAME...)")
        if args.autosave:
            check_names(args.autosave, "--autosave")
        self._set_autosave(args.autosave, args.dir)  # a pool replaced below is saved under these
        if args.gpus is None:
            own = len(server_gpus().gpus)
            if not own:
                raise UsageError("say how many GPUs: %%distributed --gpus N")
            args.gpus = own
        on_slurm = os.environ.get("GPUHUB_BACKEND") == "slurm"
        if not on_slurm and ((args.nodes or 1) > 1 or args.gpus_per_node not in (None, args.gpus)):
            raise UsageError(
                "this server runs every engine on its own machine: --nodes 1 only (multi-node "
                "%%distributed needs the Slurm backend)"
            )
        self._before_cell()  # a preemption notice, or the report of one that stopped the pool
        pool = self._ensure_pool(args)  # marks the pool busy
        self._set_autosave(args.autosave, args.dir, quiet=True)  # remembered for this pool
        self._hook_exit()  # a new pool: the kernel-exit autosave goes after its own exit hook
        try:
            targets = parse_targets(args.targets, pool.size) if args.targets else None
            grace = min(args.timeout or self.timeout, 30)
            outcome = pool.run(cell, output=args.output, grace=grace, ranks=targets, tick=self._tick)
        finally:
            with self.lock:
                self.busy -= 1
                self._touch()
        with self.lock:
            n = self._current_notice()
            if n is not None and not n.acted and (n.interrupted or time.time() >= self._act_at(n)):
                ranks = report(outcome, pool) if outcome.failed and not outcome.interrupted else ""
                text = self._preempt_stop(n)
                raise DistributedPreempted("\n".join(filter(None, [ranks, text]))) from None
            if n is not None:
                n.shown = False  # the next cell shows it again
        if outcome.interrupted:
            raise DistributedInterrupt(report(outcome, pool)) from None
        if outcome.failed:
            raise DistributedError(report(outcome, pool)) from None
        if outcome.notes:
            print("\n".join(outcome.notes), file=sys.stderr)
        if outcome.result:
            return RankResult(outcome.result)
        return None

    _parsed: dict | None = None  # a line's arguments, parsed once (``_arguments``)

    def _arguments(self, line: str) -> argparse.Namespace:
        """The magic's arguments for ``line``: parsed once per distinct line (the parse is pure:
        the same line always gives the same arguments, and argparse took a third of the magic's
        own time per cell), each cell getting its own copy to change."""
        parsed = self._parsed if self._parsed is not None else {}
        self._parsed = parsed
        args = parsed.get(line)
        if args is None:
            try:
                args = magic_arguments.parse_argstring(self.distributed, line)
            except UsageError as e:
                raise UsageError(
                    f"{e}\nusage: %%distributed --gpus N [--nodes M] [--backend gloo|nccl] "
                    "[--timeout S] [--output all|rank0] [--targets 0,2-3]"
                ) from None
            if len(parsed) >= 64:
                parsed.clear()
            parsed[line] = args
        return argparse.Namespace(**{k: list(v) if isinstance(v, list) else v for k, v in vars(args).items()})

    def describe(self) -> str:
        own = server_gpus()
        lines = [f"server GPUs: {', '.join(own.gpus) or 'none'}"]
        if self.pool is None:
            lines.append("engines: none (started by the first %%distributed cell)")
        else:
            lines.append(f"controller: pid {self.pool.controller_pid}")
            for spec, info in zip(self.pool.specs, self.pool.infos, strict=False):
                lines.append(f"rank {spec.rank}: GPU {spec.slot.label}, pid {info['pid']}, {info['backend']}")
        if self.burst:
            for part in self._burst.parts if self._burst is not None else []:
                a = part.allocation
                borrowed = (
                    f", {part.borrowed} borrowed beyond your limit (may be taken back with notice)"
                    if part.borrowed
                    else ", started ahead of the queue (may be taken back with notice at its turn)"
                    if a.get("backfill")
                    else ""
                )
                lines.append(
                    f"burst allocation #{a['id']}: {_burst_size(a)} GPUs"
                    + (f" (Slurm job {a['backend_job_id']})" if a.get("backend_job_id") else "")
                    + borrowed
                    + f", lease until {part.expires}"
                )
        n = self._current_notice()
        if n is not None and not n.acted:
            lines.append(self._notice_text(n).replace("gpuhub: ", "", 1))
        if self._autosave_text():
            lines.append(self._autosave_text())
        return "\n".join(lines)


class RankResult:
    """Rank 0's last expression, shown as the cell's result."""

    def __init__(self, execute_result: dict):
        self.data = execute_result.get("data", {})
        self.metadata = execute_result.get("metadata", {})

    def _repr_mimebundle_(self, include=None, exclude=None):
        return self.data, self.metadata

    def __repr__(self):
        return self.data.get("text/plain", "")


def _hold_sigterm() -> None:
    """At the kernel's exit: a SIGTERM no longer cuts short the engines' stop and the burst's
    release. Jupyter's kernel manager sends one half-way through its shutdown wait (2.5 s of
    5 by default) and SIGKILL at its end; the release, which took about 2.6 s at load 2,
    would otherwise be lost and the GPUs held until the lease runs out."""
    import signal as _signal

    with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to do
        _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)


def register(ipython) -> DistributedMagics:
    magics = DistributedMagics(shell=ipython)
    ipython.register_magics(magics)
    os.environ.setdefault("GPUHUB_KERNEL_PID", str(os.getpid()))
    return magics
