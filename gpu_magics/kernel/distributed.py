"""``%%distributed``: run a cell on one warm engine per GPU with torch.distributed ready.

    %%distributed --gpus 4 [--nodes M] [--gpus-per-node K] [--backend gloo|nccl]
                  [--timeout S] [--output all|rank0] [--targets 0,2-3]
    %distributed shutdown | status | save NAME... [--dir D] | restore NAME... [--dir D]

This module holds the magic's argument table and its dispatch (:class:`DistributedMagics`) and
:func:`register`. GPUs come from the server's own allocation first; beyond it, only the
difference comes as a burst allocation of the gpuhub broker on the same node (within the user's
limit; ``acquire``), whose lease is renewed while the pool lives and released when the pool
stops or has been idle for ``idle_seconds`` (``lifecycle``, ``burst.Burst``). A change that
needs new engines is checked first (the broker asked, the engines' variables looked at): a
refusal leaves the pool as it is, and a pool holding the user's variables is only replaced with
``--restart`` or autosave. Borrowed GPUs taken back: ``preemption``; what a cell's outcome is
and how it is shown: ``outcome``.
"""

from __future__ import annotations

import argparse
import os
import sys

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from traitlets import Bool, Float

from gpu_magics.common.checkpoint import DEFAULT_DIR
from gpu_magics.common.session import backend, server_gpus
from gpu_magics.common.words import count
from gpu_magics.kernel.acquire import kept_settings
from gpu_magics.kernel.arguments import COUNT, SECONDS, parse_line
from gpu_magics.kernel.burst import Burst
from gpu_magics.kernel.checkpoints import CheckpointCommands, check_names
from gpu_magics.kernel.lifecycle import Lifecycle
from gpu_magics.kernel.notices import when
from gpu_magics.kernel.outcome import (
    DistributedError,
    DistributedInterrupt,
    RankResult,
    parse_targets,
    report,
)
from gpu_magics.kernel.pool import EnginePool

USAGE = (
    "usage: %%distributed --gpus N [--nodes M] [--backend gloo|nccl] [--timeout S] "
    "[--output all|rank0] [--targets 0,2-3] [--restart] [--autosave NAME... [--dir D]]\n"
    "       %distributed shutdown | status | save NAME... [--dir D] | restore NAME... [--dir D]"
)


