"""One watcher per hub process for every gpuhub job in Slurm.

Each cycle reads the ledger's live Slurm allocations, then asks Slurm about every gpuhub
job in one ``squeue --json`` call (filtered to gpuhub's job names here: Slurm 22.05 ignores
filters with ``--json``), then acts:

- a job that started gets the GPUs Slurm gave it written to the ledger (its ``gres_detail``:
  never assumed, never read from text a job's comment could imitate);
- a job that ended, or that Slurm no longer lists, has its allocation released;
- a job whose allocation was already released (a burst's lease ran out, a stop whose
  ``scancel`` failed) is cancelled, so nothing gpuhub started is orphaned. Before any
  ``scancel`` the job is read again and must still be the allocation's user's, with one of
  gpuhub's names and that allocation's tag; it is cancelled as its owner (the spawner's
  ``exec_prefix``, ``sudo -E -u OWNER``), so Slurm itself refuses anyone else's job.

A job gpuhub cannot read (a field missing or odd, an id listed twice, or in the text
fallback of a Slurm without ``--json``, a name or comment holding a newline) is logged and
skipped: its last known state stands and nothing is decided about it; the others' cycle
goes on.

The ledger is read *before* ``squeue`` runs: a job id in that read was submitted before
the query began, so a job missing from a successful answer has really left Slurm.

Polling backs off (``min_interval`` doubling to ``max_interval``) while nothing changes,
and returns to ``min_interval`` when a job changes or a spawner is waiting; a job submitted
moments ago that has not started yet is asked about sooner, at a tenth of its age (from
``start_interval``), so a spawn sees its job start within about a tenth of the wait (see
:func:`next_interval`). A failed query
keeps the last known state and is only logged: a scheduler hiccup never declares a
server dead. Spawners read the cache (:meth:`SlurmWatcher.job`) instead of running their
own ``squeue``. The decisions themselves are pure, in :mod:`spawner.slurm.reconcile`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import shlex
import time

from traitlets import Float, List, Unicode, default
from traitlets.config import LoggingConfigurable

from spawner.policy.records import AllocationInfo, GpuConflict
from spawner.slurm import SlurmError, commands, squeue
from spawner.slurm.reconcile import Action, next_interval, orphans, reconcile

JOB_NAMES = ("gpuhub-server", "gpuhub-engines")


def _name(argv: list[str]) -> str:
    """The Slurm command in ``argv``, past a ``sudo -E -u USER`` prefix."""
    for part in argv:
        if part.startswith(("sbatch", "squeue", "scancel", "scontrol", "srun", "sinfo", "sacctmgr")):
            return part
    return argv[0]


async def run_command(argv: list[str], timeout: float, input: str | None = None, env=None) -> str:
    """Run ``argv`` (no shell); its stdout, or :class:`SlurmError` with its stderr."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as e:
        raise SlurmError(f"cannot run {argv[0]}: {e}") from None
    try:
        out, err = await asyncio.wait_for(
            proc.communicate(input.encode() if input is not None else None), timeout
        )
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SlurmError(f"{_name(argv)} took longer than {timeout:g} s") from None
    except asyncio.CancelledError:
        proc.kill()
        raise
    if proc.returncode != 0:
        raise SlurmError(
            f"{_name(argv)} failed (exit {proc.returncode}): {err.decode(errors='replace').strip()[-500:]}"
        )
    return out.decode(errors="replace")


