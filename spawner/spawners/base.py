"""GpuSpawnerMixin: GPUs from the ledger for any JupyterHub spawner.

Lifecycle, whatever the backend:

1. the spawn form shows what is free and what the user may still take;
2. ``start()`` validates ``user_options`` (form or REST alike), admits the request in the
   ledger *before* the backend starts anything, puts the GPUs in the server's environment,
   and gives them back if the backend fails to start;
3. ``stop()``, and ``poll()`` finding the server dead, release the GPUs;
4. the allocation id travels in ``get_state``/``load_state``, so a restarted hub knows it.

A refusal is a ``SpawnException`` with the policy's message and reason: the spawn page
shows it in the form, the REST API answers it as a 4xx.
"""

from __future__ import annotations

import asyncio
import os
import sys

from jupyterhub.spawner import SpawnException
from traitlets import Any, Float, Int, List, Set, default
from traitlets.config import Configurable

from gpu_magics.common import words
from spawner import policy
from spawner.ledger import Ledger
from spawner.policy import timelimits
from spawner.policy.records import AllocationInfo
from spawner.settings import GpuHub
from spawner.spawners import form, pending, readiness, slicing
from spawner.spawners.refusals import install_log_filter, make_refusal
from spawner.spawners.waiting import QueueWaiting

STATE_KEY = "gpuhub_allocation_id"
REPORTER = "gpu_magics.report.reporter"
# kernels on Unix sockets in the user's private runtime directory (gpu_magics.common.channels)
CHANNELS = "gpu_magics.common.channels"
KERNEL_ARGS = ("--KernelManager.transport=ipc", f"--ServerApp.jpserver_extensions={CHANNELS}=True")


