"""``%%distributed`` engines as Slurm tasks, one per GPU, when the server runs in Slurm.

Two ways, chosen by :func:`plan_launch`:

- **steps**: the session's own job holds enough GPUs on its node: the engines are one
  ``srun`` step inside it (``--ntasks=N --gres=gpu:N``), nothing new is allocated;
- **job**: otherwise a burst allocation is admitted by the broker (within the user's
  limit), and the engines are a batch job of the user (``--nodes M
  --ntasks-per-node G --gres=gpu:G``) placed by Slurm, whose job id the broker records.
  The hub's watcher writes the GPUs Slurm gave it to the ledger, and cancels the job if
  the allocation ends first (lease lost, admin release). While the job waits in Slurm's
  queue the cell shows its place and Slurm's expected start (:func:`queue_line`, from
  ``squeue --json`` only), updated in place; Ctrl-C then cancels the job (the magic releases
  the burst), so nothing stays held.

Every task reports where it runs (node, local id, the GPUs of its step); ranks follow
torchrun's order (node by node, GPU by GPU) and each engine is pinned to the GPU of its
local id, whatever numbering ``CUDA_VISIBLE_DEVICES`` uses on that cluster.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from gpu_magics.common import channels
from gpu_magics.common.ranks import RankSpec, Slot, make_rank_specs
from gpu_magics.engine.facts import engine_facts, free_port
from gpu_magics.launch.base import ENGINE_CMD, Placement, signal_pids


@dataclass(frozen=True)
class EngineFacts:
    """What one engine task reports about itself."""

    engine_id: int
    node: str  # SLURMD_NODENAME
    local_id: int  # SLURM_LOCALID
    gpus: tuple[int, ...]  # node indices of its step's GPUs (SLURM_STEP_GPUS or SLURM_JOB_GPUS)
    cuda: tuple[str, ...]  # its CUDA_VISIBLE_DEVICES entries, in the same order
    host: str  # socket.gethostname(): whether its pid can be signalled from here
    pid: int


def assign_ranks(facts: list[EngineFacts], master_port: int, run_id: str) -> list[tuple[int, RankSpec]]:
    """(engine id, its rank) for every engine: rank 0 on the first node, GPU order within
    each node; each engine's GPU is the one at its local id in its step's GPU list."""
    slots: dict[Slot, EngineFacts] = {}
    for f in facts:
        if f.local_id >= len(f.gpus):
            raise RuntimeError(
                f"engine {f.engine_id} on {f.node} is task {f.local_id} but its step has GPUs {list(f.gpus)}"
            )
        slot = Slot(f.node, f.gpus[f.local_id])
        if slot in slots:
            raise RuntimeError(f"two engines got GPU {slot.label}")
        slots[slot] = f
    ordered = sorted(slots)
    # rank 0's host name, as its machine knows itself (a Slurm NodeName need not resolve)
    specs = make_rank_specs(ordered, slots[ordered[0]].host, master_port, run_id=run_id)
    out = []
    for spec in specs:
        f = slots[spec.slot]
        out.append((f.engine_id, spec))
    return out


def cuda_device(f: EngineFacts) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value that leaves this engine its one GPU: the entry at
    its local id (renumbered from 0 under device cgroups, node indices without)."""
    if f.local_id < len(f.cuda):
        return f.cuda[f.local_id]
    return str(f.gpus[f.local_id])