class SlurmWatcher(LoggingConfigurable):
    """The hub's single view of gpuhub's Slurm jobs: ``c.SlurmWatcher.*``."""

    min_interval = Float(
        1.0,
        help="""Seconds between ``squeue`` calls while jobs change or a spawn waits.
        ``c.SlurmWatcher.min_interval = 1.0``""",
    ).tag(config=True)

    start_interval = Float(
        0.1,
        help="""Shortest pause between ``squeue`` calls while a job gpuhub just submitted has not
        started: the pause is a tenth of the job's age, from this up to ``min_interval``.
        ``c.SlurmWatcher.start_interval = 0.1``""",
    ).tag(config=True)

    max_interval = Float(
        10.0,
        help="""Longest pause between ``squeue`` calls once nothing changes (the interval doubles
        from ``min_interval`` up to this). A job cancelled outside gpuhub frees its GPUs in the
        ledger within this time. ``c.SlurmWatcher.max_interval = 10.0``""",
    ).tag(config=True)

    command_timeout = Float(
        20.0,
        help="""Seconds a Slurm command may take before it counts as failed (the last known
        state is kept). ``c.SlurmWatcher.command_timeout = 20.0``""",
    ).tag(config=True)

    job_names = List(
        Unicode(),
        default_value=list(JOB_NAMES),
        help="""Slurm job names gpuhub gives its jobs (servers, engines); ``squeue`` is asked for
        these only. ``c.SlurmWatcher.job_names = ["gpuhub-server", "gpuhub-engines"]``""",
    ).tag(config=True)

    exec_prefix = Unicode(
        help="""How the watcher runs ``scancel`` as a job's owner (``{username}``: the owner), so
        that Slurm refuses any job not theirs. Default: the spawner's ``exec_prefix``
        (``c.GpuSlurmSpawner.exec_prefix``, batchspawner's ``sudo -E -u {username}``); ``""``
        runs ``scancel`` as the hub's own user (still with ``--user`` and ``--name`` filters).
        ``c.SlurmWatcher.exec_prefix = "sudo -E -u {username}"``""",
    ).tag(config=True)

    @default("exec_prefix")
    def _default_exec_prefix(self):
        return spawner_exec_prefix(self.config)

    def __init__(self, ledger_factory, resync=None, **kw):
        super().__init__(**kw)
        self._ledger_factory = ledger_factory
        self._resync = resync  # re-reads the inventory when Slurm names a GPU the ledger lacks
        self.jobs: dict[str, squeue.JobInfo] = {}
        self.positions: dict[str, tuple[int, int, str]] = {}  # pending gpuhub jobs in their queues
        self.last_ok = 0.0  # monotonic start of the last successful query
        self.failures = 0
        self.cycles = 0  # cycles finished (successful or not): tests wait on this
        self.last_cycle_ok = False
        self.unreadable: frozenset[str] = frozenset()  # jobs of the last answer that were skipped
        self.cancelled: collections.deque = collections.deque(maxlen=100)  # job ids scancel ran for
        # (job id, why it was not cancelled), once each
        self.refused: collections.deque = collections.deque(maxlen=100)
        self._json: bool | None = None  # squeue --json works (None: not tried yet)
        self._problems: tuple[str, ...] = ()
        self._tracked: dict[str, float] = {}
        self._wake = asyncio.Event()
        self._updated = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._waiters = 0

    # what spawners use ------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._loop())

    def track(self, job_id: str) -> None:
        """A job a spawner cares about (just submitted, or loaded after a restart): a new one
        wakes the loop at once; one already tracked waits for the next cycle."""
        self.start()
        if str(job_id) not in self._tracked:
            self._tracked[str(job_id)] = time.monotonic()
            self._wake.set()

    def nudge(self) -> None:
        """Look again now (after a cancel)."""
        self.start()
        self._wake.set()

    def job(self, job_id: str) -> tuple[str, squeue.JobInfo | None]:
        """``("known", info)``, ``("gone", None)`` when a query that began after the job was
        tracked did not list it, or ``("unknown", None)`` while Slurm has not answered since."""
        job_id = str(job_id)
        info = self.jobs.get(job_id)
        if info is not None:
            return "known", info
        tracked = self._tracked.get(job_id)
        if tracked is not None and self.last_ok > tracked:
            return "gone", None
        return "unknown", None

    async def next_update(self, timeout: float) -> None:
        """Wait for the next query to finish (successful or not), nudging the loop."""
        self._waiters += 1
        try:
            self._updated.clear()
            self._wake.set()
            self.start()
            try:
                await asyncio.wait_for(self._updated.wait(), timeout)
            except TimeoutError:
                pass
        finally:
            self._waiters -= 1

    # the loop -----------------------------------------------------------------------------

    async def _loop(self) -> None:
        interval = self.min_interval
        while True:
            ok = False
            try:
                changed = await self.cycle()
                ok = self.failures == 0
            except Exception:
                self.log.exception("gpuhub Slurm watcher: cycle failed")
                changed = False
            self.last_cycle_ok = ok
            self.cycles += 1
            self._updated.set()
            interval = next_interval(
                interval, changed, bool(self._waiters), self._starting_ages(),
                self.min_interval, self.max_interval, self.start_interval,
            )  # fmt: skip
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                pass

    def _starting_ages(self) -> list[float]:
        """Seconds since each tracked job that has not started (pending, or not listed yet)
        was first tracked, for the jobs of the last minute (older ones poll as usual)."""
        now = time.monotonic()
        return [
            now - since
            for job_id, since in self._tracked.items()
            if now - since < 60 and (self.jobs.get(job_id) is None or self.jobs[job_id].pending)
        ]

    async def cycle(self) -> bool:
        """One round: ledger, ``squeue``, actions. True when something changed."""
        ledger = await asyncio.to_thread(self._ledger_factory)
        live = await asyncio.to_thread(lambda: [a for a in ledger.active(backend="slurm")])
        started = time.monotonic()
        try:
            listing = await self.read_jobs()
        except SlurmError as e:
            self.failures += 1
            self.log.warning("gpuhub Slurm watcher: squeue failed (%s); keeping the last known state", e)
            return False
        if self.failures:
            self.log.info("gpuhub Slurm watcher: squeue answers again after %d failure(s)", self.failures)
        self.failures = 0
        self._log_problems(listing)
        listed, unreadable = listing.jobs, listing.unreadable
        # a skipped job keeps its last known state, for spawners and for the ledger alike
        known = {**{j: self.jobs[j] for j in unreadable if j in self.jobs}, **listed}
        changed = known != self.jobs
        self.jobs, self.unreadable, self.last_ok = known, unreadable, started
        # each waiting gpuhub job's place among everyone's jobs waiting for its partition, by
        # Slurm's priority: from this same answer (squeue --json lists the whole cluster);
        # the text fallback carries no queue, so no position is shown there
        self.positions = squeue.queue_positions(
            listing.queue, [j for j, info in listed.items() if info.pending]
        )
        now = ledger.clock()
        live = [a for a in live if a.backend_job_id is None or a.backend_job_id not in unreadable]
        actions = reconcile(live, listed, now)
        live_ids, live_jobs = {a.id for a in live}, {a.backend_job_id for a in live}
        others = await asyncio.to_thread(
            self._others, ledger, [j for j, info in listed.items() if j not in live_jobs and not info.ended],
            {j.allocation_id for j in listed.values() if j.allocation_id} - live_ids,
        )  # fmt: skip
        actions += orphans(live, others, listed, now)
        for action in actions:
            changed = True
            try:
                await self._act(ledger, action)
            except Exception as e:
                self.log.warning(
                    "gpuhub Slurm watcher: %s of allocation %s failed: %s",
                    action.kind,
                    action.allocation.id,
                    e,
                )
        return changed

    async def read_jobs(self) -> squeue.Listing:
        """gpuhub's jobs as Slurm lists them now: ``squeue --json``, or, only where this
        squeue has no JSON (found out once), the text form with a token of its own."""
        if self._json is not False:
            try:
                out = await run_command(commands.squeue_json_argv(), self.command_timeout)
            except SlurmError as e:
                if self._json is not None or not squeue.json_unsupported(str(e)):
                    raise
                self._json = False
                self.log.warning(
                    "gpuhub Slurm watcher: this squeue has no --json (%s); reading its text form, "
                    "where a job whose name or comment holds a newline is skipped",
                    e,
                )
            else:
                self._json = True
                return squeue.parse_squeue_json(out, self.job_names)
        fmt = squeue.TextFormat.new()
        out = await run_command(
            commands.squeue_text_argv(self.job_names),
            self.command_timeout,
            env=commands.squeue_text_env(fmt, dict(os.environ)),
        )
        return squeue.parse_squeue_text(out, fmt, self.job_names)

    def _log_problems(self, listing: squeue.Listing) -> None:
        """Each skipped job once while it stays the same (not at every cycle)."""
        if listing.problems != self._problems:
            for problem in listing.problems:
                if problem not in self._problems:
                    self.log.warning("gpuhub Slurm watcher: %s", problem)
        self._problems = listing.problems

    def live_job_ids(self, listing: squeue.Listing | None = None) -> list[str]:
        """gpuhub's jobs that still run or wait, as the last (or the given) listing shows them;
        a job it could not read counts as live."""
        jobs = self.jobs if listing is None else listing.jobs
        unreadable = self.unreadable if listing is None else listing.unreadable
        return sorted({j for j, info in jobs.items() if not info.ended} | set(unreadable))

    def cancel_prefix(self, user: str) -> list[str]:
        return [part.format(username=user) for part in shlex.split(self.exec_prefix)]

    async def cancel(self, allocation: AllocationInfo, job_id: str, reason: str) -> bool:
        """``scancel`` job ``job_id`` of ``allocation``, after reading it again: only when it is
        still the allocation user's gpuhub job with that allocation's tag (else nothing is
        cancelled and the log says why), and as that user. True when scancel ran."""
        job_id = str(job_id)
        try:
            listing = await self.read_jobs()
        except SlurmError as e:
            why = f"Slurm could not be asked again ({e})"
        else:
            why = commands.cancel_refusal(listing, job_id, allocation.user, allocation.id, self.job_names)
        if why is not None:
            once = (job_id, why) not in self.refused  # a warning once, then at each cycle in debug
            if once:
                self.refused.append((job_id, why))
            self.log.log(
                logging.WARNING if once else logging.DEBUG,
                "gpuhub: not cancelling Slurm job %s (allocation %s of %s: %s): %s",
                job_id, allocation.id, allocation.user, reason, why,
            )  # fmt: skip
            return False
        job = listing.jobs[job_id]
        self.log.info("gpuhub: cancelling Slurm job %s of %s: %s", job_id, job.user, reason)
        self.cancelled.append(job_id)
        await run_command(commands.scancel_argv(self.cancel_prefix(job.user), job), self.command_timeout)
        return True

    @staticmethod
    def _others(ledger, job_ids, allocation_ids) -> list[AllocationInfo]:
        found = {a.id: a for a in ledger.released_with_jobs("slurm", job_ids)}
        for i in allocation_ids:
            a = ledger.get(i)
            if a is not None:
                found[a.id] = a
        return list(found.values())

    async def _act(self, ledger, action: Action) -> None:
        a = action.allocation
        if action.kind == "release":
            if await asyncio.to_thread(ledger.release, a.id, action.reason):
                self.log.info("gpuhub: released allocation %s of %s: %s", a.id, a.user, action.reason)
        elif action.kind == "record":
            if self._json:  # this cycle's listing has the job's gres_detail already
                gpus = list(self.jobs[action.job_id].gpus)
            else:
                out = await run_command(commands.job_detail_argv(action.job_id), self.command_timeout)
                gpus = squeue.parse_job_gpus_json(out, action.job_id)
            if len(gpus) > a.gpu_count:  # more than was admitted: over the user's limit
                reason = f"Slurm job {action.job_id} holds {len(gpus)} GPUs, {a.gpu_count} were admitted"
                if await self.cancel(a, action.job_id, reason):
                    await asyncio.to_thread(ledger.release, a.id, reason)
                return
            if len(gpus) < a.gpu_count:
                raise SlurmError(f"job {action.job_id} shows {len(gpus)} GPUs, {a.gpu_count} asked for")
            live = self.live_job_ids()
            try:
                try:
                    info, released = await asyncio.to_thread(
                        ledger.record_gpus, a.id, gpus, action.job_id, live
                    )
                except LookupError:
                    if self._resync is None:
                        raise
                    await asyncio.to_thread(self._resync)
                    info, released = await asyncio.to_thread(
                        ledger.record_gpus, a.id, gpus, action.job_id, live
                    )
            except GpuConflict as e:  # Slurm gave one GPU twice: the job that got it last goes
                reason = conflict_reason(e, answered=a.state == "running")
                # the reason is written before the job ends, so its spawner tells its user that
                # reason; a job that is not cancelled now is its released allocation's orphan,
                # cancelled at the next cycle
                await asyncio.to_thread(ledger.release, a.id, reason)
                await self.cancel(a, action.job_id, reason)
                return
            self.log.info(
                "gpuhub: Slurm job %s of %s holds %s",
                action.job_id,
                a.user,
                ", ".join(g.label for g in info.gpus),
            )
            for other in released:
                self.log.info(
                    "gpuhub: released allocation %s: Slurm gave its GPUs to job %s", other, action.job_id
                )
        elif action.kind == "attach":
            await asyncio.to_thread(ledger.attach_job, a.id, action.job_id)
            self.log.info(
                "gpuhub: allocation %s of %s runs as Slurm job %s (%s)",
                a.id,
                a.user,
                action.job_id,
                action.reason,
            )
        elif action.kind == "cancel":
            await self.cancel(a, action.job_id, action.reason)


