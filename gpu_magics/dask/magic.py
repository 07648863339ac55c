"""``%dask_cuda``: a Dask cluster with one worker per GPU of this session, from one line.

    %dask_cuda --gpus N [--name client]             # dask_cuda.LocalCUDACluster, one worker per GPU
    %dask_cuda --cpu [--workers N] [--name client]  # distributed.LocalCluster, no GPUs (N default 2)
    %dask_cuda status | shutdown

GPUs: the server's own when it holds N (``--gpus`` defaults to all of them), else a burst of the
gpuhub broker on one node, renewed while the cluster lives and released by ``shutdown``, at
kernel exit, or (closing the cluster) when the hub reports it lost. dask-cuda pins each worker to
the CPUs nearest its GPU (NVML's affinity) by default, and that stays on. Checked before any GPU
is taken: NVML works, dask-cuda imports, and no burst on Slurm (it would be another node). One
cluster at a time; ``--cpu`` with ``--gpus`` is refused. The Client goes in the user namespace
under ``--name`` and leaves it at shutdown.
"""

from __future__ import annotations

import atexit
import keyword
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from traitlets import Float

from gpu_magics.common.ranks import Slot, choose_slots
from gpu_magics.common.session import backend, server_gpus
from gpu_magics.dask.private import Private
from gpu_magics.kernel.arguments import COUNT, parse_line
from gpu_magics.kernel.burst import Burst
from gpu_magics.kernel.notices import when
from gpu_magics.report.gpustats import nvml_problem

USAGE = (
    "usage: %dask_cuda --gpus N [--name client] | %dask_cuda --cpu [--workers N] [--name client] "
    "| %dask_cuda status | %dask_cuda shutdown"
)
CPU_HINT = "To try Dask without GPUs: %dask_cuda --cpu --workers N."
INSTALL = "pip install 'jupyterhub-gpuhub[dask-cuda]'"


@dataclass(frozen=True)
class DaskRequest:
    kind: str  # "gpu" (LocalCUDACluster) or "cpu" (LocalCluster)
    workers: int
    name: str


@dataclass(frozen=True)
class DaskPlan:
    slots: tuple[Slot, ...]  # the server's own GPUs to use; empty: a burst is needed
    devices: str  # CUDA_VISIBLE_DEVICES for LocalCUDACluster ("" until a burst is granted)


def parse_request(gpus: int | None, cpu: bool, workers: int | None, name: str, own_gpus: int) -> DaskRequest:
    """The start form's options checked; ``own_gpus`` is what ``--gpus`` defaults to."""
    if cpu and gpus is not None:
        raise UsageError(f"--cpu starts workers without GPUs: size it with --workers N, not --gpus\n{USAGE}")
    if not cpu and workers is not None:
        raise UsageError(
            f"--workers goes with --cpu; with GPUs there is one worker per GPU: --gpus N\n{USAGE}"
        )
    if cpu:
        n, option = (2 if workers is None else workers), "--workers"
    elif gpus is None and not own_gpus:
        raise UsageError(
            f"this server holds no GPUs: say how many, %dask_cuda --gpus N (or --cpu: no GPUs)\n{USAGE}"
        )
    else:
        n, option = (own_gpus if gpus is None else gpus), "--gpus"
    if n < 1:
        raise UsageError(f"{option} must be 1 or more; got {n}\n{USAGE}")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise UsageError(f"--name must be a Python variable name, e.g. client; got {name!r}\n{USAGE}")
    return DaskRequest("cpu" if cpu else "gpu", n, name)


