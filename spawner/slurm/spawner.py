"""``gpu-slurm``: batchspawner's ``SlurmSpawner`` with GPUs admitted by the gpuhub ledger.

- The form offers the cluster's partitions and GPU types (``sinfo``, cached), what is
  free in each partition and what the user may still take.
- ``start()``: the ledger admits the count within the user's limit *before* ``sbatch``
  (the job may then wait in Slurm's queue: a request never exceeds the limit, but may
  exceed what is free now); the job id is recorded as soon as ``sbatch`` answers; once
  the job runs, the GPUs Slurm gave it (``squeue --json``, per node) are written to the
  ledger. While pending, the spawn page shows Slurm's state and reason.
- Job state comes from the process's one :class:`~.watcher.SlurmWatcher`, never from an
  ``squeue`` per spawner; a failed query keeps the last known state.
- Commands run without a shell (``sudo -E -u USER sbatch`` by default), the batch script
  is rendered by :mod:`.script` (``c.GpuSlurmSpawner.batch_script`` to override it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shlex
import sys
from datetime import UTC, datetime

from batchspawner import JobStatus, SlurmSpawner
from jupyterhub.spawner import SpawnException
from traitlets import Float, Int, List, Unicode, default

from spawner.policy.records import AllocationInfo, GpuConflict
from spawner.policy.slices import Offer
from spawner.slurm import SlurmError, callback, commands, priority, script, shards, sinfo, squeue
from spawner.slurm.accounting import SlurmAccounting
from spawner.slurm.cluster import read_cluster
from spawner.slurm.commands import job_qos
from spawner.slurm.watcher import GAVE_TWICE, conflict_reason, get_watcher, run_command
from spawner.spawners import form
from spawner.spawners.base import GpuSpawnerMixin
from spawner.spawners.refusals import make_refusal

callback.install()


_BACKGROUND: set[asyncio.Task] = set()  # cleanups that outlive their spawn
UNTYPED = "GPU"  # the ledger's model for GPUs Slurm gives no type (gres "gpu:4")


def _in_hub_loop() -> bool:
    """Whether an event loop runs here (the hub's; not the CLI's script preview)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def slurm_gpu_env(allocation: AllocationInfo | None) -> dict[str, str]:
    """The gpuhub variables of a Slurm server. Slurm itself sets ``CUDA_VISIBLE_DEVICES``
    and ``SLURM_JOB_GPUS`` inside the job (the GPUs are not known before it runs). A slice
    (Slurm's shards) is told its share; Slurm fences neither memory nor compute, so no memory
    size is promised and no MPS daemon is asked for."""
    env = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "GPUHUB_BACKEND": "slurm"}
    if allocation is None:
        env.update(CUDA_VISIBLE_DEVICES="", GPUHUB_ALLOCATION_ID="")
    else:
        env.update(GPUHUB_ALLOCATION_ID=str(allocation.id))
        if allocation.slice_parts:
            env.update(GPUHUB_GPU_SLICE=f"1/{allocation.slice_parts}", GPUHUB_SLICE_MPS="0")
    return env


