"""``gpuhub limits show|set|unset``: the GPU limits in force and where each comes from; a set or
unset is written to Slurm's associations too when ``c.SlurmAccounting.enabled``."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import TYPE_CHECKING

from gpu_magics.common import words
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import UsageError, format_table, parse_name, print_json
from spawner.cli.parsers import actions, command
from spawner.policy import values
from spawner.policy.limits import (
    DEFAULT_WINDOW_HOURS,
    MAX_GPU_HOURS,
    MAX_LIMIT_GPUS,
    MAX_WINDOW_HOURS,
    MIN_WINDOW_HOURS,
    Limit,
    parse_limit_field,
)

if TYPE_CHECKING:
    from spawner.ledger import Ledger
    from spawner.settings import GpuHub


def _limit_field(name: str):
    """``parse_limit_field`` as a parser of option text."""

    def parse(raw: str, field: str):
        return parse_limit_field(name, raw, field=field, text=True)

    parse.__name__ = f"parse_{name}"
    return parse


def register(sub) -> None:
    limits = actions(sub, "limits", "show and set GPU limits")
    command(limits, "show", run, json_output=True, help="every limit in force and where it comes from")
    lset = command(limits, "set", run, help="set a limit (wins over c.GpuHub.*_limit(s))")
    who = lset.add_mutually_exclusive_group(required=True)
    who.add_argument("--default", metavar="N", help="GPUs anyone may hold at once")
    who.add_argument("--group", nargs=2, metavar=("GROUP", "N"))
    who.add_argument("--user", nargs=2, metavar=("USER", "N"))
    lset.add_argument(
        "--gpu-hours",
        type=values.argparse_type(_limit_field("gpu_hours"), "--gpu-hours"),
        help=f"GPU-hours allowed per window (0 to {MAX_GPU_HOURS:g})",
    )
    lset.add_argument(
        "--window-hours",
        type=values.argparse_type(_limit_field("window_hours"), "--window-hours"),
        default=DEFAULT_WINDOW_HOURS,
        help=f"the window the GPU-hours count over ({MIN_WINDOW_HOURS:g} to {MAX_WINDOW_HOURS:g} hours; "
        f"default {DEFAULT_WINDOW_HOURS:g})",
    )
    lunset = command(limits, "unset", run, help="remove a ledger limit, returning to the config's")
    who = lunset.add_mutually_exclusive_group(required=True)
    who.add_argument("--default", action="store_true")
    who.add_argument("--group", metavar="GROUP")
    who.add_argument("--user", metavar="USER")


def run(args: argparse.Namespace, out) -> int:
    settings = load_settings(args)
    ledger = open_ledger(settings)
    code = _limits(args, ledger, out)
    if args.action != "show":
        _sync_slurm_after(settings, ledger, args, out)
    return code


def parse_count_or_unlimited(text: str) -> int | None:
    if text.strip().lower() in ("unlimited", "none"):
        return None
    try:
        return parse_limit_field("max_gpus", text, field="a limit", text=True)
    except values.BadValue:
        raise UsageError(
            f"a limit must be a whole number from 0 to {MAX_LIMIT_GPUS} or 'unlimited'; "
            f"got {values.show(text)}"
        ) from None


def _fmt_limit(limit: Limit) -> tuple[str, str]:
    gpus = "unlimited" if limit.max_gpus is None else str(limit.max_gpus)
    hours = "-" if limit.gpu_hours is None else f"{limit.gpu_hours:g} per {limit.window_hours:g} h"
    return gpus, hours


def _limits(args: argparse.Namespace, ledger: Ledger, out) -> int:
    if args.action == "show":
        if args.json:
            entries = [
                {"scope": e.scope, "name": e.name, "origin": e.origin, **asdict(e.limit)}
                for e in ledger.limit_entries()
            ]
            ignored = [{"scope": sc, "name": n, "problem": pr} for sc, n, pr in ledger.ignored_limits()]
            return print_json({"limits": entries, "ignored": ignored}, out)
        rows = []
        for e in ledger.limit_entries():
            gpus, hours = _fmt_limit(e.limit)
            rows.append((e.scope, e.name or "*", gpus, hours, e.origin))
        print(format_table(("SCOPE", "NAME", "MAX GPUS", "GPU-HOURS", "FROM"), rows), file=out)
        for scope, name, problem in ledger.ignored_limits():
            who = "default" if scope == "default" else f"{scope} {name}"
            print(f"ignored: the ledger's {who} limit ({problem}); set it again or unset it", file=out)
        return 0
    if args.default is not None and args.default is not False:
        scope, name, value = "default", "", args.default
    elif args.group:
        scope, name, value = ("group", *args.group) if args.action == "set" else ("group", args.group, None)
    else:
        scope, name, value = ("user", *args.user) if args.action == "set" else ("user", args.user, None)
    if scope != "default" and args.action == "set":  # unset finds whatever is stored
        name = parse_name(name, f"--{scope}", spaces=scope == "group")
    if args.action == "unset":
        if ledger.unset_limit(scope, name):
            print(f"removed the ledger's {scope} limit{' for ' + name if name else ''}", file=out)
            return 0
        print(f"no ledger {scope} limit{' for ' + name if name else ''} to remove", file=out)
        return 1
    limit = Limit(
        max_gpus=parse_count_or_unlimited(value),
        gpu_hours=args.gpu_hours,
        window_hours=args.window_hours,
    )
    try:
        ledger.set_limit(scope, name, limit)
    except ValueError as e:
        raise UsageError(str(e)) from None
    gpus = "unlimited GPUs" if limit.max_gpus is None else words.count(limit.max_gpus, "GPU")
    hours = (
        "no GPU-hours quota"
        if limit.gpu_hours is None
        else f"{limit.gpu_hours:g} GPU-hours per {limit.window_hours:g} h"
    )
    print(f"{scope} limit{' for ' + name if name else ''}: {gpus}, {hours}", file=out)
    return 0


def _sync_slurm_after(settings: GpuHub, ledger: Ledger, args: argparse.Namespace, out) -> None:
    """With ``c.SlurmAccounting.enabled``, write the changed limits to Slurm's associations:
    the named user's, or every known user's after a default or group change."""
    from spawner.slurm import SlurmError
    from spawner.slurm.accounting import SlurmAccounting

    accounting = SlurmAccounting(config=settings.config)
    if not accounting.enabled:
        return
    users = None
    if args.user:
        name = args.user[0] if isinstance(args.user, list | tuple) else args.user
        users = sorted({name, *ledger.effective_limits()})
    try:
        for argv in accounting.sync(ledger, users):
            print("slurm: " + " ".join(argv[2:]), file=out)
    except SlurmError as e:
        raise UsageError(f"the ledger is updated, but Slurm's accounting is not: {e}") from None