def make_devices(slots: Sequence[Slot], own: Sequence[Slot], cuda_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for ``slots``: the server's own entries at those GPUs' positions when
    it has one per GPU (Slurm may renumber them), else the node's indices (PCI bus order)."""
    entries = [e.strip() for e in (cuda_visible or "").split(",") if e.strip()]
    if own and len(entries) == len(own):
        return ",".join(entries[list(own).index(s)] for s in slots)
    return ",".join(str(s.index) for s in slots)


def plan_dask(own_gpus: Sequence[str], n: int, on_slurm: bool, cuda_visible: str | None = None) -> DaskPlan:
    """The server's own GPUs when it holds ``n`` on one node; else a burst (refused on Slurm)."""
    mine = choose_slots(own_gpus, n)
    if mine and len({s.node for s in mine}) == 1:
        own = [Slot.parse(g) for g in own_gpus if g]
        return DaskPlan(tuple(mine), make_devices(mine, own, cuda_visible))
    if on_slurm:
        held = len([g for g in own_gpus if g])
        raise UsageError(
            f"%dask_cuda --gpus {n}: this server holds {held} GPUs, and on Slurm more would come as a "
            "job on another node, which a Dask cluster started here cannot reach. Start the server "
            f"with {n} GPUs, or use %%distributed --gpus {n} (it runs engines on other nodes)."
        )
    return DaskPlan((), "")


def load_local_cuda_cluster():
    """``dask_cuda.LocalCUDACluster``, or a UsageError saying what to do; takes no GPU."""
    reason = nvml_problem()
    if reason:
        raise UsageError(
            f"%dask_cuda needs an NVIDIA GPU: no NVIDIA GPU or driver can be used here ({reason}). {CPU_HINT}"
        )
    try:
        from dask_cuda import LocalCUDACluster
    except Exception as e:  # without CUDA's libraries the import fails in odd ways, not only ImportError
        raise UsageError(
            f"%dask_cuda needs dask-cuda, which cannot be imported here ({type(e).__name__}: {e}). "
            f"Install it into this kernel's environment: {INSTALL} (dask-cuda with its CUDA "
            f"extra, dask-cuda[cu12]). {CPU_HINT}"
        ) from None
    return LocalCUDACluster


@magics_class
class DaskMagics(Magics):
    lease_seconds = Float(
        300.0,
        help="Lease asked for burst GPUs, renewed every third of it. %config DaskMagics.lease_seconds = 120",
    ).tag(config=True)

    def __init__(self, shell=None, **kw):
        super().__init__(shell=shell, **kw)
        self.cluster = self.client = self.private = None
        self.kind, self.name, self.labels = "", "", ()
        self.burst: Burst | None = None
        self.lock = threading.RLock()
        atexit.register(self.shutdown)  # kernel exit: no orphaned workers, burst GPUs back

    def _acquire_burst(self, n: int, held: int) -> list[Slot]:
        """A burst of ``n`` GPUs on one node (the workers run here), watched for the hub ending it."""
        self._last_busy = time.monotonic()
        burst = Burst.request(
            "%dask_cuda", n, lease_seconds=self.lease_seconds, nodes=1, held=held, activity=self._idle_seconds
        )
        self.burst = burst
        burst.watch(self._burst_lost, min(5.0, self.lease_seconds / 3))
        # the workers' GPUs are on this machine: this kernel reports their use (idle reclaim)
        burst.report_here()
        return burst.slots

    def _idle_seconds(self) -> float | None:
        """Seconds since the cluster last had tasks (0 while it has some): the broker's idle
        reclaim counts a busy Dask cluster busy even when its GPUs are not."""
        client = self.client
        if client is None:
            return None
        try:
            busy = any(client.processing().values())
        except Exception:  # the scheduler is going away: say nothing rather than guess
            return None
        if busy:
            self._last_busy = time.monotonic()
            return 0.0
        return time.monotonic() - self._last_busy

    def _burst_lost(self, burst: Burst) -> None:
        if self.burst is not burst:
            return
        why = f" ({burst.reason})" if burst.reason else ""
        print(f"gpuhub: the hub released the burst GPUs of %dask_cuda{why}; closing the Dask cluster.")
        self.shutdown()

    def _release_burst(self) -> None:
        if self.burst is not None:
            self.burst.release()  # once; says so when the broker could not be told
        self.burst = None

    def start(self, req: DaskRequest) -> None:
        with self.lock:
            if self.cluster is not None:
                raise UsageError(
                    f"a Dask cluster is already running ({self.kind}, {len(self.labels) or 'no'} GPUs); "
                    "run %dask_cuda shutdown first"
                )
            from distributed import Client, LocalCluster

            if req.kind == "cpu":
                make, labels = LocalCluster, ()
                options = {"threads_per_worker": 1, "processes": True}
            else:
                own = server_gpus()
                on_slurm = backend() == "slurm"
                plan = plan_dask(own.pool_gpus, req.workers, on_slurm, own.cuda_visible_devices)
                make = load_local_cuda_cluster()  # checked before any GPU is taken
                slots = plan.slots or tuple(self._acquire_burst(req.workers, len(own.pool_gpus)))
                labels = tuple(s.label for s in slots)
                options = {"CUDA_VISIBLE_DEVICES": plan.devices or make_devices(slots, (), None)}
            cluster = private = None
            try:
                import dask

                private = Private.make()
                with dask.config.set(private.config()):
                    cluster = private.cluster_class(make)(
                        n_workers=req.workers, **private.options(), **options
                    )
                client = Client(cluster, security=private.security)
            except BaseException:
                if cluster is not None:
                    cluster.close()
                if private is not None:
                    private.remove()
                self._release_burst()  # nothing may keep GPUs that no worker uses
                raise
            self.cluster, self.client, self.private = cluster, client, private
            self.kind = "LocalCluster (CPU only)" if req.kind == "cpu" else "dask-cuda LocalCUDACluster"
            self.name, self.labels = req.name, labels
            self.shell.user_ns[req.name] = client
        where = "worker" + "s" * (req.workers > 1)
        where = f"{where} on GPUs {', '.join(labels)}" if labels else f"CPU {where} (no GPUs)"
        if self.burst:
            where += f" (burst allocation #{self.burst.id})"
        print(
            f"Dask cluster up: {req.workers} {where}; dashboard {client.dashboard_link or 'none'}; "
            f"the Client is `{req.name}`."
        )

    def shutdown(self) -> bool:
        """Close the client and the cluster, release a burst; True if anything was running."""
        with self.lock:
            had = self.cluster is not None or self.burst is not None
            client, cluster, self.client, self.cluster = self.client, self.cluster, None, None
            for part in (client, cluster):
                try:
                    if part is not None:
                        part.close()
                except Exception as e:  # at kernel exit distributed may have closed them first
                    print(f"gpuhub: closing the Dask {type(part).__name__}: {e!r}")
            if client is not None and self.shell is not None and self.shell.user_ns.get(self.name) is client:
                del self.shell.user_ns[self.name]
            if self.private is not None:
                self.private.remove()
                self.private = None
            self._release_burst()
            self.kind, self.labels = "", ()
            return had

    def describe(self) -> str:
        with self.lock:
            if self.cluster is None:
                return "%dask_cuda: no cluster (start one: %dask_cuda --gpus N, or --cpu --workers N)"
            pids = self.client.run(os.getpid)
            lines = [
                f"{self.kind}: {len(pids)} workers (pids {', '.join(str(p) for p in pids.values())})",
                f"GPUs: {', '.join(self.labels) or 'none'}",
                f"dashboard: {self.client.dashboard_link or 'none'}",
                f"client: {self.name}",
            ]
            if self.burst:
                lost = " (lost: the hub released it)" if self.burst.lost else ""
                until = when(self.burst.expires) or "unknown"
                lines.append(f"burst allocation #{self.burst.id}: lease until {until}{lost}")
            return "\n".join(lines)

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("command", nargs="?", choices=["shutdown", "status"])
    @magic_arguments.argument(
        "--gpus", type=COUNT("--gpus"), help="workers, one per GPU (default: the server's GPUs)"
    )
    @magic_arguments.argument("--cpu", action="store_true", help="a cluster without GPUs")
    @magic_arguments.argument(
        "--workers", type=COUNT("--workers"), help="with --cpu: how many workers (default 2)"
    )
    @magic_arguments.argument("--name", default="client", help="the Client's variable (default: client)")
    @line_magic
    def dask_cuda(self, line: str = ""):
        """Start a Dask cluster with one worker per GPU (CPU affinity set by dask-cuda), or --cpu."""
        args = parse_line(self.dask_cuda, line, USAGE)
        if args.command:
            if args.gpus is not None or args.cpu or args.workers is not None or args.name != "client":
                raise UsageError(f"%dask_cuda {args.command} takes no options\n{USAGE}")
            if args.command == "status":
                print(self.describe())
            else:
                burst = self.burst is not None
                stopped = self.shutdown()
                print(
                    ("gpuhub: Dask cluster closed" + (" and burst GPUs released." if burst else "."))
                    if stopped
                    else "gpuhub: no Dask cluster to close."
                )
            return
        own = len(server_gpus().pool_gpus)
        self.start(parse_request(args.gpus, args.cpu, args.workers, args.name, own))