def job_cpus(gpus: int, per_gpu: int, asked: tuple[str, int] | None = None) -> int:
    """CPUs of a server's job: ``per_gpu`` for each GPU, a slice its share of them; 1 at least."""
    if asked is not None:
        return max(1, per_gpu // asked[1])
    return max(1, gpus * per_gpu)


def slice_gres(asked: tuple[str, int] | None, cluster: sinfo.Cluster) -> str | None:
    """The ``--gres`` of a slice (``asked``: its model and parts), in Slurm's shards; None for
    whole GPUs. ``ValueError`` naming the setting where Slurm's shards cannot make it."""
    if asked is None:
        return None
    model, parts = asked
    per = shards.check_shards({model: Offer(model, parts)}, cluster, UNTYPED)[model]
    return shards.slice_gres(model, per, UNTYPED)


class GpuSlurmSpawner(GpuSpawnerMixin, SlurmSpawner):
    """SlurmSpawner with GPUs from the gpuhub ledger (``spawner_class = "gpu-slurm"``)."""

    backend_name = "slurm"

    batch_script = Unicode(
        script.SERVER_TEMPLATE,
        help="""Jinja2 template of the server's batch script. Values: ``user``, ``job_name``,
        ``output``, ``homedir``, ``export``, ``gres``, ``partition``, ``cpus``, ``memory``,
        ``runtime``, ``account``, ``directives`` (a list), ``prologue``, ``command`` (quoted).
        Preview the result with ``gpuhub slurm script --user NAME --gpus N``.
        ``c.GpuSlurmSpawner.batch_script = open("/etc/jupyterhub/server.sbatch").read()``""",
    ).tag(config=True)

    partitions = List(
        Unicode(),
        help="""Partitions users may choose in the form (default: every partition ``sinfo``
        shows). ``c.GpuSlurmSpawner.partitions = ["gpu", "interactive"]``""",
    ).tag(config=True)

    default_partition = Unicode(
        "",
        help="""Partition preselected in the form and used when a request names none
        (default: Slurm's default partition). ``c.GpuSlurmSpawner.default_partition = "gpu"``""",
    ).tag(config=True)

    cpus_per_gpu = Int(
        2,
        help="""CPUs the server's job asks for per GPU (at least 1 in all).
        ``c.GpuSlurmSpawner.cpus_per_gpu = 8``""",
    ).tag(config=True)

    extra_directives = List(
        Unicode(),
        help="""More ``#SBATCH`` options, one option each.
        ``c.GpuSlurmSpawner.extra_directives = ["--qos=interactive"]``""",
    ).tag(config=True)

    output_template = Unicode(
        "{homedir}/.gpuhub-server-%j.log",
        help="""Where the server job's output goes (``{homedir}`` is the user's home; ``%j``
        Slurm's job id). ``c.GpuSlurmSpawner.output_template = "/scratch/{username}/jupyter-%j.log"``""",
    ).tag(config=True)

    cluster_cache_seconds = Float(
        30.0,
        help="""How long the partitions and GPU types read from ``sinfo`` are reused for forms.
        ``c.GpuSlurmSpawner.cluster_cache_seconds = 30``""",
    ).tag(config=True)

    status_timeout = Float(
        5.0,
        help="""Seconds ``poll()`` waits for the watcher's first answer about a job before it
        counts the job as alive (unknown is never dead). ``c.GpuSlurmSpawner.status_timeout = 5``""",
    ).tag(config=True)

    @default("startup_poll_interval")
    def _default_startup_poll(self):
        # batchspawner's start loop (job running? port called back?) reads the watcher's cache
        # and an attribute here, never Slurm itself: looking often costs nothing
        return 0.1

    @default("batchspawner_singleuser_cmd")
    def _default_singleuser(self):
        # gpuhub-singleuser reports the port as batchspawner-singleuser does, without first
        # importing the hub's API handlers, ORM and SQLAlchemy (0.6-0.8 s of every job's start;
        # spawner.singleuser); from the hub's environment when it is there, else the server's PATH
        found = os.path.join(os.path.dirname(sys.executable), "gpuhub-singleuser")
        return found if os.path.exists(found) else "gpuhub-singleuser"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if _in_hub_loop():
            _ = self.watcher  # the hub's first Slurm spawner starts the hub's one watcher

    _last_status = Unicode("")
    _seen_job = Unicode("")

    # cluster, form, admission --------------------------------------------------------

    def cluster(self) -> sinfo.Cluster:
        return read_cluster(self.cluster_cache_seconds)

    def allowed_partitions(self, cluster: sinfo.Cluster) -> list[str]:
        return [p for p in cluster.partitions if not self.partitions or p in self.partitions]

    def chosen_partition(self, cluster: sinfo.Cluster, requested: str | None) -> str:
        return requested or self.default_partition or cluster.default_partition or cluster.partitions[0]

    def parse_options(self) -> form.GpuOptions:
        return form.parse_gpu_options(
            self.user_options,
            default_gpus=self.default_gpus,
            partitions=self.allowed_partitions(self.cluster_or_503()),
        )

    def cluster_or_503(self) -> sinfo.Cluster:
        try:
            return self.cluster()
        except SlurmError as e:
            raise make_refusal(
                f"Slurm is not answering ({e}); try again in a minute, or tell an admin.",
                "slurm_unavailable",
                503,
            ) from None

    def admission(self, opts: form.GpuOptions) -> dict:
        cluster = self.cluster_or_503()
        return {
            "on_nodes": cluster.partition_nodes(self.chosen_partition(cluster, opts.partition)),
            "deferred": True,
        }

    async def _render_gpu_form(self, _spawner=None) -> str:
        groups, name = self._groups(), self.user.name  # the hub's ORM: on its loop, not in the thread

        def facts():
            cluster = self.cluster()
            free_nodes = [st.gpu.node for st in self.ledger.gpu_table() if st.present and not st.holder]
            per_partition = {}
            for p in self.allowed_partitions(cluster):
                nodes = cluster.partition_nodes(p)
                per_partition[p] = sum(1 for node in free_nodes if node in nodes)
            most = max((len(n.gpus()) for n in cluster.nodes), default=0)
            allowance = self.ledger.allowance(name, groups)
            chosen = self.chosen_partition(cluster, None)
            return allowance, self.ledger.models(), per_partition, chosen, most, self.ledger.slice_room()

        allowance, models, per_partition, chosen, most, slice_room = await asyncio.to_thread(facts)
        # a request may wait in the queue: what the user may take is bounded by the limit only
        room = allowance.may_take if allowance.may_take is not None else most
        allowance = dataclasses.replace(allowance, fits=min(room, most))
        return form.render_form(
            allowance,
            models,
            self.default_gpus,
            per_partition,
            chosen,
            grace_seconds=self.gpuhub.preempt_grace_seconds,  # Slurm's GraceTime on the borrow QOS
            asked=self.refused_count(),  # a refused count stays in the field
            longest=self.longest_session(groups),  # the job's --time
            slices=form.SliceChoice(slice_room, self.gpuhub.slices_only(groups), shards=True)
            if slice_room
            else None,
        )

    # the job ------------------------------------------------------------------------

    def gpu_env(self, allocation):
        env = {**slurm_gpu_env(allocation), **self.gpuhub.report_env()}
        accounting = self._accounting()
        account = self.req_account or accounting.account_for_jobs
        if account:  # %%distributed submits its engines' jobs under the same account
            env["GPUHUB_SLURM_ACCOUNT"] = account
        if accounting.enabled and accounting.borrow_qos:  # a burst that borrows runs under it
            env["GPUHUB_SLURM_BORROW_QOS"] = accounting.borrow_qos
        return env

    def _borrowed(self) -> int:
        allocation = getattr(self, "gpu_allocation", None)
        return int(getattr(allocation, "borrowed", 0) or 0)

    def job_qos(self, borrowed: int | None = None) -> str:
        """The QOS of the server's job: the borrow QOS when any of its GPUs is borrowed (with
        accounting on, which writes that QOS), else the association's default."""
        accounting = self._accounting()
        qos = accounting.borrow_qos if accounting.enabled else ""
        return job_qos(self._borrowed() if borrowed is None else borrowed, qos)

    @property
    def watcher(self):
        gpuhub = self.gpuhub
        return get_watcher(
            self.config, lambda: gpuhub.open_ledger(), gpuhub.db_url, gpuhub.sync_inventory, self.log
        )

    def backend_job_id(self) -> str | None:
        return self.job_id or None

    def _prefix(self) -> list[str]:
        return [part.format(username=self.user.name) for part in shlex.split(self.exec_prefix)]

    def _script_inputs(self) -> tuple:
        """What the script takes from the hub's own objects (the user's name, the server's
        environment and command): read on the hub's event loop, never in a worker thread, where
        the hub's ORM session may be in the middle of a commit."""
        env_names = sorted(self.get_env())
        return (
            self.user.name,
            self.req_homedir,
            env_names,
            [self.batchspawner_singleuser_cmd, *self.cmd, *self.get_args()],
        )

    def _render(self, inputs: tuple, opts: form.GpuOptions) -> str:
        """The script from ``_script_inputs`` (blocking: asks ``sinfo``; runs in a thread)."""
        user, homedir, env_names, command = inputs
        cluster = self.cluster()
        return self.script_for(
            user,
            homedir,
            env_names,
            command,
            opts,
            self.chosen_partition(cluster, opts.partition),
            self.job_qos(),
            time_limit_seconds=getattr(self.gpu_allocation, "time_limit_seconds", None),
            slice_asked=self.slice_asked,
            cluster=cluster,
        )

    def script_for(
        self,
        user,
        homedir,
        env_names,
        command,
        opts: form.GpuOptions,
        partition: str,
        qos: str = "",
        time_limit_seconds: float | None = None,
        slice_asked: tuple[str, int] | None = None,
        cluster: sinfo.Cluster | None = None,
    ) -> str:
        """The server's batch script from explicit inputs (``gpuhub slurm script`` previews it).
        ``qos``: the borrow QOS of a server with borrowed GPUs (``--qos=``, after the admin's
        ``extra_directives``, so it wins over a ``--qos`` there). ``time_limit_seconds``: the
        allocation's time limit (``c.GpuHub.*_max_hours``, or less as asked), the job's
        ``--time`` in place of ``req_runtime``. ``slice_asked``: a slice's model and parts (Slurm's
        shards of ``cluster``), in place of the whole GPUs ``opts`` asks for."""
        slice_asked = slice_asked if opts.count else None  # a server without GPUs asks for no shard
        gres = slice_gres(slice_asked, cluster) if slice_asked else None
        if gres is None:
            model = None if opts.model == UNTYPED else opts.model
            gres = commands.gres_request(opts.count, model) if opts.count else ""
        return script.render(
            self.batch_script,
            command=command,
            directives=[*self.extra_directives, *([f"--qos={qos}"] if qos else [])],
            user=user,
            job_name="gpuhub-server",
            output=self.output_template.format(homedir=homedir, username=user),
            homedir=homedir,
            export=script.export_list(dict.fromkeys(env_names, "")),
            gres=gres,
            partition=partition,
            cpus=job_cpus(opts.count, self.cpus_per_gpu, slice_asked),
            memory=self.req_memory,
            runtime=commands.job_time(time_limit_seconds, self.req_runtime),
            account=self.req_account or self._accounting().account_for_jobs,
            prologue=self.req_prologue,
        )

    async def start(self):
        """batchspawner's start, watched: a job that ends before the server answers is a clear
        error at once (batchspawner alone would wait for the port until start_timeout)."""
        self.job_id = ""  # a job of an earlier start is not this one's
        self._seen_job = ""
        task = asyncio.ensure_future(super().start())
        allocation_id = 0  # kept: the failed start releases its allocation before it is read
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=1)
                allocation_id = self.allocation_id or allocation_id
                if done:
                    return task.result()
                self._seen_job = self.job_id or self._seen_job
                if self.job_id and self._job_ended():
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    raise await self._ended_error(allocation_id)
        except asyncio.CancelledError:
            task.cancel()
            raise
        except RuntimeError as e:
            if "disappeared" not in str(e):  # batchspawner: the job ended while pending
                raise
            raise await self._ended_error(allocation_id) from None

    async def _backend_start(self) -> str:
        """batchspawner's start. The admin's ``start_timeout`` counts from when Slurm runs the
        job: a wait in Slurm's queue is bounded by ``c.GpuHub.queue_max_wait_hours``, as a wait
        in gpuhub's own queue is, and then ends saying so (the job is cancelled by the stop
        that follows a failed start)."""
        loop = asyncio.get_running_loop()
        submitted, running = loop.time(), None
        most = self.gpuhub.queue_max_wait_hours * 3600
        task = asyncio.ensure_future(SlurmSpawner.start(self))
        try:
            while True:
                done, _ = await asyncio.wait([task], timeout=1)
                if done:
                    return task.result()
                info = self.watcher.job(self.job_id)[1] if self.job_id else None
                now = loop.time()
                if running is None and info is not None and info.running:
                    running = now
                elif running is not None and info is not None and info.pending:  # requeued: waits again
                    running, submitted = None, now
                if running is not None and now - running > self.server_start_timeout:
                    raise self.start_timeout_error()
                if running is None and now - submitted > most:
                    raise make_refusal(
                        f"Your server waited {most / 3600:g} h in Slurm's queue without starting "
                        "(c.GpuHub.queue_max_wait_hours); it left the queue and holds nothing. "
                        "Start it again, or ask for fewer GPUs.",
                        "queue_timeout",
                        503,
                    )
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def server_alive(self) -> bool:
        return not (self.job_id and self._job_ended())

    def _job_ended(self) -> bool:
        verdict, info = self.watcher.job(self.job_id)
        return verdict == "gone" or (info is not None and info.ended)

    async def _ended_error(self, allocation_id: int = 0) -> SpawnException:
        log = self.output_template.format(homedir=self.req_homedir, username=self.user.name)
        job = self.job_id or self._seen_job  # batchspawner may have cleared the state already
        _, info = self.watcher.job(job) if job else ("", None)
        state = info.state.lower() if info else "gone"
        gave_twice = await self._gave_twice(allocation_id or self.allocation_id)
        if gave_twice is not None:
            return gave_twice
        return make_refusal(
            f"Your server's Slurm job {job} ended before the server started ({state}). "
            f"Its output is in {log} (%j is the job id); tell an admin if it does not say why.",
            "slurm_job_ended",
            500,
        )

    def _accounting(self) -> SlurmAccounting:
        return SlurmAccounting(config=self.config, log=self.log)

    def _sync_account(self, name: str, groups: list[str]) -> None:
        """Remember the user's groups and write their limit to Slurm's accounting (adding
        the user there when first seen) before their first job. ``name`` and ``groups`` are
        read by the caller on the hub's event loop (the hub's ORM is not for worker threads)."""
        ledger = self.ledger
        ledger.note_user(name, groups)
        self._accounting().sync(ledger, [name], {name: groups})

    async def submit_batch_script(self):
        opts = self.gpu_options  # checked by the mixin's admission, before anything was taken
        try:
            await asyncio.to_thread(self._sync_account, self.user.name, self._groups())
        except ValueError as e:  # a bad c.GpuHub share: nothing is submitted, the trait is named
            self.log.error("gpuhub: %s", e)
            raise make_refusal(f"The hub's configuration is wrong: {e}", "gpuhub_config", 500) from None
        except SlurmError as e:
            # slurmctld may still take the job (a user Slurm knows already): try, and say why
            # if it refuses; gpuhub's own admission has bounded the request either way
            self.log.warning("gpuhub: Slurm accounting not updated for %s: %s", self.user.name, e)
        text = await asyncio.to_thread(self._render, self._script_inputs(), opts)
        self.log.debug("gpuhub: batch script of %s:\n%s", self.user.name, text)
        argv = [*self._prefix(), *commands.sbatch_argv(self.allocation_id)]
        self.log.info("gpuhub: submitting %s's server to Slurm: %s", self.user.name, " ".join(argv))
        env = self.get_env()
        if "SLURM_CONF" in os.environ:  # a cluster whose config is not in /etc/slurm
            env.setdefault("SLURM_CONF", os.environ["SLURM_CONF"])
        try:
            out = await self._sbatch(argv, text, env)
        except SlurmError as e:
            if not self._accounting().enabled:
                raise make_refusal(f"Slurm refused the job: {e}", "slurm_refused", 400) from None
            # what gpuhub remembered of the user's association may be stale (an operator's
            # sacctmgr): read and write it again, and submit once more
            self.log.info(
                "gpuhub: Slurm refused %s's job (%s); checking their association again", self.user.name, e
            )
            SlurmAccounting.forget(self.user.name)
            try:
                await asyncio.to_thread(self._sync_account, self.user.name, self._groups())
                out = await self._sbatch(argv, text, env)
            except SlurmError as e:
                raise make_refusal(f"Slurm refused the job: {e}", "slurm_refused", 400) from None
        self.job_id = commands.parse_sbatch(out)
        self.watcher.track(self.job_id)
        self._save_state()  # a hub restarted while this job queues must know it
        if self.allocation_id:
            try:
                await self._in_ledger("attach_job", self.allocation_id, self.job_id)
            except (LookupError, ValueError) as e:  # released meanwhile: the watcher cancels the job
                self.log.warning("gpuhub: job %s of %s not attached: %s", self.job_id, self.user.name, e)
        self._progress(30, submitted_message(self.job_id, self._borrowed(), self.job_qos(), self._grace()))
        return self.job_id

    async def _sbatch(self, argv: list[str], text: str, env: dict) -> str:
        """sbatch's output; a :class:`SlurmError` when Slurm refused the job (none submitted)."""
        # shielded: a spawn cancelled now must still learn the job id (stop() cancels that job;
        # a job whose id is lost anyway is found by its --comment and cancelled by the watcher)
        submitted = asyncio.ensure_future(run_command(argv, 60, input=text, env=env))
        try:
            return await asyncio.shield(submitted)
        except asyncio.CancelledError:
            # this spawn is over (its state may be cleared already): end the job it submitted
            task = asyncio.ensure_future(self._cancel_when_submitted(submitted))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
            raise

    def _grace(self) -> float:
        return float(self.gpuhub.preempt_grace_seconds)

    async def _cancel_when_submitted(self, submitted) -> None:
        with contextlib.suppress(Exception):
            job_id = commands.parse_sbatch(await submitted)
            self.log.info("gpuhub: cancelling job %s of %s: its spawn was cancelled", job_id, self.user.name)
            await run_command([*self._prefix(), "scancel", job_id], 30)

    def _save_state(self) -> None:
        """JupyterHub stores a spawner's state only once start() returns; a queued job can
        outlive the hub before that, so store it now."""
        orm = getattr(self, "orm_spawner", None)
        if orm is None:
            return
        try:
            orm.state = self.get_state()
            self.db.commit()
        except Exception as e:  # the state is saved again when the start completes
            self.log.warning("gpuhub: could not save %s's job id early: %s", self._log_name, e)

    async def query_job_status(self):
        if not self.job_id:
            self.job_status = ""
            return JobStatus.NOTFOUND
        watcher = self.watcher
        watcher.track(self.job_id)
        verdict, info = watcher.job(self.job_id)
        if verdict == "unknown":
            await watcher.next_update(self.status_timeout)
            verdict, info = watcher.job(self.job_id)
        if verdict == "unknown":
            self.job_status = "UNKNOWN"
            return JobStatus.UNKNOWN
        if verdict == "gone" or info.ended:
            self.job_status = info.state if info else ""
            return JobStatus.NOTFOUND
        self.job_status = f"{info.state} {info.nodes[0] if info.nodes else ''}".strip()
        gpus = self.gpu_options.count if self.gpu_options is not None else 0
        if self.slice_asked is not None:  # "waiting for 1/4 GPU"
            gpus = f"1/{self.slice_asked[1]} GPU"
        now = datetime.now(UTC).replace(tzinfo=None)
        text = priority.wait_message(info, watcher.positions.get(self.job_id), gpus, now)
        if self._spawn_pending and text != self._last_status:
            self._last_status = text
            heading = "Waiting for GPUs in Slurm's queue" if info.pending else "Your Slurm job is starting"
            self._progress(40 if info.pending else 50, text, heading=heading)
        return JobStatus.RUNNING if info.running else JobStatus.PENDING

    def state_gethost(self):
        _, info = self.watcher.job(self.job_id)
        return info.nodes[0] if info and info.nodes else None

    async def cancel_batch_job(self):
        if not self.job_id:
            return  # nothing was submitted (or its id was lost: the watcher cancels it by tag)
        argv = [*self._prefix(), "scancel", str(self.job_id)]
        self.log.info("gpuhub: cancelling Slurm job %s of %s", self.job_id, self.user.name)
        try:
            await run_command(argv, 30)
        finally:
            self.watcher.nudge()  # look again now

    async def mark_started(self, allocation: AllocationInfo) -> AllocationInfo:
        """Write the GPUs Slurm gave the job. If Slurm cannot say right now, the server still
        counts as started and the watcher writes the GPUs at its next cycle."""
        try:
            out = await run_command(commands.job_detail_argv(self.job_id), 30)
            gpus = squeue.parse_job_gpus_json(out, self.job_id)
        except SlurmError as e:
            self.log.warning("gpuhub: GPUs of job %s not read yet (%s); the watcher will", self.job_id, e)
            return await super().mark_started(allocation)
        try:
            try:
                info, _ = await self._record(allocation, gpus)
            except LookupError:
                await asyncio.to_thread(self.gpuhub.sync_inventory)
                info, _ = await self._record(allocation, gpus)
        except GpuConflict as e:  # the start fails; JupyterHub's stop cancels the job
            self.log.warning("gpuhub: Slurm job %s of %s: %s", self.job_id, self.user.name, e)
            raise make_refusal(conflict_reason(e), "gpu_conflict", 503) from None
        except (LookupError, ValueError, SlurmError) as e:
            gave_twice = await self._gave_twice(allocation.id)  # the watcher ended it meanwhile
            if gave_twice is not None:
                raise gave_twice from None
            # the watcher records (or, over the admission, cancels) it at its next cycle
            self.log.warning("gpuhub: GPUs of job %s not recorded now: %s", self.job_id, e)
            return await super().mark_started(allocation)
        self._progress(55, f"Slurm job {self.job_id} holds {', '.join(g.label for g in info.gpus)}")
        return info

    async def _gave_twice(self, allocation_id: int) -> SpawnException | None:
        """The refusal, with the ledger's reason as written, where the watcher ended this start's
        allocation because Slurm gave its job a GPU another job holds; else None."""
        if not allocation_id:
            return None
        mine = await self._in_ledger("get", allocation_id)
        if mine is None or mine.state != "released" or GAVE_TWICE not in (mine.end_reason or ""):
            return None
        return make_refusal(mine.end_reason, "gpu_conflict", 503)

    async def _record(self, allocation: AllocationInfo, gpus):
        """``record_gpus``; where Slurm gave a GPU the ledger shows held by the other kind (whole
        or sliced), once more with the jobs Slurm lists now, so a holder whose job ended and
        was not seen yet is released rather than taken for a GPU given twice."""
        try:
            return await self._in_ledger("record_gpus", allocation.id, gpus, self.job_id)
        except GpuConflict:
            live = self.watcher.live_job_ids(await self.watcher.read_jobs())
            return await self._in_ledger("record_gpus", allocation.id, gpus, self.job_id, live)

    def load_state(self, state):
        super().load_state(state)
        if self.job_id and _in_hub_loop():
            self.watcher.track(self.job_id)


def submitted_message(job_id: str, borrowed: int, qos: str, grace_seconds: float) -> str:
    """The spawn page's line once ``sbatch`` answered (pure); a job with borrowed GPUs says
    that it is preemptible, and how much notice it gets."""
    line = f"Submitted to Slurm as job {job_id}"
    if borrowed and qos:
        line += (
            f" (preemptible: {borrowed} GPU{'s' if borrowed != 1 else ''} borrowed beyond your limit, "
            f"Slurm QOS {qos}; when a job within its limit needs the GPUs, Slurm ends this server "
            f"after {grace_seconds:g} s)"
        )
    return line
