"""A ``%%distributed`` pool's life: :class:`Lifecycle` ensures the pool a cell asks for (its
GPUs asked for first, a refusal leaving the current pool as it is), replaces or stops it (saved
first where autosave is on; its burst released), stops it when idle or when the hub ended its
burst (the idle timer), and at the kernel's exit (the exit hook). It holds the pool's
:class:`~gpu_magics.kernel.preemption.Preemption`."""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time

from IPython.core.error import UsageError
from IPython.display import display, update_display

from gpu_magics.common import poolstatus
from gpu_magics.common.ranks import Slot, make_rank_specs
from gpu_magics.common.session import backend, server_gpus
from gpu_magics.kernel import resize, resizing
from gpu_magics.kernel.acquire import (
    LOST_BURST,
    OTHER_SETTINGS,
    Terms,
    describe_settings,
    may_retry_after_release,
    new_gpus,
    plan_gpus,
    refuse_discard,
    request_local_burst,
    why_new_engines,
)
from gpu_magics.kernel.burst import Burst
from gpu_magics.kernel.checkpoints import as_html, show
from gpu_magics.kernel.notices import engines_up
from gpu_magics.kernel.outcome import DistributedInterrupt, place
from gpu_magics.kernel.pool import EnginePool
from gpu_magics.kernel.preemption import Preemption
from gpu_magics.kernel.timeleft import TimeLeft


def _text(line: str) -> dict:
    """A status line shown as text (a str passed to display() shows as its repr), and as HTML
    that wraps at spaces only."""
    return {"text/plain": line, "text/html": as_html(line)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _hold_sigterm() -> None:
    """At the kernel's exit: a SIGTERM no longer cuts short the engines' stop and the burst's
    release. Jupyter's kernel manager sends one half-way through its shutdown wait (2.5 s of
    5 by default) and SIGKILL at its end; the release, which took about 2.6 s at load 2,
    would otherwise be lost and the GPUs held until the lease runs out."""
    import signal as _signal

    with contextlib.suppress(ValueError, OSError):  # not the main thread: nothing to do
        _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)


def silent_ranks(pool, timeout: float = 5.0) -> list[int]:
    """The ranks whose engine does not answer a trivial request within ``timeout`` s (after a
    cell every live rank is idle and answers at once)."""
    calls = {}
    for rank, eid in enumerate(pool.engine_ids):
        try:
            calls[rank] = pool.client[eid].apply_async(os.getpid)
        except Exception:
            calls[rank] = None
    deadline = time.monotonic() + timeout
    silent = []
    for rank, ar in calls.items():
        try:
            if ar is None:
                raise RuntimeError("no engine")
            ar.get(max(0.1, deadline - time.monotonic()))
        except Exception:
            silent.append(rank)
    return silent