def plan_launch(
    own_gpus: int, wanted: int, nodes: int | None, gpus_per_node: int | None
) -> tuple[str, int, int]:
    """("steps" | "job", nodes, GPUs per node). Steps when the session's job holds enough
    GPUs and one node is asked for; else a job spread evenly over ``nodes``."""
    if (nodes or 1) == 1 and wanted <= own_gpus and gpus_per_node in (None, wanted):
        return "steps", 1, wanted
    if nodes is None:
        nodes = 1 if gpus_per_node is None else -(-wanted // gpus_per_node)
    per_node = gpus_per_node or -(-wanted // nodes)
    if per_node * nodes != wanted:
        raise ValueError(
            f"--gpus {wanted} does not split evenly over {nodes} nodes; give --gpus-per-node so "
            "that nodes x GPUs per node = GPUs, e.g. --gpus 8 --nodes 2"
        )
    return "job", nodes, per_node


class SlurmLauncher:
    """Starts and stops the engines' Slurm tasks (a step of this job, or a job of their own);
    a :class:`~gpu_magics.launch.base.Launcher`."""

    def __init__(
        self, mode: str, nodes: int, per_node: int, workdir: str, partition: str = "", account: str = ""
    ):
        self.mode, self.nodes, self.per_node = mode, nodes, per_node
        self.workdir = workdir
        self.partition = partition
        self.account = account
        self.allocation_id = 0  # the burst's ledger allocation (tagged on the job)
        self.proc: subprocess.Popen | None = None
        self.job_id = ""
        self.step = ""
        self.on_submitted = None  # called with the job id once sbatch accepted the engines' job
        self.borrowed = 0  # GPUs of the burst beyond the limit: the job runs preemptible
        self.time_limit_seconds: float | None = None  # the burst's time limit: the job's --time
        self.borrow_qos = os.environ.get("GPUHUB_SLURM_BORROW_QOS", "")
        self.autosave: tuple[list[str], str] | None = None  # the pool's --autosave: saved at SIGTERM
        self.facts: dict[int, EngineFacts] = {}  # engine id -> where it runs (set by ``ranks``)

    @property
    def location(self) -> str:
        """Where engines reach the controller: this machine's host name (a Slurm NodeName
        need not resolve)."""
        return socket.gethostname()

    def start(self, engine_argv: list[str]) -> None:
        srun = shutil.which("srun") or "srun"
        if self.mode == "steps":
            n = self.per_node
            self.job_id = os.environ["SLURM_JOB_ID"]
            self.proc = subprocess.Popen(
                [
                    srun,
                    f"--jobid={self.job_id}",
                    "--nodes=1",
                    f"--ntasks={n}",
                    f"--gres=gpu:{n}",
                    "--kill-on-bad-exit=0",
                    "--export=ALL",
                    *engine_argv,
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, **autosave_env(self.autosave)},
            )
            return
        from spawner.slurm import commands

        argv = commands.sbatch_argv(self.allocation_id)
        out = subprocess.run(
            [shutil.which("sbatch") or "sbatch", *argv[1:]],
            input=self.job_script(engine_argv),
            capture_output=True,
            text=True,
            timeout=60,
            env=self.job_environ(os.environ),
        )
        if out.returncode != 0:
            raise RuntimeError(f"Slurm refused the engines' job: {out.stderr.strip()[-400:]}")
        self.job_id = commands.parse_sbatch(out.stdout)
        if self.on_submitted is not None:
            self.on_submitted(self.job_id)

    @property
    def qos(self) -> str:
        """The QOS of the engines' job: the borrow QOS when the burst borrowed GPUs."""
        from spawner.slurm.commands import job_qos

        return job_qos(self.borrowed, self.borrow_qos)

    def job_script(self, engine_argv: list[str]) -> str:
        """The engines' batch script (``--qos=<borrow QOS>`` when the burst borrowed GPUs:
        Slurm then preempts the whole job, after ``GraceTime``)."""
        from spawner.slurm import commands, script

        return script.render(
            script.ENGINES_TEMPLATE,
            command=engine_argv,
            directives=[f"--qos={self.qos}"] if self.qos else [],
            user=os.environ.get("USER", ""),
            job_name=ENGINES_NAME,
            output=os.path.join(self.workdir, "gpuhub-engines-%j.log"),
            workdir=self.workdir,
            nodes=self.nodes,
            per_node=self.per_node,
            gres=commands.gres_request(self.per_node, None),
            partition=self.partition,
            cpus="",
            memory="",
            account=self.account,
            runtime=commands.job_time(self.time_limit_seconds),
        )

    def job_environ(self, environ) -> dict[str, str]:
        """sbatch's environment (:func:`job_env`), with the pool's autosave names and
        directory, which the engines save at Slurm's SIGTERM (``gpu_magics.engine.main``)."""
        return job_env(environ) | autosave_env(self.autosave)

    @property
    def target(self) -> str:
        return f"{self.job_id}.{self.step}" if self.mode == "steps" and self.step else self.job_id

    # engines on other nodes connect over TCP: CurveZMQ on every socket of the controller (and
    # of each engine), the key in the owner's connection files only (gpu_magics.common.channels)
    controller_args = channels.CONTROLLER_ARGS

    def cluster_options(self) -> dict:
        # engines on Slurm nodes connect to this node
        return {"controller_ip": "0.0.0.0", "controller_location": self.location}

    def launch(self, cluster, n: int) -> None:
        self.start(engine_argv(cluster))
        if self.mode == "job":
            self.wait_in_queue()

    def wait_in_queue(self, show: Callable[[str], None] | None = None, poll=None) -> None:
        """Return once the engines' job has left Slurm's queue (started, or ended: the pool's
        own timeout then reports the engines missing). Meanwhile ``show`` gets the wait
        line whenever it changes (default: one cell output updated in place). A Ctrl-C here
        leaves through the pool's stop (``stop``: scancel) and the magic's burst release."""
        show = show or _display_line()
        poll = poll or self.read_queue
        hidden = jobs_hidden(self.read_config())  # then no place among others' can be counted
        delay, last = 0.5, None
        while True:
            line = queue_line(poll(), self.job_id, self.nodes * self.per_node, _utcnow(), hidden)
            if line is None:
                if last is not None:
                    show(f"Slurm job {self.job_id} left the queue; starting the engines")
                return
            if line != last:
                show(line)
                last = line
            time.sleep(delay)
            delay = min(delay * 2, QUEUE_POLL_MAX)

    @staticmethod
    def read_config() -> str | None:
        """``scontrol show config`` as this user sees it; None when Slurm could not be asked."""
        try:
            out = subprocess.run(
                [shutil.which("scontrol") or "scontrol", "show", "config"],
                capture_output=True, text=True, timeout=30, env=job_env(os.environ),
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    @staticmethod
    def read_queue():
        """This user's view of Slurm's queue (``squeue --json``: every job of the cluster);
        None when Slurm could not be asked (the last line stays)."""
        from spawner.slurm import SlurmError, commands, squeue

        try:
            out = subprocess.run(
                [shutil.which("squeue") or "squeue", *commands.squeue_json_argv()[1:]],
                capture_output=True, text=True, timeout=30, env=job_env(os.environ),
            )  # fmt: skip
            return squeue.parse_squeue_json(out.stdout, [ENGINES_NAME]) if out.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, SlurmError):
            return None

    def place(self, client, engine_ids: list[int], timeout: float) -> Placement:
        """Ranks from where Slurm put each engine (``assign_ranks``), a free port on rank 0's
        node; each engine pinned to its GPU (``cuda_device``)."""
        raw = {eid: client[eid].apply_async(engine_facts) for eid in engine_ids}
        facts = {}
        for eid, ar in raw.items():
            d = ar.get(timeout=timeout)
            facts[eid] = EngineFacts(
                eid, d["node"], d["local_id"], tuple(d["gpus"]), tuple(d["cuda"]), d["host"], d["pid"]
            )
            self.step = self.step or d["step"]
        self.facts = facts
        first = assign_ranks(list(facts.values()), 0, "gpuhub")[0][0]
        port = client[first].apply_async(free_port).get(timeout=timeout)
        pairs = assign_ranks(list(facts.values()), port, f"gpuhub-{self.job_id}")
        here = socket.gethostname()
        return Placement(
            engine_ids=tuple(eid for eid, _ in pairs),
            specs=tuple(spec for _, spec in pairs),
            envs=tuple(dict(spec.env(), CUDA_VISIBLE_DEVICES=cuda_device(facts[eid])) for eid, spec in pairs),
            remote=any(f.host != here for f in facts.values()),
            multi_host=len({f.host for f in facts.values()}) > 1,
        )

    def signal(self, pool, sig: int, ranks: list[int] | None) -> None:
        """Signal the ranks' engine processes where they run: by pid on this machine, and on
        other nodes through a Slurm step of the engines' own job on those nodes
        (:func:`remote_signal_argv`: authenticated as the user, only the named ranks' pids;
        pids on other machines mean nothing here)."""
        if not pool._remote:
            signal_pids(pool, sig, ranks)
            return
        here, remote = socket.gethostname(), {}
        for r in ranks if ranks is not None else range(pool.size):
            f = self.facts.get(pool.engine_ids[r]) if r < len(pool.engine_ids) else None
            if f is None:
                continue
            if f.host == here:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(f.pid, sig)
            else:
                remote.setdefault(f.node, []).append(f.pid)
        if remote and self.job_id:
            argv = remote_signal_argv(self.job_id, signal.Signals(sig).name.removeprefix("SIG"), remote)
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(
                    [shutil.which("srun") or "srun", *argv[1:]],
                    capture_output=True, timeout=30, env=job_env(os.environ), stdin=subprocess.DEVNULL,
                )  # fmt: skip

    def stop(self) -> None:
        if self.mode == "steps":
            if self.step:
                subprocess.run(["scancel", self.target], capture_output=True, timeout=30)
            if self.proc is not None:
                self.proc.kill()
                self.proc.wait()
        elif self.job_id:
            subprocess.run(["scancel", self.job_id], capture_output=True, timeout=30)

    @property
    def local_pids(self) -> list[int]:
        """Processes of ours on this machine that the kernel's reaper must end."""
        return [self.proc.pid] if self.proc is not None else []


ENGINES_NAME = "gpuhub-engines"
QUEUE_POLL_MAX = 5.0  # seconds between squeue calls while the engines' job waits


def _utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def jobs_hidden(config: str | None) -> bool:
    """Whether Slurm shows this user only their own jobs, from ``scontrol show config``
    (``PrivateData`` naming ``jobs``); True when it could not be read: a place counted among
    jobs one may not see would be wrong, so none is claimed (pure)."""
    if config is None:
        return True
    for line in config.splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "PrivateData":
            return "jobs" in {v.strip().lower() for v in value.split(",")}
    return False


def queue_line(listing, job_id: str, gpus: int, now: datetime, hidden: bool = False) -> str | None:
    """The wait line of the engines' job ``job_id`` in ``listing`` (``squeue.Listing`` of
    ``squeue --json``), or None once it is no longer waiting (running, ended, gone). A
    listing that could not be read (None) or that skipped the job keeps it waiting, with
    what Slurm last said unknown. ``hidden``: the listing holds only this user's jobs
    (:func:`jobs_hidden`), so the line counts no place."""
    from spawner.slurm import priority, squeue

    if listing is None or job_id in listing.unreadable:
        return f"Queued in Slurm as engines job {job_id}; Slurm does not answer right now"
    job = listing.jobs.get(str(job_id))
    if job is None or not job.pending:
        return None
    if hidden:
        return priority.wait_message(job, None, gpus, now, what="engines job", place_hidden=True)
    position = squeue.queue_positions(listing.queue, [job.job_id]).get(job.job_id)
    return priority.wait_message(job, position, gpus, now, what="engines job")


def _display_line() -> Callable[[str], None]:
    """One output of the cell, replaced at each call (outside a kernel: printed lines)."""
    try:
        from IPython import get_ipython
        from IPython.display import display, update_display
    except ImportError:  # pragma: no cover - IPython is a dependency of the magics
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        return lambda line: print(line, flush=True)
    handle = None

    def show(line: str) -> None:
        nonlocal handle
        if handle is None:
            handle = display({"text/plain": line}, raw=True, display_id=True)
        else:
            update_display({"text/plain": line}, raw=True, display_id=handle.display_id)

    return show


def job_env(environ) -> dict[str, str]:
    """sbatch's environment from inside the server's job: without the job's own SLURM_*,
    SBATCH_* and SRUN_* variables, which sbatch and srun would read as options (the server's
    memory and CPUs, its job id) for the engines' job."""
    return {k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))} | (
        {"SLURM_CONF": environ["SLURM_CONF"]} if "SLURM_CONF" in environ else {}
    )


