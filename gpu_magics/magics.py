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

import os
import socket
import sys
import threading
import time

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display, update_display
from traitlets import Float

from .arguments import COUNT, SECONDS
from .brokerclient import LeaseKeeper
from .burst import Burst, burst_size
from .checkpoint import DEFAULT_DIR, check_names
from .checkpointer import CheckpointCommands
from .plan import (
    OTHER_SETTINGS,
    describe_settings,
    may_retry_after_release,
    plan_gpus,
    refuse_discard,
    why_new_engines,
)
from .pool import CellOutcome, EnginePool
from .ranks import Slot, make_rank_specs
from .session import server_gpus


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
        import atexit

        atexit.register(self.shutdown)  # kernel shutdown: no orphaned engines, GPUs back

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
            **where,
        )

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
        burst = self._request_burst(
            plan.burst, len(plan.own), gpus, wait=old is None, nodes=1, node=plan.node
        )
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
        from .slurmengines import SlurmLauncher, plan_launch

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
        if launcher.mode == "job":
            burst = self._burst
            launcher.allocation_id = burst.id
            launcher.on_submitted = burst.attach_job
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
        from .rankns import user_names

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
                    pool.report_allocation = self.burst["id"] if self.burst and not mixed else 0
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
            self.pool.stop()
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
            if self._lease_lost() and not self.busy:
                why = self.lease.reason or "released by the hub"
                print(f"gpuhub: the burst allocation was ended ({why}); stopping the engines.")
                self._stop_pool(why="reclaim")
                return
            if not self.busy and time.monotonic() - self.last_used >= self.idle_seconds:
                print(f"gpuhub: the engines were idle for {self.idle_seconds:.0f} s; stopping them.")
                self._stop_pool(why="idle")
                return
        self._arm_idle_timer()

    def shutdown(self, why: str = "exit") -> None:
        with self.lock:
            if self._idle_timer:
                self._idle_timer.cancel()
            self._stop_pool(why=why)

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
        try:
            args = magic_arguments.parse_argstring(self.distributed, line)
        except UsageError as e:
            raise UsageError(
                f"{e}\nusage: %%distributed --gpus N [--nodes M] [--backend gloo|nccl] "
                "[--timeout S] [--output all|rank0] [--targets 0,2-3]"
            ) from None
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
        pool = self._ensure_pool(args)  # marks the pool busy
        self._set_autosave(args.autosave, args.dir, quiet=True)  # remembered for this pool
        self._hook_exit()  # a new pool: the kernel-exit autosave goes after its own exit hook
        try:
            targets = parse_targets(args.targets, pool.size) if args.targets else None
            grace = min(args.timeout or self.timeout, 30)
            outcome = pool.run(cell, output=args.output, grace=grace, ranks=targets)
        finally:
            with self.lock:
                self.busy -= 1
                self._touch()
        if outcome.interrupted:
            raise DistributedInterrupt(report(outcome, pool)) from None
        if outcome.failed:
            raise DistributedError(report(outcome, pool)) from None
        if outcome.notes:
            print("\n".join(outcome.notes), file=sys.stderr)
        if outcome.result:
            return RankResult(outcome.result)
        return None

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
            expires = self.lease.expires if self.lease else self.burst.get("lease_expires")
            lines.append(
                f"burst allocation #{self.burst['id']}: {_burst_size(self.burst)} GPUs"
                + (f" (Slurm job {self.burst['backend_job_id']})" if self.burst.get("backend_job_id") else "")
                + f", lease until {expires}"
            )
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


def register(ipython) -> DistributedMagics:
    magics = DistributedMagics(shell=ipython)
    ipython.register_magics(magics)
    os.environ.setdefault("GPUHUB_KERNEL_PID", str(os.getpid()))
    return magics
