"""``gpuhub``: the admin's command line over the GPU ledger.

    gpuhub limits show
    gpuhub limits set --default 1 | --group students 2 | --user alice 4 [--gpu-hours H] [--window-hours W]
    gpuhub limits unset --user alice
    gpuhub gpus
    gpuhub usage [--since 2026-11-01 | --since 7d] [--user alice]
    gpuhub db upgrade
    gpuhub kernel install [--user | --prefix P]

It reads the hub's ``jupyterhub_config.py`` (``--config``; by default the one in the
current directory, if any) for ``c.GpuHub.*``; ``--db-url`` (or ``$GPUHUB_DB_URL``)
overrides the ledger URL. It never changes the inventory: the hub and its broker keep it.
Run it as the hub's account: the ledger is readable only by the hub.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime
from typing import TYPE_CHECKING

# only what parsing the command line needs is imported here: the ledger's modules (SQLAlchemy,
# alembic: most of a second) come in the commands that open a ledger, so --help, a refused
# option or a missing config file answer at once
from spawner.policy import values
from spawner.policy.limits import (
    DEFAULT_WINDOW_HOURS,
    MAX_COUNT,
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


class UsageError(Exception):
    pass


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


def parse_when(text: str, now: datetime, field: str = "the date") -> datetime:
    """``2026-11-01``, ``2026-11-01T12:00`` or a span back from now: ``7d``, ``12h``."""
    try:
        return values.parse_timestamp(text, field, now)
    except values.BadValue as e:
        raise UsageError(str(e)) from None


def parse_name(text: str, field: str, *, spaces: bool = False) -> str:
    try:
        return values.parse_name(text, field, spaces=spaces)
    except values.BadValue as e:
        raise UsageError(str(e)) from None


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt_limit(limit: Limit) -> tuple[str, str]:
    gpus = "unlimited" if limit.max_gpus is None else str(limit.max_gpus)
    hours = "-" if limit.gpu_hours is None else f"{limit.gpu_hours:g} per {limit.window_hours:g} h"
    return gpus, hours


EXIT_CODES = """exit codes:
  0  done
  1  nothing to change (limits unset of a limit the ledger does not have)
  2  bad input or a failure: one line on stderr says what and what to do

--config, --db-url and --json go before or after the command:
  gpuhub gpus --db-url sqlite:////srv/jupyterhub/gpuhub.sqlite --json"""


def _limit_field(name: str):
    """``parse_limit_field`` as a parser of option text."""

    def parse(raw: str, field: str):
        return parse_limit_field(name, raw, field=field, text=True)

    parse.__name__ = f"parse_{name}"
    return parse