def autosave_env(autosave: tuple[list[str], str] | None) -> dict[str, str]:
    """The engines' ``GPUHUB_AUTOSAVE_NAMES`` / ``GPUHUB_AUTOSAVE_DIR`` (pure): always both,
    empty without autosave (so a value inherited from the server's own environment never
    reaches the engines)."""
    from gpu_magics.engine.checkpoints import AUTOSAVE_DIR, AUTOSAVE_NAMES

    names, directory = autosave if autosave and autosave[0] else ([], "")
    return {AUTOSAVE_NAMES: " ".join(names), AUTOSAVE_DIR: directory}


def preemption_report(directory: str, job_id: str) -> str | None:
    """What the engines of ``job_id`` saved when Slurm preempted them (their line), or None
    when they recorded nothing (not preempted, or no autosave)."""
    import json

    from gpu_magics.engine.checkpoints import preempt_report_path

    try:
        with open(preempt_report_path(directory, str(job_id))) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return None
    text = report.get("text") if isinstance(report, dict) else None
    return text if isinstance(text, str) else None


def remote_signal_argv(job_id: str, name: str, pids_by_node: dict[str, list[int]]) -> list[str]:
    """The ``srun`` that sends signal ``name`` (``INT``, ``USR1``, ``KILL``) to these engine
    pids on their nodes (pure): one task per node, a step of the engines' job that overlaps
    the engines' step and takes no GPU; each task signals only its own node's pids."""
    nodes = sorted(pids_by_node)
    cases = " ".join(
        f"{shlex.quote(n)}) kill -s {name} {' '.join(str(int(p)) for p in pids_by_node[n])} ;;" for n in nodes
    )
    return [
        "srun", f"--jobid={job_id}", "--overlap", "--gres=none", f"--nodes={len(nodes)}",
        "--ntasks-per-node=1", f"--nodelist={','.join(nodes)}", "--kill-on-bad-exit=0", "--quiet",
        "/bin/sh", "-c", f'case "$SLURMD_NODENAME" in {cases} esac 2>/dev/null; exit 0',
    ]  # fmt: skip


