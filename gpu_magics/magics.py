"""``%%distributed``: run a cell on one warm engine per GPU with torch.distributed ready.

    %%distributed --gpus 4 [--nodes M] [--gpus-per-node K] [--backend gloo|nccl]
                  [--timeout S] [--output all|rank0] [--targets 0,2-3]
    %distributed shutdown | status

GPUs come from the server's own allocation when it holds enough; otherwise from a burst
allocation of the gpuhub broker (within the user's limit), whose lease is renewed while the
pool lives and released when the pool stops or has been idle for ``idle_seconds``.
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
from .brokerclient import BrokerClient, BrokerError, LeaseKeeper
from .pool import CellOutcome, EnginePool
from .ranks import Slot, choose_slots, make_rank_specs
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
    return burst.get("gpu_count") or len(burst["gpus"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(outcome: CellOutcome, pool: EnginePool) -> str:
    lines = []
    for r in outcome.failed:
        info = pool.infos[r.rank] if r.rank < len(pool.infos) else {}
        slot = pool.specs[r.rank].slot
        where = f"node {slot.node}, GPU {slot.label}, pid {info.get('pid', '?')}"
        if r.status == "died":
            lines.append(f"rank {r.rank} ({where}) died: its engine process ended during the cell.")
        elif r.status == "killed":
            lines.append(f"rank {r.rank} ({where}) did not finish after the others failed; it was stopped.")
        elif r.status == "interrupted":
            lines.append(f"rank {r.rank} ({where}) was interrupted.")
        else:
            lines.append(f"rank {r.rank} ({where}) raised {r.ename}: {r.evalue}")
            if r.traceback:
                lines += ["    " + t for t in r.traceback.splitlines()]
    if outcome.broken:
        lines.append("The pool lost its process group; the next %%distributed cell starts fresh engines.")
    return "\n".join(lines)


@magics_class
class DistributedMagics(Magics):
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

    def _acquire(self, gpus: int) -> list[Slot]:
        own = server_gpus()
        mine = choose_slots(own.gpus, gpus)
        if mine and len({s.node for s in mine}) == 1:
            return mine
        client = BrokerClient.from_env()
        if client is None:
            held = len(own.gpus)
            raise UsageError(
                f"%%distributed --gpus {gpus} needs {gpus} GPUs; this server holds {held} and no gpuhub "
                "broker is configured (GPUHUB_BROKER_URL). Ask for at most "
                f"{held} GPUs, or start the server with more."
            )
        try:
            # engines run on this machine: the burst must be on one node
            alloc = client.request(gpus, 1, None, self.lease_seconds)
        except BrokerError as e:
            extra = f" Own server GPUs: {len(own.gpus)}." if own.gpus else ""
            raise UsageError(f"gpuhub refused {gpus} GPUs for %%distributed: {e.message}{extra}") from None
        self.burst = alloc
        self.lease = LeaseKeeper(client, alloc, self.lease_seconds, log=print, activity=self._idle_seconds)
        return [Slot(g["node"], g["index"]) for g in alloc["gpus"]]

    def _release_burst(self) -> None:
        if self.lease:
            self.lease.stop()
            self.lease = None
        if self.burst:
            client = BrokerClient.from_env()
            if client:
                try:
                    client.release(self.burst["id"])
                except BrokerError as e:
                    print(f"gpuhub: could not release allocation {self.burst['id']}: {e}")
            self.burst = None

    # pool -----------------------------------------------------------------------------

    def _slurm_pool(self, args, timeout: float) -> EnginePool:
        """Engines as Slurm tasks: a step of this server's job when it holds the GPUs, else a
        burst job of their own (admitted by the broker, placed by Slurm over ``--nodes``)."""
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
        if mode == "job":
            client = BrokerClient.from_env()
            if client is None:
                raise UsageError(
                    f"%%distributed --gpus {args.gpus} needs a burst job, and no gpuhub broker is "
                    f"configured (GPUHUB_BROKER_URL). This server's job holds {own} GPUs."
                )
            try:
                alloc = client.request(args.gpus, nodes, per_node, self.lease_seconds)
            except BrokerError as e:
                raise UsageError(
                    f"gpuhub refused {args.gpus} GPUs for %%distributed: {e.message} Own server GPUs: {own}."
                ) from None
            self.burst = alloc
            self.lease = LeaseKeeper(
                client, alloc, self.lease_seconds, log=print, activity=self._idle_seconds
            )
            launcher.allocation_id = alloc["id"]
            launcher.on_submitted = lambda job_id: alloc.update(client.attach_job(alloc["id"], job_id))
        return EnginePool([], args.backend, timeout, launcher=launcher, n=args.gpus)

    def _ensure_pool(self, args) -> EnginePool:
        timeout = args.timeout or self.timeout
        shape = (args.gpus, args.nodes, args.gpus_per_node)
        on_slurm = os.environ.get("GPUHUB_BACKEND") == "slurm"
        key = (shape, args.backend, timeout)
        with self.lock:
            lost = self._lease_lost()
            if self.pool is not None and (self.key != key or self.pool.broken or lost):
                why = (
                    "lost its burst allocation"
                    if lost
                    else "was left broken by the last cell"
                    if self.pool.broken
                    else "had other settings"
                )
                print(f"gpuhub: restarting the engines (the pool {why}).")
                # the GPUs stay ours unless the number of ranks changed
                self._stop_pool(release=lost or self.key[0] != shape)
            if self.burst is not None and (
                (on_slurm and self.pool is None) or _burst_size(self.burst) != args.gpus or self._lease_lost()
            ):
                # a Slurm burst's job ends with its engines: a new pool asks anew
                self._release_burst()
            if self.pool is None:
                try:
                    if on_slurm:
                        pool = self._slurm_pool(args, timeout)
                    else:
                        slots = self._current_slots() if self.burst else self._acquire(args.gpus)
                        pool = EnginePool(
                            make_rank_specs(slots, "127.0.0.1", free_port()), args.backend, timeout
                        )
                    pool.report_allocation = self.burst["id"] if self.burst else 0
                    handle = display(f"Starting engines: 0 of {pool.size} up", display_id=True)

                    def progress(up, n):
                        update_display(f"Starting engines: {up} of {n} up", display_id=handle.display_id)

                    try:
                        pool.start(progress)
                    except BaseException:
                        pool.stop()
                        raise
                except BaseException:
                    self._release_burst()  # nothing may keep GPUs that no engine uses
                    raise
                update_display(
                    f"{pool.size} engines up: "
                    + ", ".join(f"rank {s.rank} on {s.slot.label}" for s in pool.specs),
                    display_id=handle.display_id,
                )
                self.pool, self.key = pool, key
                self._arm_idle_timer()
            self.busy += 1  # under the lock: the idle timer cannot slip in before the cell runs
            self._touch()
            return self.pool

    def _lease_lost(self) -> bool:
        return bool(self.lease and self.lease.lost)

    def _current_slots(self) -> list[Slot]:
        return [Slot(g["node"], g["index"]) for g in self.burst["gpus"]]

    def _stop_pool(self, release: bool = True) -> None:
        if self.pool is not None:
            self.pool.stop()
            self.pool = None
            self.key = None
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
                self._stop_pool()
                return
            if not self.busy and time.monotonic() - self.last_used >= self.idle_seconds:
                print(f"gpuhub: the engines were idle for {self.idle_seconds:.0f} s; stopping them.")
                self._stop_pool()
                return
        self._arm_idle_timer()

    def shutdown(self) -> None:
        with self.lock:
            if self._idle_timer:
                self._idle_timer.cancel()
            self._stop_pool()

    # the magic ------------------------------------------------------------------------

    @magic_arguments.magic_arguments()
    @magic_arguments.argument("command", nargs="?", choices=["shutdown", "status"], help="line form only")
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
            if args.command == "shutdown":
                had = self.pool is not None or self.burst is not None
                self.shutdown()
                print(
                    "gpuhub: engines stopped and burst GPUs released." if had else "gpuhub: no pool to stop."
                )
                return None
            if args.command == "status":
                print(self.describe())
                return None
            raise UsageError("line form: %distributed shutdown | %distributed status")
        if args.command:
            raise UsageError(f"{args.command!r} is a line command: %distributed {args.command}")
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
        try:
            targets = parse_targets(args.targets, pool.size) if args.targets else None
            grace = min(args.timeout or self.timeout, 30)
            outcome = pool.run(cell, output=args.output, grace=grace, ranks=targets)
        finally:
            with self.lock:
                self.busy -= 1
                self._touch()
        if outcome.interrupted:
            print(report(outcome, pool), file=sys.stderr)
            raise KeyboardInterrupt
        if outcome.failed:
            raise DistributedError(report(outcome, pool))
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