@magics_class
class DistributedMagics(CheckpointCommands, Magics):
    """The magic: its settings, its arguments and what each command does. The pool's life is
    :attr:`lifecycle`'s, its preemption :attr:`preemption`'s; ``pool``, ``busy``, ``last_used``,
    ``lock``, ``_touch`` and ``_lease_lost`` are what the checkpoint commands use of them."""

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

    resize_in_place = Bool(
        True,
        help="Change a pool's size without restarting its ranks: when its borrowed GPUs are taken "
        "back, the other ranks go on in their own processes with every variable (DDP models go on, "
        "FSDP2 models are resharded onto them); a cell asking for more GPUs adds ranks that join "
        "the others, with a copy of rank 0's names. False: the whole pool is stopped (saved first "
        "with --autosave) and a bigger one needs --restart or --autosave, as before. "
        "%config DistributedMagics.resize_in_place = False",
    ).tag(config=True)

    verbose = Bool(
        False,
        help="Show every line of a resize's autosave and restore (each file, each name's kind); "
        "by default a resize says what it saved and restored in a line each. "
        "%config DistributedMagics.verbose = True",
    ).tag(config=True)

    def __init__(self, shell=None, **kw):
        super().__init__(shell=shell, **kw)
        self.lifecycle = Lifecycle(settings=self, autosave=self)
        self.preemption = self.lifecycle.preemption
        self.lock = self.lifecycle.lock
        self._parsed: dict = {}  # a line's arguments, parsed once (``_arguments``)

    @property
    def pool(self) -> EnginePool | None:
        return self.lifecycle.pool

    @property
    def burst(self) -> Burst | None:
        return self.lifecycle.burst

    @property
    def busy(self) -> int:
        return self.lifecycle.busy

    @busy.setter
    def busy(self, value: int) -> None:
        self.lifecycle.busy = value

    @property
    def last_used(self) -> float:
        return self.lifecycle.last_used

    def _touch(self) -> None:
        self.lifecycle.touch()

    def _lease_lost(self) -> bool:
        return self.lifecycle.lease_lost()

    def shutdown(self, why: str = "exit") -> None:
        self.lifecycle.shutdown(why)

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
        kept = kept_settings(vars(args), self.lifecycle.key if self.lifecycle.pool is not None else None)
        for name, value in (kept or {}).items():  # a bare cell: the warm pool as it is
            setattr(args, name, value)
        if args.gpus is None:
            own = len(server_gpus().pool_gpus)
            if not own:
                raise UsageError("say how many GPUs: %%distributed --gpus N")
            args.gpus = own
        on_slurm = backend() == "slurm"
        if not on_slurm and ((args.nodes or 1) > 1 or args.gpus_per_node not in (None, args.gpus)):
            raise UsageError(
                "this server runs every engine on its own machine: --nodes 1 only (multi-node "
                "%%distributed needs the Slurm backend)"
            )
        self.preemption.before_cell()  # a preemption notice, or the report of one that stopped the pool
        timeleft = self.lifecycle.timeleft
        timeleft.before_cell()  # a time limit's warning, or its stop (and the report of one)
        pool = self.lifecycle.ensure(args)  # marks the pool busy
        self._set_autosave(args.autosave, args.dir, quiet=True)  # remembered for this pool
        self._hook_exit()  # a new pool: the kernel-exit autosave goes after its own exit hook
        try:
            targets = parse_targets(args.targets, pool.size) if args.targets else None
            grace = min(args.timeout or self.timeout, 30)
            timeleft.refresh_if_changed()  # a new pool's allocations (before_cell read the old one's)

            def tick():  # a notice or a time warning shown, or the cell interrupted at its time
                self.preemption.tick()
                timeleft.tick()

            outcome = pool.run(cell, output=args.output, grace=grace, ranks=targets, tick=tick)
        finally:
            with self.lock:
                self.busy -= 1
                self._touch()
            self.lifecycle.publish()  # JupyterLab's GPU panel: the ranks idle again
        if outcome.broken:
            self.lifecycle.shrink_lost(outcome)  # the others go on without the lost ranks, if they can
            self.lifecycle.publish()
        self.preemption.after_cell(outcome, pool)
        timeleft.after_cell()
        if outcome.interrupted:
            raise DistributedInterrupt(report(outcome, pool)) from None
        if outcome.failed:
            raise DistributedError(report(outcome, pool)) from None
        if outcome.notes:
            print("\n".join(outcome.notes), file=sys.stderr)
        if outcome.result:
            return RankResult(outcome.result)
        return None

    def _arguments(self, line: str) -> argparse.Namespace:
        """The magic's arguments for ``line``: parsed once per distinct line (the parse is pure:
        the same line always gives the same arguments, and argparse took a third of the magic's
        own time per cell), each cell getting its own copy to change."""
        parsed = self._parsed
        args = parsed.get(line)
        if args is None:
            args = parse_line(self.distributed, line, USAGE)
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
        if self.burst is not None:
            for part in self.burst.parts:
                a = part.allocation
                borrowed = (
                    f", {part.borrowed} borrowed beyond your limit (may be taken back with notice)"
                    if part.borrowed
                    else ", started ahead of the queue (may be taken back with notice at its turn)"
                    if a.get("backfill")
                    else ""
                )
                lines.append(
                    f"burst allocation #{a['id']}: {count(part.size, 'GPU')}"
                    + (f" (Slurm job {a['backend_job_id']})" if a.get("backend_job_id") else "")
                    + borrowed
                    + f", lease until {when(part.expires) or 'unknown'}"
                )
        notice = self.preemption.pending_text()
        if notice:
            lines.append(notice)
        if self._autosave_text():
            lines.append(self._autosave_text())
        return "\n".join(lines)


def register(ipython) -> DistributedMagics:
    magics = DistributedMagics(shell=ipython)
    ipython.register_magics(magics)
    os.environ.setdefault("GPUHUB_KERNEL_PID", str(os.getpid()))
    return magics
