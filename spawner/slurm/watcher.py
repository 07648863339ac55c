"""One watcher per hub process for every gpuhub job in Slurm.

Each cycle reads the ledger's live Slurm allocations, then asks Slurm about every gpuhub
job in one ``squeue`` call, then acts:

- a job that started gets the GPUs Slurm gave it written to the ledger (from
  ``scontrol -d show job``: never assumed);
- a job that ended, or that Slurm no longer lists, has its allocation released;
- a job whose allocation was already released (a burst's lease ran out, a stop whose
  ``scancel`` failed) is cancelled, so nothing gpuhub started is orphaned.

The ledger is read *before* ``squeue`` runs: a job id in that read was submitted before
the query began, so a job missing from a successful answer has really left Slurm.

Polling backs off (``min_interval`` doubling to ``max_interval``) while nothing changes,
and returns to ``min_interval`` when a job changes or a spawner is waiting. A failed query
keeps the last known state and is only logged: a scheduler hiccup never declares a
server dead. Spawners read the cache (:meth:`SlurmWatcher.job`) instead of running their
own ``squeue``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from traitlets import Float, List, Unicode
from traitlets.config import LoggingConfigurable

from ..ledger import AllocationInfo
from . import jobs

JOB_NAMES = ("gpuhub-server", "gpuhub-engines")


@dataclass(frozen=True)
class Action:
    kind: str  # "record" (write the job's GPUs), "attach" (its job id), "release", "cancel"
    allocation: AllocationInfo
    job_id: str | None
    reason: str = ""


def reconcile(
    allocations: Iterable[AllocationInfo],
    listed: dict[str, jobs.JobInfo],
    now: datetime,
    never_submitted_after: timedelta = timedelta(minutes=5),
) -> list[Action]:
    """What the ledger must do given Slurm's answer. ``allocations``: live Slurm ones, read
    before the query; ``listed``: the query's jobs; ``now``: the ledger's clock (naive UTC)."""
    tagged: dict[int, jobs.JobInfo | None] = {}
    for j in listed.values():
        if j.allocation_id and not j.ended:  # two live jobs with one tag: attach neither
            tagged[j.allocation_id] = None if j.allocation_id in tagged else j
    actions = []
    for a in allocations:
        job = listed.get(a.backend_job_id) if a.backend_job_id else None
        if a.backend_job_id is None:
            found = tagged.get(a.id)
            if found is not None and found.user == a.user:
                # submitted, but its id never reached the ledger (a hub stopped, a cancelled spawn)
                actions.append(Action("attach", a, found.job_id, "found by its gpuhub tag"))
            elif now - a.created > never_submitted_after:
                actions.append(
                    Action("release", a, None, "never reached Slurm (hub stopped while submitting)")
                )
        elif job is None:
            actions.append(Action("release", a, a.backend_job_id, f"Slurm job {a.backend_job_id} is gone"))
        elif job.ended:
            actions.append(
                Action("release", a, job.job_id, f"Slurm job {job.job_id} ended ({job.state.lower()})")
            )
        elif job.running and len(a.gpus) < a.gpu_count:
            actions.append(Action("record", a, job.job_id))
    return actions


def orphans(
    live: Iterable[AllocationInfo],
    others: Iterable[AllocationInfo],
    listed: dict[str, jobs.JobInfo],
    now: datetime,
    recent: timedelta = timedelta(days=1),
) -> list[Action]:
    """gpuhub jobs still in Slurm that no live allocation accounts for: cancel them.

    ``live``: live Slurm allocations; ``others``: released ones, found by the jobs' ids or
    tags. A job is cancelled when its allocation was released (recently: job ids wrap
    around), or when its tag names a live allocation that runs another job. Only jobs of
    the allocation's own user are touched.
    """
    live = {a.id: a for a in live}
    by_job = {a.backend_job_id: a for a in others if a.backend_job_id}
    by_id = {a.id: a for a in others}
    out = []
    for job in listed.values():
        if job.ended or job.state == "COMPLETING":
            continue  # ending already: cancelling again changes nothing
        a = by_job.get(job.job_id)
        if a is not None and a.user == job.user and a.ended and now - a.ended < recent:
            out.append(Action("cancel", a, job.job_id, f"its allocation was released ({a.end_reason})"))
            continue
        tag = job.allocation_id
        if tag is None:
            continue
        owner = live.get(tag)
        if owner is not None:
            if owner.user == job.user and owner.backend_job_id not in (None, job.job_id):
                out.append(
                    Action("cancel", owner, job.job_id, f"allocation {tag} runs job {owner.backend_job_id}")
                )
            continue
        a = by_id.get(tag)
        if a is not None and a.user == job.user and not a.active:
            out.append(Action("cancel", a, job.job_id, f"its allocation was released ({a.end_reason})"))
    return out


def _name(argv: list[str]) -> str:
    """The Slurm command in ``argv``, past a ``sudo -E -u USER`` prefix."""
    for part in argv:
        if part.startswith(("sbatch", "squeue", "scancel", "scontrol", "srun", "sinfo", "sacctmgr")):
            return part
    return argv[0]


async def run_command(argv: list[str], timeout: float, input: str | None = None, env=None) -> str:
    """Run ``argv`` (no shell); its stdout, or :class:`jobs.SlurmError` with its stderr."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
    except OSError as e:
        raise jobs.SlurmError(f"cannot run {argv[0]}: {e}") from None
    try:
        out, err = await asyncio.wait_for(
            proc.communicate(input.encode() if input is not None else None), timeout
        )
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise jobs.SlurmError(f"{_name(argv)} took longer than {timeout:g} s") from None
    except asyncio.CancelledError:
        proc.kill()
        raise
    if proc.returncode != 0:
        raise jobs.SlurmError(
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

    def __init__(self, ledger_factory, resync=None, **kw):
        super().__init__(**kw)
        self._ledger_factory = ledger_factory
        self._resync = resync  # re-reads the inventory when Slurm names a GPU the ledger lacks
        self.jobs: dict[str, jobs.JobInfo] = {}
        self.positions: dict[str, tuple[int, int, str]] = {}  # pending gpuhub jobs in their queues
        self._positions_at = 0.0
        self.last_ok = 0.0  # monotonic start of the last successful query
        self.failures = 0
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

    def job(self, job_id: str) -> tuple[str, jobs.JobInfo | None]:
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
            try:
                changed = await self.cycle()
            except Exception:
                self.log.exception("gpuhub Slurm watcher: cycle failed")
                changed = False
            self._updated.set()
            interval = self.min_interval if changed or self._waiters else min(self.max_interval, interval * 2)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), interval)
            except TimeoutError:
                pass

    async def cycle(self) -> bool:
        """One round: ledger, ``squeue``, actions. True when something changed."""
        ledger = await asyncio.to_thread(self._ledger_factory)
        live = await asyncio.to_thread(lambda: [a for a in ledger.active(backend="slurm")])
        started = time.monotonic()
        try:
            out = await run_command(jobs.squeue_argv(self.job_names), self.command_timeout)
            listed = jobs.parse_squeue(out)
        except jobs.SlurmError as e:
            self.failures += 1
            self.log.warning("gpuhub Slurm watcher: squeue failed (%s); keeping the last known state", e)
            return False
        if self.failures:
            self.log.info("gpuhub Slurm watcher: squeue answers again after %d failure(s)", self.failures)
        self.failures = 0
        changed = listed != self.jobs
        self.jobs, self.last_ok = listed, started
        await self._queue_positions(listed)
        now = ledger.clock()
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

    async def _queue_positions(self, listed: dict[str, jobs.JobInfo]) -> None:
        """One more query, only while a gpuhub job waits: its place in its partition's queue."""
        waiting = {j for j, info in listed.items() if info.pending}
        if not waiting:
            self.positions = {}
            return
        if waiting <= set(self.positions) and time.monotonic() - self._positions_at < 10:
            return  # positions change slowly: at most one cluster-wide query per 10 s
        try:
            out = await run_command(jobs.pending_argv(), self.command_timeout)
        except jobs.SlurmError as e:
            self.log.debug("gpuhub Slurm watcher: no queue positions (%s)", e)
            return
        self.positions = jobs.queue_positions(out, waiting)
        self._positions_at = time.monotonic()

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
            out = await run_command(jobs.job_detail_argv(action.job_id), self.command_timeout)
            gpus = jobs.parse_job_gpus_json(out, action.job_id)
            if len(gpus) > a.gpu_count:  # more than was admitted: over the user's limit
                reason = f"Slurm job {action.job_id} holds {len(gpus)} GPUs, {a.gpu_count} were admitted"
                self.log.warning("gpuhub: cancelling job %s of %s: %s", action.job_id, a.user, reason)
                await run_command(["scancel", str(action.job_id)], self.command_timeout)
                await asyncio.to_thread(ledger.release, a.id, reason)
                return
            if len(gpus) < a.gpu_count:
                raise jobs.SlurmError(f"job {action.job_id} shows {len(gpus)} GPUs, {a.gpu_count} asked for")
            try:
                info, released = await asyncio.to_thread(ledger.record_gpus, a.id, gpus, action.job_id)
            except LookupError:
                if self._resync is None:
                    raise
                await asyncio.to_thread(self._resync)
                info, released = await asyncio.to_thread(ledger.record_gpus, a.id, gpus, action.job_id)
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
            self.log.info("gpuhub: cancelling Slurm job %s: %s", action.job_id, action.reason)
            await run_command(["scancel", str(action.job_id)], self.command_timeout)


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