GAVE_TWICE = "Slurm gave this job a GPU that another job still holds"


def conflict_reason(e: Exception, answered: bool = False) -> str:
    """What a user is told when Slurm gave their job a GPU another live job still holds (kept
    within the ledger's 255 characters of a reason). ``answered``: the server had started (its
    allocation was running), so what it held in memory is lost with the job."""
    what = (
        "Your server was stopped with it: what its kernels held in memory is lost."
        if answered
        else "It was ended before your server answered: no work ran there."
    )
    tail = f"; a Slurm fault, docs/known-issues.md). {what} Start again."
    head = f"{GAVE_TWICE} ("
    return head + str(e)[: 255 - len(head) - len(tail)] + tail


BATCHSPAWNER_EXEC_PREFIX = "sudo -E -u {username}"


def spawner_exec_prefix(config) -> str:
    """The ``exec_prefix`` the Slurm spawner submits jobs with, from the hub's config (the
    most specific section first), else batchspawner's default."""
    for section in ("GpuSlurmSpawner", "SlurmSpawner", "BatchSpawnerBase"):
        if section in config and "exec_prefix" in config[section]:
            return str(config[section]["exec_prefix"])
    return BATCHSPAWNER_EXEC_PREFIX


_WATCHERS: dict[tuple[int, str], SlurmWatcher] = {}


def get_watcher(config, ledger_factory, key: str, resync=None, log=None) -> SlurmWatcher:
    """The watcher of this event loop for one ledger (one per hub process)."""
    loop_key = (id(asyncio.get_running_loop()), key)
    watcher = _WATCHERS.get(loop_key)
    if watcher is None:
        kw = {"log": log} if log is not None else {}
        watcher = _WATCHERS[loop_key] = SlurmWatcher(ledger_factory, resync, config=config, **kw)
    watcher.start()
    return watcher