def make_gpu_env(allocation: AllocationInfo | None) -> dict[str, str]:
    """The variables a GPU server gets: its GPUs, in PCI bus order, and its allocation."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    if allocation is None:
        # no GPUs asked for: hide every GPU rather than expose them all
        env.update(CUDA_VISIBLE_DEVICES="", GPUHUB_GPUS="", GPUHUB_ALLOCATION_ID="")
        return env
    env.update(
        CUDA_VISIBLE_DEVICES=allocation.cuda_visible_devices,
        GPUHUB_ALLOCATION_ID=str(allocation.id),
        GPUHUB_GPUS=",".join(g.label for g in allocation.gpus),
        GPUHUB_NODE=",".join(allocation.nodes),
        GPUHUB_GPU_MODEL=",".join(sorted({g.model for g in allocation.gpus})),
    )
    return env


def _options_read_in_start(spawner, user_options) -> None:
    """The default ``apply_user_options``: nothing to do before ``start()``."""


class GpuSpawnerMixin(QueueWaiting, Configurable):
    """Mix in before a JupyterHub spawner class: ``class S(GpuSpawnerMixin, LocalProcessSpawner)``."""

    backend_name = "local"

    default_gpus = Int(
        1,
        help="""GPUs a server gets when the request names none (a REST call without
        ``user_options``). The form starts at this value, capped at what the user may take.
        ``c.Spawner.default_gpus = 0``
        """,
    ).tag(config=True)

    allocation_id = Int(0, help="The ledger allocation of the running server (0: none).")
    queue_entry_id = Int(0, help="The queue entry this server's start waits in (0: none).")
    _gpuhub_stopped = False
    _gpuhub_asked: int | None = None  # the count of a start just refused (the form shows it again)
    gpu_allocation = Any(None, allow_none=True, help="The running server's AllocationInfo.")
    gpu_options = Any(None, allow_none=True, help="This start's checked user_options (form.GpuOptions).")
    slice_asked: tuple[str, int] | None = None  # this start's slice: (model, parts), or None
    _gpuhub_events = List()
    _gpuhub_listeners = Set()

    ready_poll_seconds = Float(
        0.05,
        help="""Seconds between gpuhub's checks that a started server answers, before the
        server is handed to JupyterHub (whose own wait backs off exponentially, up to 5 s
        between tries, and then succeeds at once). Bounded by ``c.Spawner.http_timeout``;
        0 leaves the wait to JupyterHub alone. ``c.Spawner.ready_poll_seconds = 0.05``
        """,
    ).tag(config=True)

    server_start_timeout = Float(
        0.0,
        help="""Internal: the admin's ``c.Spawner.start_timeout``, applied by gpuhub to the
        server's own start after any wait in the queue. Set ``start_timeout`` instead.""",
    )

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        install_log_filter(self.log)
        # the spawn-pending page that says a start waits in the queue, with its place
        pending.install_templates(getattr(getattr(self, "user", None), "settings", None))
        # JupyterHub gives start() start_timeout seconds from the click. A start that waits
        # in a queue (gpuhub's, or the backend scheduler's: Slurm) may wait up to
        # c.GpuHub.queue_max_wait_hours before the server starts: JupyterHub's timer gets that
        # much more, and the admin's start_timeout is applied to the server's own start
        # (_backend_start), so a queued spawn is never timed out behind the queue's back.
        self.server_start_timeout = float(self.start_timeout)
        self.start_timeout = int(self.start_timeout + self.gpuhub.queue_max_wait_hours * 3600 + 60)
        if self.ready_poll_seconds > 0:
            # start() also waits for the server to answer (http_timeout), which JupyterHub
            # would otherwise do after start(): its timer on start() gets that much more
            self.start_timeout = int(self.start_timeout + self.http_timeout)

    @default("cmd")
    def _default_cmd(self):
        # jupyterhub-singleuser without its import tax (spawner.singleuser), from the hub's
        # environment when it is there, else from the server's PATH
        found = os.path.join(os.path.dirname(sys.executable), "gpuhub-singleuser")
        return [found if os.path.exists(found) else "gpuhub-singleuser"]

    @default("options_form")
    def _default_options_form(self):
        return self._render_gpu_form

    @default("options_from_form")
    def _default_options_from_form(self):
        return form.options_from_form

    @default("apply_user_options")
    def _default_apply_user_options(self):
        # gpuhub reads user_options in start(), where a refusal becomes a clean
        # SpawnException; JupyterHub's hook would log a traceback for each bad input
        # (and, left unset, warns that the options are unhandled).
        return _options_read_in_start

    # ledger access --------------------------------------------------------------------

    @property
    def gpuhub(self) -> GpuHub:
        return GpuHub(parent=self)

    @property
    def ledger(self) -> Ledger:
        return self.gpuhub.open_ledger()

    def _groups(self) -> list[str]:
        return [g.name for g in getattr(self.user, "groups", [])]

    def _progress(self, progress: int, message: str, heading: str | None = None, **queue) -> None:
        """One progress event for the spawn page. ``heading`` (and the queue's ``position``
        and ``waiting``) go in a ``gpuhub`` field, which gpuhub's spawn-pending template
        shows as the page's heading (:mod:`.pending`); JupyterHub passes it through."""
        event = {"progress": progress, "message": message}
        if heading is not None:
            event["gpuhub"] = {"heading": heading, **queue}
        self._gpuhub_events.append(event)
        for changed in self._gpuhub_listeners:
            changed.set()

    async def progress(self):
        # each reader (the spawn page, a second tab, the REST progress API) waits on its own
        changed = asyncio.Event()
        self._gpuhub_listeners.add(changed)
        sent = 0
        try:
            while True:
                changed.clear()
                while sent < len(self._gpuhub_events):
                    yield self._gpuhub_events[sent]
                    sent += 1
                if not self._spawn_pending:
                    return
                try:
                    await asyncio.wait_for(changed.wait(), timeout=1)
                except TimeoutError:
                    pass
        finally:
            self._gpuhub_listeners.discard(changed)

    async def _in_ledger(self, method: str, *args, **kw):
        """Call a Ledger method in a worker thread: opening the ledger (schema check,
        inventory, reconcile) and waiting for its lock must never block the hub's loop."""
        return await asyncio.to_thread(lambda: getattr(self.ledger, method)(*args, **kw))

    def placement_nodes(self) -> set[str] | None:
        """Nodes a server of this backend may get GPUs on (None: anywhere)."""
        return None

    def parse_options(self) -> form.GpuOptions:
        """``user_options`` checked (raises ``policy.Refusal``); backends may accept more."""
        return form.parse_gpu_options(self.user_options, default_gpus=self.default_gpus)

    def admission(self, opts: form.GpuOptions) -> dict:
        """Extra ``Ledger.allocate`` arguments of this backend (blocking; runs in a thread)."""
        return {"on_nodes": self.placement_nodes()}

    def gpu_env(self, allocation: AllocationInfo | None) -> dict[str, str]:
        mps = self.gpuhub.inventory == "nvml"  # a slice of a real GPU: held to its share by MPS
        return {**make_gpu_env(allocation), **slicing.slice_env(allocation, mps), **self.gpuhub.report_env()}

    def get_args(self):
        # the server reports its GPUs' use and its kernels' activity (gpu_magics.report.reporter); its
        # kernels listen on Unix sockets only their owner can reach, no TCP port (channels)
        return [*super().get_args(), f"--ServerApp.jpserver_extensions={REPORTER}=True", *KERNEL_ARGS]

    async def mark_started(self, allocation: AllocationInfo) -> AllocationInfo:
        """Record in the ledger that the backend started the server."""
        return await self._in_ledger("mark_running", allocation.id, self.backend_job_id())

    async def _render_gpu_form(self, _spawner=None) -> str:
        groups, name = self._groups(), self.user.name  # the hub's ORM: on its loop, not in the thread
        allowance, models, room = await asyncio.to_thread(
            lambda: (
                self.ledger.allowance(name, groups),
                self.ledger.models(),
                self.ledger.slice_room(),
            )
        )
        return form.render_form(
            allowance,
            models,
            self.default_gpus,
            grace_seconds=self.gpuhub.preempt_grace_seconds,
            asked=self.refused_count(),
            longest=self.longest_session(groups),
            slices=form.SliceChoice(room, self.gpuhub.slices_only(groups)) if room else None,
        )

    def longest_session(self, groups: list[str] | None = None) -> tuple[float | None, str]:
        """This user's longest session in hours (None: no limit) and where that comes from."""
        groups = self._groups() if groups is None else groups
        return timelimits.max_hours(self.user.name, groups, self.ledger.time_rules)

    def refused_count(self) -> int | None:
        """The GPU count of the start just refused, once: the form shown again with the
        refusal keeps the user's value in its field (None: none refused, or not a count)."""
        asked, self._gpuhub_asked = self._gpuhub_asked, None
        return asked

    def _remember_refused_count(self) -> None:
        try:
            raw = (self.user_options or {}).get("gpus")
            self._gpuhub_asked = None if raw is None else form.parse_count(raw)
        except policy.Refusal:
            self._gpuhub_asked = None

    # lifecycle ------------------------------------------------------------------------

    def backend_job_id(self) -> str | None:
        """The backend's handle on the server once started (a pid, a Slurm job id)."""
        return None

    async def server_alive(self) -> bool:
        """Whether the started server may still answer (backends: its process, its job)."""
        return True

    def end_server_now(self) -> None:
        """End the server at once, without waiting (backends: SIGKILL its process): a stop
        cut short gives its GPUs back, so the server must not outlive it."""

    async def _wait_answering(self, started) -> None:
        """Return once the started server answers (see :mod:`.readiness`); a server that is
        gone, or silent for ``http_timeout``, fails the start (its GPUs are released)."""
        if self.ready_poll_seconds <= 0 or self.server is None:
            return
        from jupyterhub.httpclient import fetch
        from jupyterhub.utils import make_ssl_context

        settings = getattr(self.user, "settings", None) or {}
        ssl_context = make_ssl_context(
            settings.get("internal_ssl_key"),
            settings.get("internal_ssl_cert"),
            cafile=settings.get("internal_ssl_ca"),
        )
        url = readiness.probe_url(started, "https" if self.internal_ssl else "http", self.server.base_url)
        outcome = await readiness.wait_answering(
            url, self.http_timeout, self.ready_poll_seconds, self.server_alive, fetch, ssl_context
        )
        if outcome == readiness.GONE:
            raise make_refusal(
                "Your server stopped before it answered; its GPUs are released. Try again, or ask an "
                "admin to look at the server's log.",
                "server_gone",
                500,
            )
        if outcome == readiness.TIMEOUT:
            raise make_refusal(
                f"Your server did not answer within {self.http_timeout} s of starting "
                "(c.Spawner.http_timeout); its GPUs are released. Try again, or ask an admin.",
                "server_silent",
                500,
            )

    def get_env(self):
        env = super().get_env()
        env.update(self.gpu_env(self.gpu_allocation))
        return env

    def _forget_stored_options(self) -> None:
        """JupyterHub keeps every start's ``user_options`` as the next start's when that one
        names none, even options that were refused. gpuhub promises ``default_gpus`` to a
        start without options: the options stay on this start (``self.user_options``) and
        are not stored for the next one."""
        orm = getattr(self, "orm_spawner", None)
        db = getattr(getattr(self, "user", None), "db", None)
        if orm is None or db is None or not orm.user_options:
            return
        orm.user_options = {}
        db.commit()

    def waits_in_gpuhub_queue(self) -> bool:
        """Whether this backend's requests wait in gpuhub's queue (local) rather than in
        the backend's own scheduler (Slurm: ``admission`` asks for ``deferred``)."""
        return self.backend_name == "local"

    async def _admit(self) -> AllocationInfo | None:
        self._forget_stored_options()
        self.slice_asked = None  # this start's own (the spawner outlives its starts)
        try:
            opts = self.gpu_options = await asyncio.to_thread(self.parse_options)  # may ask the scheduler
            if opts.count == 0:
                return None
            extra = await asyncio.to_thread(self.admission, opts)
            queued = not extra.get("deferred") and self.waits_in_gpuhub_queue()
            args = (self.user.name, self._groups(), opts.count)
            kw = dict(
                purpose="server",
                server_name=self.name,
                model=opts.model,
                backend=self.backend_name,
                hours=opts.hours,
                **extra,
            )
            if opts.share is not None:  # a slice: no thread hop for whole GPUs
                kw |= await asyncio.to_thread(
                    lambda: slicing.slice_request(opts.share, opts.model, self.ledger.slice_offers)
                )
                self.slice_asked = (kw["model"], kw["slice_parts"])
            request = asyncio.ensure_future(
                self._in_ledger("request", *args, **kw)
                if queued
                else self._in_ledger("allocate", *args, **kw)
            )
            try:
                got = await asyncio.shield(request)
            except asyncio.CancelledError:
                # the spawn was cancelled (stop, start_timeout) while the ledger worked:
                # the worker may still commit; what it took is given back after the start ends
                self._give_back_later("spawn cancelled", request)
                raise
            if not queued:
                return got
            if got.allocation is not None:
                return got.allocation
            return await self._wait_in_queue(got.entry)
        except policy.Refusal as e:
            self._remember_refused_count()
            install_log_filter(self.log)  # before JupyterHub logs this refusal
            raise make_refusal(e.message, e.reason, e.status_code) from None

    async def start(self):
        self._gpuhub_events = []
        self._gpuhub_stopped = False
        self._gpuhub_asked = None  # set again if this start is refused
        await self._settle_cancelled()  # a cancelled start before this one gave back what it got
        if self.allocation_id:  # left over from a start that never reached stop()
            await self._release(self.allocation_id, "replaced by a new start")
        self._progress(5, "Checking your GPU allowance")
        allocation = await self._admit()
        self.gpu_allocation = allocation
        self.allocation_id = allocation.id if allocation else 0
        # past a wait in the queue the bar stands beyond the queue's part (waitline.QUEUE_PROGRESS)
        at = 55 if self._gpuhub_events and self._gpuhub_events[-1]["progress"] > 20 else 20
        if allocation and allocation.slice_parts and allocation.gpus:
            [g] = allocation.gpus
            self._progress(at, f"Allocated 1/{g.parts} of GPU {g.whole.label}: {g.label}")
        elif allocation and allocation.gpus:
            gpus = ", ".join(g.label for g in allocation.gpus)
            self._progress(at, f"Allocated {words.count(len(allocation.gpus), 'GPU')}: {gpus}")
        elif allocation:
            self._progress(at, f"Admitted {words.count(allocation.gpu_count, 'GPU')} within your limit")
        else:
            self._progress(at, "Starting without GPUs")
        try:
            # JupyterHub's own timer counts the queue's wait too (see __init__); the admin's
            # start_timeout is for the server's start, so it is applied here, after the wait
            url = await self._backend_start()
            if allocation:
                self.gpu_allocation = await self.mark_started(allocation)
            self._progress(60, "Server process started; waiting for it to answer")
            await self._wait_answering(url)
        except asyncio.CancelledError:
            # stopped while it started (JupyterHub's stop() follows), or the hub shutting down
            # (nothing follows): the server must not outlive the GPUs given back, after the
            # start has ended (JupyterHub answers 500 if the start is not over in 1 s)
            self.end_server_now()
            if allocation:
                self.allocation_id, self.gpu_allocation = 0, None
                self._give_back_later("server stopped while it started", allocation=allocation)
            raise
        except BaseException:
            if allocation:
                await self._release(allocation.id, "server failed to start")
            raise
        return url

    async def _backend_start(self) -> str:
        """The backend's own start of the server, held to the admin's ``start_timeout``."""
        try:
            return await asyncio.wait_for(super().start(), self.server_start_timeout)
        except TimeoutError:
            raise self.start_timeout_error() from None

    def start_timeout_error(self) -> SpawnException:
        return make_refusal(
            f"The server did not start within {self.server_start_timeout:g} s of getting its "
            "GPUs (c.Spawner.start_timeout); its GPUs are released. Try again, or ask an "
            "admin to look at the hub's log.",
            "start_timeout",
            500,
        )

    async def _release(self, allocation_id: int, reason: str) -> None:
        if allocation_id:
            await self._in_ledger("release", allocation_id, reason)
        if self.allocation_id == allocation_id:
            self.allocation_id = 0
            self.gpu_allocation = None

    async def _release_server(self, allocation_id: int, reason: str) -> None:
        """The server stopped or died: its GPUs back, with every burst its kernels held and
        their places in the queue (whoever stopped it: home page, REST, culler, reclaim,
        preemption, hub shutdown), within seconds rather than a lease."""
        released = await self._in_ledger("release_server", self.user.name, self.name, allocation_id, reason)
        bursts = [i for i in released if i != allocation_id]
        if bursts:
            self.log.info("Server %s: released its kernels' bursts %s (%s)", self._log_name, bursts, reason)
        if self.allocation_id == allocation_id:
            self.allocation_id = 0
            self.gpu_allocation = None

    async def stop(self, now=False):
        allocation_id = self.allocation_id
        self._gpuhub_stopped = True
        try:
            if self.waits_in_gpuhub_queue():  # a start still waiting in the queue leaves it
                # (by server, not by entry id: a cancelled start may have dropped its id already)
                await self._in_ledger(
                    "leave_queue_of", self.user.name, self.name, "the server was stopped while it waited"
                )
            await super().stop(now=now)
        except asyncio.CancelledError:
            # cut short: the hub shutting down cancels what still runs. Its GPUs are given
            # back below, so a server still running would keep them in use unseen
            self.end_server_now()
            raise
        finally:
            await self._release_server(allocation_id, "server stopped")

    async def poll(self):
        allocation_id = self.allocation_id  # super().poll() may clear the state
        status = await super().poll()
        if status is not None and (allocation_id or not self._gpuhub_stopped):
            if self._stop_pending:
                reason = "server stopped"
            else:
                reason = "server exited"
                self.log.info("Server %s is gone; releasing its GPUs", self._log_name)
            await self._release_server(allocation_id, reason)
        return status

    def get_state(self):
        state = super().get_state()
        if self.allocation_id:
            state[STATE_KEY] = self.allocation_id
        return state

    def load_state(self, state):
        # only the id: a running server already has its environment, and this runs on the
        # hub's event loop, where the ledger must not be touched
        super().load_state(state)
        self.allocation_id = int(state.get(STATE_KEY) or 0)

    def clear_state(self):
        # stop() and poll() read the id before the backend clears its state
        super().clear_state()
        self.allocation_id = 0
        self.gpu_allocation = None