def _common(json_output: bool) -> argparse.ArgumentParser:
    """Options every command takes, before or after its name (SUPPRESS: the top level's stay)."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument(
        "--config", "-f", default=argparse.SUPPRESS, help="jupyterhub_config.py to read c.GpuHub from"
    )
    c.add_argument(
        "--db-url", default=argparse.SUPPRESS, help="ledger database URL (overrides c.GpuHub.db_url)"
    )
    if json_output:
        c.add_argument(
            "--json", action="store_true", default=argparse.SUPPRESS, help="print JSON for scripts"
        )
    return c


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpuhub",
        description="Admin commands for the gpuhub GPU ledger.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", "-f", help="jupyterhub_config.py to read c.GpuHub from")
    p.add_argument("--db-url", help="ledger database URL (overrides c.GpuHub.db_url)")
    p.add_argument("--json", action="store_true", help="print JSON (gpus, usage, limits show)")
    plain, with_json = _common(False), _common(True)

    def command(group, name: str, *, json_output: bool = False, **kw) -> argparse.ArgumentParser:
        return group.add_parser(
            name,
            parents=[with_json if json_output else plain],
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kw,
        )

    sub = p.add_subparsers(dest="command", required=True)

    limits = sub.add_parser("limits", help="show and set GPU limits").add_subparsers(
        dest="action", required=True
    )
    command(limits, "show", json_output=True, help="every limit in force and where it comes from")
    lset = command(limits, "set", help="set a limit (wins over c.GpuHub.*_limit(s))")
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
    lunset = command(limits, "unset", help="remove a ledger limit, returning to the config's")
    who = lunset.add_mutually_exclusive_group(required=True)
    who.add_argument("--default", action="store_true")
    who.add_argument("--group", metavar="GROUP")
    who.add_argument("--user", metavar="USER")

    command(sub, "gpus", json_output=True, help="every GPU: node, index, model, holder, since when, for what")
    usage = command(sub, "usage", json_output=True, help="GPU-hours per user")
    usage.add_argument("--since", default="30d", help="start: a date or a span such as 7d (default 30d)")
    usage.add_argument("--until", help="end (default: now)")
    usage.add_argument("--user")
    queue = sub.add_parser("queue", help="requests waiting for GPUs").add_subparsers(
        dest="action", required=True
    )
    command(
        queue, "show", json_output=True, help="the queue in its order, with places and fair-share factors"
    )
    for action, text in (
        ("cancel", "end a waiting request"),
        ("front", "move a request ahead of every other"),
    ):
        command(queue, action, help=text).add_argument(
            "entry",
            type=values.argparse_type(values.parse_count, "ENTRY", lo=1, hi=10**18),
            help="the entry's id",
        )
    slurm = sub.add_parser("slurm", help="the Slurm backend").add_subparsers(dest="action", required=True)
    sscript = command(slurm, "script", help="preview the batch script of a user's server")
    sscript.add_argument("--user", required=True)
    sscript.add_argument(
        "--gpus", type=values.argparse_type(values.parse_count, "--gpus", lo=0, hi=MAX_COUNT), default=1
    )
    sscript.add_argument("--gpu-model")
    sscript.add_argument("--partition", default="")
    command(slurm, "sync", help="write every known user's GPU limit and fair share to Slurm's accounting")
    command(slurm, "priority", help="slurm.conf lines: Slurm orders jobs by gpuhub's fair share")
    from spawner.cli import sampler

    sampler.add_arguments(
        sub.add_parser(
            "sampler", help="report this node's GPU readings to the broker (as root, on each node)"
        )
    )
    dbp = sub.add_parser("db", help="ledger database").add_subparsers(dest="action", required=True)
    command(dbp, "upgrade", help="migrate the ledger to this gpuhub's schema")
    kernel = sub.add_parser("kernel", help="notebook kernels").add_subparsers(dest="action", required=True)
    kinst = command(
        kernel, "install", help='install the "Python 3 (GPUs)" kernel (default: this Python\'s prefix)'
    )
    where = kinst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the current user's Jupyter directory")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels")
    return p


def load_settings(args: argparse.Namespace) -> GpuHub:
    from traitlets import TraitError
    from traitlets.config import Config, PyFileConfigLoader

    path = args.config
    if path is None and os.path.exists("jupyterhub_config.py"):
        path = "jupyterhub_config.py"
    config = Config()
    if path:
        if not os.path.isfile(path):
            raise UsageError(f"no config file at {path}: name a jupyterhub_config.py with --config")
        loader = PyFileConfigLoader(os.path.basename(path), path=os.path.dirname(os.path.abspath(path)))
        try:
            config = loader.load_config()
        except Exception as e:  # the admin's own Python: any error it raises is theirs to fix
            raise UsageError(f"cannot read {path}: {type(e).__name__}: {_first_line(e)}") from None
    from spawner.settings import GpuHub

    try:
        settings = GpuHub(config=config)
    except (TraitError, ValueError) as e:
        raise UsageError(f"{path}: {_first_line(e)}") from None
    if args.db_url:
        settings.db_url = args.db_url
    elif os.environ.get("GPUHUB_DB_URL"):
        settings.db_url = os.environ["GPUHUB_DB_URL"]
    return settings


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.strftime("%Y-%m-%dT%H:%M:%SZ")


def gpu_json(st) -> dict:
    """One row of ``gpuhub gpus --json``: a GPU and its holder (or ``null``)."""
    h = st.holder
    holder = None
    if h is not None:
        holder = {
            "user": h.user,
            "allocation_id": h.id,
            "purpose": h.purpose,
            "server_name": h.server_name,
            "since": _iso(h.started or h.created),
        }
    g = st.gpu
    return {"node": g.node, "index": g.index, "model": g.model, "present": st.present, "holder": holder}


def _print_json(value, out) -> int:
    print(json.dumps(value, indent=2), file=out)
    return 0


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def open_ledger(settings: GpuHub) -> Ledger:
    """The ledger read-only of its inventory, or a one-line ``UsageError`` naming the URL."""
    from sqlalchemy.exc import SQLAlchemyError

    from spawner.ledger import db

    try:
        return settings.open_ledger(sync=False)  # the hub keeps the inventory; this only reads it
    except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
        raise UsageError(
            f"cannot open the ledger at {db.safe_url(settings.db_url)} ({_first_line(e)}); "
            "check --db-url or c.GpuHub.db_url, e.g. sqlite:////srv/jupyterhub/gpuhub.sqlite"
        ) from None


def run(args: argparse.Namespace, out=sys.stdout) -> int:
    if args.command == "sampler":
        from spawner.cli import sampler

        try:
            return sampler.run(args)
        except (ValueError, OSError) as e:
            raise UsageError(str(e)) from None
    if args.command == "kernel":
        from gpu_magics import kernelspec

        prefix = None if args.user else (args.prefix or sys.prefix)
        try:
            installed = kernelspec.install(user=args.user, prefix=prefix)
        except (FileNotFoundError, OSError) as e:
            raise UsageError(str(e)) from None
        for path in installed:
            print(f"installed {path}", file=out)
        return 0
    settings = load_settings(args)
    if args.command == "db":
        from sqlalchemy.exc import SQLAlchemyError

        from spawner.ledger import db

        try:
            db.upgrade(settings.db_url)
        except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
            raise UsageError(
                f"cannot upgrade the ledger at {db.safe_url(settings.db_url)}: {_first_line(e)}"
            ) from None
        print(f"ledger {db.safe_url(settings.db_url)} is at schema {db.head_revision()}", file=out)
        return 0
    if args.command == "slurm" and args.action == "script":
        from spawner.slurm.spawner import preview_script

        parse_name(args.user, "--user")
        try:
            text = preview_script(settings.config, args.user, args.gpus, args.gpu_model, args.partition)
        except ValueError as e:  # a value that cannot go on an #SBATCH line
            raise UsageError(str(e)) from None
        print(text, end="", file=out)
        return 0
    if args.command == "slurm" and args.action == "priority":
        from spawner.slurm.priority import render_priority_conf

        try:
            print(render_priority_conf(settings.queue_weights()), end="", file=out)
        except ValueError as e:  # a bad c.GpuHub weight, named
            raise UsageError(str(e)) from None
        return 0
    ledger = open_ledger(settings)
    if args.command == "slurm":
        from spawner.slurm.accounting import SlurmAccounting

        accounting = SlurmAccounting(config=settings.config)
        if not accounting.enabled:
            raise UsageError(
                "Slurm accounting is off: set c.SlurmAccounting.enabled = True in the hub's config"
            )
        try:
            commands = accounting.sync(ledger)
        except ValueError as e:  # a bad c.GpuHub share, named
            raise UsageError(str(e)) from None
        for argv in commands:
            print("slurm: " + " ".join(argv[2:]), file=out)
        print(f"{len(commands)} change(s) written to Slurm's accounting", file=out)
        return 0
    if args.command == "limits":
        code = _limits(args, ledger, out)
        if args.action != "show":
            _sync_slurm_after(settings, ledger, args, out)
        return code
    if args.command == "queue":
        from spawner.cli.queue import run_queue

        return run_queue(
            args, ledger, out, print_json=_print_json, format_table=format_table, usage_error=UsageError
        )
    if args.command == "gpus":
        table = ledger.gpu_table()
        if args.json:
            return _print_json([gpu_json(st) for st in table], out)
        rows = []
        for st in table:
            h = st.holder
            rows.append(
                (
                    st.gpu.node,
                    st.gpu.index,
                    st.gpu.model,
                    "" if st.present else "gone",
                    h.user if h else "free",
                    (h.started or h.created).strftime("%Y-%m-%d %H:%M") if h else "",
                    f"{h.purpose} {h.server_name}".strip() + f" (#{h.id})" if h else "",
                )
            )
        print(format_table(("NODE", "GPU", "MODEL", "", "HOLDER", "SINCE (UTC)", "FOR"), rows), file=out)
        return 0
    if args.command == "usage":
        from spawner.ledger import utcnow

        now = utcnow()
        since = parse_when(args.since, now, "--since")
        until = parse_when(args.until, now, "--until") if args.until else now
        if until <= since:
            raise UsageError("--until must be after --since")
        user = parse_name(args.user, "--user") if args.user is not None else None
        hours = ledger.usage(since, until, user=user)
        if args.json:
            per_user = {u: round(h, 4) for u, h in sorted(hours.items())}
            return _print_json({"since": _iso(since), "until": _iso(until), "gpu_hours": per_user}, out)
        rows = [(u, f"{h:.2f}") for u, h in sorted(hours.items())]
        print(f"GPU-hours from {since:%Y-%m-%d %H:%M} to {until:%Y-%m-%d %H:%M} UTC", file=out)
        print(format_table(("USER", "GPU-HOURS"), rows), file=out)
        return 0
    raise UsageError(f"unknown command {args.command}")  # argparse keeps this unreachable


def _limits(args: argparse.Namespace, ledger: Ledger, out) -> int:
    if args.action == "show":
        if args.json:
            entries = [
                {"scope": e.scope, "name": e.name, "origin": e.origin, **asdict(e.limit)}
                for e in ledger.limit_entries()
            ]
            ignored = [{"scope": sc, "name": n, "problem": pr} for sc, n, pr in ledger.ignored_limits()]
            return _print_json({"limits": entries, "ignored": ignored}, out)
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
    gpus, hours = _fmt_limit(limit)
    print(f"{scope} limit{' for ' + name if name else ''}: {gpus} GPUs, GPU-hours {hours}", file=out)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"gpuhub: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        # imported only now: whatever raised one of these had imported its module already
        from sqlalchemy.exc import SQLAlchemyError

        from spawner.ledger.db import SchemaError
        from spawner.slurm import SlurmError
        from spawner.spawners.inventory import InventoryError

        if isinstance(e, (SchemaError, InventoryError, SlurmError)):
            print(f"gpuhub: error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, SQLAlchemyError):  # the database went away or refused mid-command
            print(f"gpuhub: error: the ledger database failed: {_first_line(e)}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