class Lifecycle:
    """The pool, its burst and the server's own GPUs it uses, from start to stop.

    ``settings`` has the magic's ``idle_seconds``, ``lease_seconds``, ``timeout``,
    ``notice_check_seconds`` and ``preempt_save_seconds`` (read when used: ``%config`` changes
    them); ``autosave`` is the magic's checkpoint part (``autosave``, ``autosave_dir``,
    ``_save_before_stop``, ``_save_then_forget``, ``_forget_autosave``, ``_restore_after_resize``).
    """

    def __init__(self, settings, autosave):
        self.settings = settings
        self.autosave = autosave
        self.pool: EnginePool | None = None
        self.key: tuple | None = None  # the pool's settings
        self.burst: Burst | None = None  # the burst the pool's engines use
        self.own: tuple[Slot, ...] = ()  # the server's own GPUs the pool's engines use
        self.busy = 0  # cells running now: the idle timer never stops a busy pool
        self.last_used = time.monotonic()
        self.lock = threading.RLock()
        self._idle_timer: threading.Timer | None = None
        self.preemption = Preemption(self, autosave, settings)
        self.timeleft = TimeLeft(self, autosave, settings)  # the pool's time limit: warnings, then the stop
        atexit.register(self.at_exit)  # kernel shutdown: no orphaned engines, GPUs back

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def idle_seconds(self) -> float:
        """Seconds since the engines last ran a cell (0 while one runs): the broker's idle
        reclaim counts a burst busy while it is used."""
        return 0.0 if self.busy else time.monotonic() - self.last_used

    def lease_lost(self) -> bool:
        return bool(self.burst is not None and self.burst.lost)

    def terms(self) -> Terms:
        return Terms(
            self.settings.lease_seconds,
            self.settings.notice_check_seconds,
            self.idle_seconds,
            self.preemption.on_notice,
        )

    def user_names(self) -> list[str] | None:
        """The names the user's cells defined on any rank of the pool (None: no answer)."""
        from gpu_magics.engine.namespace import user_names

        try:
            per_rank = self.pool.view.apply_async(user_names).get(timeout=15)
        except Exception:
            return None
        return sorted({name for names in per_rank for name in names})

    # start ------------------------------------------------------------------------------

    def ensure(self, args) -> EnginePool:
        """The pool ``args`` asks for, warm or new; marked busy (the caller lowers ``busy``)."""
        timeout = args.timeout or self.settings.timeout
        shape = (args.gpus, args.nodes, args.gpus_per_node)
        on_slurm = backend() == "slurm"
        key = (shape, args.backend, timeout)
        restart = bool(getattr(args, "restart", False))
        with self.lock:
            if self.pool is not None and self.burst is not None and not self.burst.lost:
                self.burst.check_now()  # a kernel that was paused runs this before its lease thread wakes
            why = why_new_engines(
                has_pool=self.pool is not None,
                same_settings=self.key == key,
                broken=bool(self.pool is not None and self.pool.broken),
                lease_lost=self.lease_lost(),
                restart=restart,
            )
            if why == LOST_BURST:
                why = f"{why}: {self.burst.lost_text()}"
            resized = False
            if why == OTHER_SETTINGS and not restart and self._grows(args, key, on_slurm):
                self._grow(args, key)
                self.busy += 1
                self.touch()
                return self.pool
            if self.pool is None or why is not None:
                autosave = bool(getattr(args, "autosave", None) or self.autosave.autosave)
                if why == OTHER_SETTINGS and not autosave:
                    (gpus, nodes, per_node), backend_name, old_timeout = self.key
                    default = self.settings.timeout
                    message = refuse_discard(
                        why,
                        self.user_names(),
                        restart=restart,
                        autosave=autosave,
                        current=describe_settings(  # its timeout where it is not this cell's default
                            gpus,
                            backend_name,
                            None if old_timeout == timeout == default else old_timeout,
                            nodes,
                            per_node,
                            default=default,
                        ),
                        asked=describe_settings(
                            args.gpus, args.backend, args.timeout, args.nodes, args.gpus_per_node
                        ),
                    )
                    if message:
                        raise UsageError(message)
                old = self.burst
                if old is not None and (old.lost or (on_slurm and self.pool is None)):
                    self.release_burst()  # gone, or a Slurm job's that ended with its engines
                    old = None
                cleared = False
                try:
                    kept = old if not on_slurm else None
                    own, burst, launcher = new_gpus(self.terms(), args, on_slurm, kept)
                except UsageError as e:
                    refusal = getattr(e, "refusal", None)
                    need = args.gpus if on_slurm else plan_gpus(server_gpus().pool_gpus, args.gpus).burst
                    if (
                        refusal is None
                        or old is None
                        or not may_retry_after_release(refusal.reason, refusal.fits, old.size, need)
                    ):
                        raise  # nothing was stopped: the pool, its processes and its state stay
                    # only the pool's own burst stands in the way: the pool goes (its user agreed,
                    # or holds nothing), then its GPUs are asked for again
                    self.replace(why, autosave, release=True)
                    cleared = True
                    try:
                        own, burst, launcher = new_gpus(self.terms(), args, on_slurm, None)
                    except UsageError as again:
                        raise UsageError(
                            f"{again} (The pool's engines were stopped and its burst released "
                            "first, to make room for this one.)"
                        ) from None
                if not cleared:
                    try:
                        self.replace(why, autosave, release=burst is not old)
                    except BaseException:
                        if burst is not None and burst is not old:
                            burst.release()  # the save failed: the old pool stays as it was
                        raise
                resized = why is not None and autosave  # saved: the new pool gets it back
                self.burst = burst
                self.own = tuple(own)
            if self.pool is None:
                self._start(args, timeout, on_slurm, launcher, key)
                if resized:
                    self.autosave._restore_after_resize()
            self.busy += 1  # under the lock: the idle timer cannot slip in before the cell runs
            self.touch()
            self.publish()
            return self.pool

    def _start(self, args, timeout: float, on_slurm: bool, launcher, key: tuple) -> None:
        """Start the engines on ``self.own`` and ``self.burst``, the start shown in place."""
        try:
            if on_slurm:
                pool = self._slurm_pool(args, timeout, launcher)
            else:
                slots = [*self.own, *(self.burst.slots if self.burst is not None else ())]
                pool = EnginePool(make_rank_specs(slots, "127.0.0.1", free_port()), args.backend, timeout)
            # a burst's engines report their own GPUs; beside the server's own GPUs
            # (which the server reports) this kernel reports the burst's
            burst = self.burst
            mixed = bool(self.own) and burst is not None
            pool.report_allocation = (
                0 if burst is None or mixed else burst.report_ids() if len(burst.parts) > 1 else burst.id
            )
            if mixed:
                burst.report_here()
            handle = display(_text(f"Starting engines: 0 of {pool.size} up"), raw=True, display_id=True)

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
            atexit.unregister(self.at_exit)
            atexit.register(self.at_exit)
        except KeyboardInterrupt:
            self.release_burst()  # nothing may keep GPUs that no engine uses
            raise DistributedInterrupt(
                "Interrupted while the engines started: they were stopped and any burst GPUs "
                "released. Nothing had run on them; run the cell again to start them."
            ) from None
        except BaseException:
            self.release_burst()  # nothing may keep GPUs that no engine uses
            raise
        update_display(
            _text(
                engines_up(
                    [s.slot.label for s in pool.specs],
                    [s.label for s in self.own],
                    [p.allocation for p in self.burst.parts] if self.burst is not None else [],
                )
            ),
            raw=True,
            display_id=handle.display_id,
        )
        self.pool, self.key = pool, key
        self._arm_idle_timer()

    def shrink_lost(self, outcome) -> None:
        """After a cell that lost ranks (their processes ended): the pool shrinks in place
        without them where it can, the others keeping their processes and variables; the
        cell's outcome then says so (``outcome.shrunk``) instead of starting fresh engines."""
        pool = self.pool
        lost = sorted(r.rank for r in outcome.ranks if r.status in ("died", "killed", "gone"))
        if not getattr(self.settings, "resize_in_place", False) or pool is None or not lost:
            return
        if self.lease_lost():  # the burst ended (its Slurm job too): nothing to go on with
            return
        lost = sorted({*lost, *silent_ranks(pool)})  # a job's end takes its ranks one by one
        if resizing.shrink_problem(pool.specs, lost):  # lost ranks: on other machines too
            return
        outcome.places = {r.rank: place(pool, r.rank) for r in outcome.failed}
        labels = [pool.specs[r].slot.label for r in lost]
        old_size = pool.size
        try:
            shrunk = resize.shrink(pool, lost, planned=False)
        except resize.ShrinkFailed:
            pool.broken = True
            return
        pool.broken = outcome.broken = not shrunk.checked
        hint = f"--gpus {pool.size}"
        regrow = None  # a Slurm pool's way back to its size: a new job
        if self.key is not None:
            (_, nodes, per_node), backend_name, timeout = self.key
            if nodes is not None or per_node is not None:  # a Slurm pool's shape: as it is now
                regrow = f"--gpus {old_size} --nodes {nodes} --restart" if nodes else None
                per = {s.slot.node for s in pool.specs}
                nodes, per_node = len(per), None
                hint += f" --nodes {nodes}"
            self.key = ((pool.size, nodes, per_node), backend_name, timeout)
        restored = self._restore_sharded(pool, shrunk)  # the lost rank's shards: from a checkpoint
        text = resizing.shrink_text(shrunk)
        lines = [*text[:-1], *restored, f"Run the next cells with {hint}."]
        gpus = ", ".join(labels)
        held = (
            f"GPU {gpus} stays held by this session, unused by the pool: a cell with --gpus {old_size} "
            "adds a rank on it again."
        )
        if len(labels) > 1:
            held = (
                f"GPUs {gpus} stay held by this session, unused by the pool: a cell with --gpus "
                f"{old_size} adds ranks on them again."
            )
        if pool._remote or regrow:  # a Slurm pool grows through a new job, not in place
            held = (
                f"{'GPUs' if len(labels) > 1 else 'GPU'} {gpus} {'stay' if len(labels) > 1 else 'stays'} "
                "held by this session's Slurm job, unused by the pool. A Slurm pool does not grow in "
                f"place: a cell with {regrow or f'--gpus {old_size} --restart'} starts a new pool in a "
                "new job (save what you need first: %distributed save NAMES)."
            )
        lines.append(held)
        if any(r.status == "gone" for r in outcome.ranks):
            lines.append(f"This cell did not run: run it again with {hint}.")
        outcome.shrunk = lines

    def _restore_sharded(self, pool, shrunk) -> list[str]:
        """After a lost rank: each FSDP2 model that has a checkpoint (in the autosave directory,
        or the default one) made again on the smaller world and restored from it, with its
        optimizers' checkpoints; the lines that say so (``shrunk``'s refusals then drop them)."""
        from gpu_magics.common.checkpoint import resolve_dir
        from gpu_magics.engine.resize import reshard_empty
        from gpu_magics.kernel.checkpoints import Checkpointer, list_checkpoints

        refused = shrunk.resharded.get("refused", {})
        directory = getattr(self.autosave, "autosave_dir", None) or resolve_dir(None)
        have = set(list_checkpoints(directory))
        names = sorted(n for n in refused if n in have)
        if not names:
            return []
        try:
            made = pool.view.apply_async(reshard_empty, names, shrunk.old_size).get(60)
            models = made[0]["models"]
            if any(m["models"] != models for m in made):
                raise RuntimeError("the ranks made different models again")
            not_made = made[0]["refused"]
            for name, why in not_made.items():
                refused[name] = f"{refused[name]}; not made again for a restore: {why}"
            if not models:
                return []
            wanted = sorted({*models, *(o for opts in models.values() for o in opts if o in have)})
            restored = Checkpointer(pool).restore(wanted, directory)
        except Exception as e:
            return [f"Could not restore {', '.join(names)} from {directory}: {e}"]
        for name in restored.records:
            refused.pop(name, None)
        if not restored.records:
            return []
        return [
            restored.text().replace("gpuhub: restored into", "Restored from the last checkpoint into", 1),
            "What they learned after that checkpoint is lost.",
        ]

    def _grows(self, args, key: tuple, on_slurm: bool) -> bool:
        """Whether this cell grows the pool in place: more GPUs, every other setting the same,
        a sound local pool, and resizing in place on."""
        if not getattr(self.settings, "resize_in_place", False) or on_slurm or self.key is None:
            return False
        (gpus, nodes, per_node), backend_name, timeout = self.key
        (want, want_nodes, want_per_node), want_backend, want_timeout = key
        same = (nodes, per_node, backend_name, timeout) == (
            want_nodes,
            want_per_node,
            want_backend,
            want_timeout,
        )
        return same and want > gpus and self.pool is not None and not self.pool.broken

    def _grow(self, args, key: tuple) -> None:
        """The pool grown in place to ``args.gpus`` ranks (``kernel.resize.grow``): the GPUs it
        lacks asked for first (a refusal changes nothing), then new engines join the old."""
        pool = self.pool
        held_slots = [*self.own, *(self.burst.slots if self.burst is not None else ())]
        used = {spec.slot for spec in pool.specs}
        idle = [slot for slot in held_slots if slot not in used][: args.gpus - pool.size]  # a lost rank's
        plan = plan_gpus(server_gpus().pool_gpus, args.gpus)
        extra_own = [slot for slot in plan.own if slot not in held_slots][: args.gpus - pool.size - len(idle)]
        need = args.gpus - pool.size - len(idle) - len(extra_own)
        added = None
        if need > 0:
            node = self.burst.slots[0].node if self.burst is not None and self.burst.slots else plan.node
            added = request_local_burst(
                self.terms(), need, pool.size, args.gpus, self.burst is None, node, beside="the pool's"
            )
        new_slots = [*idle, *extra_own, *(added.slots if added is not None else ())]
        try:
            grown = resize.grow(pool, new_slots, report_id=added.id if added is not None else 0)
        except resize.GrowFailed as e:
            if added is not None and e.stage == "before":
                added.release()
            if e.stage == "before":
                raise UsageError(
                    f"The pool could not grow in place to {args.gpus} GPUs ({e}); nothing changed. "
                    "Run the cell with --restart for new engines."
                ) from None
            if added is not None:
                self.burst = added if self.burst is None else self.burst.join(added)
            self.own = tuple([*self.own, *extra_own])
            raise UsageError(
                f"The pool could not grow in place ({e}). Run the cell again for new engines."
            ) from None
        if added is not None:
            self.burst = added if self.burst is None else self.burst.join(added)
        self.own = tuple([*self.own, *extra_own])
        self.key = key
        show("\n".join(resizing.grow_text(grown)))

    def _slurm_pool(self, args, timeout: float, launcher) -> EnginePool:
        """Engines as Slurm tasks; a burst job is tagged with the pool's burst."""
        # the engines save the pool's --autosave names at Slurm's SIGTERM (a preemption)
        names = self.autosave.autosave
        launcher.autosave = (list(names), self.autosave.autosave_dir) if names else None
        if launcher.mode == "job":
            burst = self.burst
            launcher.allocation_id = burst.id
            launcher.on_submitted = burst.attach_job
            launcher.borrowed = burst.borrowed  # beyond the limit: the job runs preemptible
            launcher.time_limit_seconds = (burst.parts[0].allocation.get("time_limit") or {}).get("seconds")
        return EnginePool([], args.backend, timeout, launcher=launcher, n=args.gpus)

    # stop -------------------------------------------------------------------------------

    def replace(self, why: str | None, autosave: bool, release: bool) -> None:
        """Stop the current pool (saved first where autosave is on) so that new engines can
        start; ``release``: its burst goes too."""
        if self.pool is not None:
            verbose = self.settings.verbose
            saved = None
            if autosave:
                try:
                    saved = self.autosave._save_before_stop("resize", full=verbose)
                except Exception as e:
                    if why == OTHER_SETTINGS:
                        raise  # the pool still works: nothing is stopped unsaved
                    print(f"gpuhub: could not save before restarting the engines: {e}", file=sys.stderr)
            first = f": {saved.brief()} first" if saved is not None and not verbose else ""
            show(f"gpuhub: restarting the engines ({why}){first}.")
            if saved is None and why is not None and why.startswith(LOST_BURST):
                show(
                    "gpuhub: what the old pool's ranks held is lost with its engines (no autosave kept "
                    "it: %distributed autosave NAMES does); the new pool starts empty."
                )
            self.stop_pool(release=release)
        elif release:
            self.release_burst()

    def publish(self) -> None:
        """Tell JupyterLab's GPU panel what this kernel's pool is now (``common.poolstatus``)."""
        from jupyter_core.paths import jupyter_runtime_dir

        try:
            if self.pool is None:
                poolstatus.withdraw(jupyter_runtime_dir())
                return
            pool = self.pool
            gone = set(pool._gone(list(range(len(pool.infos))))) if pool.infos else set()
            ranks = [
                {
                    "rank": spec.rank,
                    "node": spec.slot.node,
                    "gpu": spec.slot.label,
                    "pid": pool.infos[i]["pid"] if i < len(pool.infos) else None,
                    "state": "gone" if i in gone else ("running a cell" if self.busy else "idle"),
                }
                for i, spec in enumerate(pool.specs)
            ]
            autosave = self.autosave.autosave
            doc = {
                "bursts": [] if self.burst is None else [p.id for p in self.burst.parts],
                "ranks": ranks,
                "autosave": {"names": list(autosave), "dir": self.autosave.autosave_dir}
                if autosave
                else None,
            }
            poolstatus.publish(jupyter_runtime_dir(), doc)
        except Exception:  # the panel's view only: never the cell's problem
            pass

    def release_burst(self) -> None:
        if self.burst is not None:
            self.burst.release()  # says so when the broker could not be told
        self.burst = None

    def stop_pool(self, release: bool = True, why: str | None = None) -> None:
        if self.pool is not None:
            why = self.autosave._save_then_forget(why)  # autosave first; a failed save never keeps them
            self.pool.stop(graceful=why != "exit")
            self.pool = None
            self.key = None
            self.autosave._forget_autosave(why)
            self.publish()
        if release:
            self.release_burst()

    def _arm_idle_timer(self) -> None:
        if self._idle_timer:
            self._idle_timer.cancel()
        # as often as the lease is renewed: a burst the hub reclaimed stops soon after
        s = self.settings
        self._idle_timer = threading.Timer(min(s.idle_seconds, s.lease_seconds / 3, 60), self._check_idle)
        self._idle_timer.daemon = True
        self._idle_timer.start()

    def _check_idle(self) -> None:
        idle_seconds = self.settings.idle_seconds
        with self.lock:
            if self.pool is None:
                return
            if self.preemption.current() is not None:
                pass  # a preemption: its timer saves and stops the pool at its time
            elif self.lease_lost() and not self.busy:
                why = self.burst.reason or "released by the hub"
                print(f"gpuhub: the burst allocation was ended ({why}); stopping the engines.")
                self.stop_pool(why="reclaim")
                return
            if not self.busy and time.monotonic() - self.last_used >= idle_seconds:
                print(f"gpuhub: the engines were idle for {idle_seconds:.0f} s; stopping them.")
                self.stop_pool(why="idle")
                return
        self._arm_idle_timer()

    def at_exit(self) -> None:
        """The kernel's exit hook: the engines' stop and the burst's release, not cut short by
        the kernel manager's SIGTERM (:func:`_hold_sigterm`)."""
        _hold_sigterm()
        self.shutdown()

    def shutdown(self, why: str = "exit") -> None:
        with self.lock:
            if self._idle_timer:
                self._idle_timer.cancel()
            self.stop_pool(why=why)
            self.preemption.release_preempted()