def engine_argv(cluster) -> list[str]:
    """The engine's command as each Slurm task runs it, joined to this pool's cluster."""
    return [*ENGINE_CMD, f"--profile-dir={cluster.profile_dir}", f"--cluster-id={cluster.cluster_id}"]


def server_launcher(
    gpus: int, nodes: int | None, gpus_per_node: int | None, environ=None
) -> tuple[SlurmLauncher, int]:
    """(launcher, GPUs of this server's own job) for a pool of ``gpus`` ranks: a step of the
    server's job when it holds the GPUs, else a burst job of their own (admitted by the broker,
    placed by Slurm over ``--nodes``). What the server's job is, is read here, from what Slurm
    and the spawner set in its environment. Raises ``ValueError`` for a shape that cannot be
    launched (:func:`plan_launch`)."""
    env = os.environ if environ is None else environ
    own = len([g for g in env.get("SLURM_JOB_GPUS", "").split(",") if g.strip()])
    mode, nodes, per_node = plan_launch(own, gpus, nodes, gpus_per_node)
    launcher = SlurmLauncher(
        mode,
        nodes,
        per_node,
        os.path.expanduser("~"),
        env.get("SLURM_JOB_PARTITION", ""),
        env.get("GPUHUB_SLURM_ACCOUNT", ""),
    )
    return launcher, own
