"""How each ``gpuhub`` command's parser is made: the options every command takes (before or
after its name), the exit codes every ``--help`` lists, and the function that runs it."""

from __future__ import annotations

import argparse

EXIT_CODES = """exit codes:
  0  done
  1  nothing to change (limits unset of a limit the ledger does not have)
  2  bad input or a failure: one line on stderr says what and what to do

--config, --db-url and --json go before or after the command:
  gpuhub gpus --db-url sqlite:////srv/jupyterhub/gpuhub.sqlite --json"""


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


def actions(sub, name: str, help: str):
    """A command whose actions follow its name (``gpuhub limits show``): where to add them."""
    return sub.add_parser(name, help=help).add_subparsers(dest="action", required=True)


def command(group, name: str, func, *, json_output: bool = False, **kw) -> argparse.ArgumentParser:
    """The parser of one command (or action) that ``func(args, out)`` runs."""
    p = group.add_parser(
        name,
        parents=[_common(json_output)],
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )
    p.set_defaults(func=func)
    return p
