"""``gpuhub kernel install``: the "Python 3 (GPUs)" kernel spec and, into a prefix, gpuhub's
JupyterLab defaults (:mod:`gpu_magics.kernelspec`)."""

from __future__ import annotations

import sys

from spawner.cli.output import UsageError
from spawner.cli.parsers import actions, command


def register(sub) -> None:
    kernel = actions(sub, "kernel", "notebook kernels")
    kinst = command(
        kernel,
        "install",
        run,
        help='install the "Python 3 (GPUs)" kernel and gpuhub\'s JupyterLab defaults '
        "(default: this Python's prefix)",
    )
    where = kinst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="into the current user's Jupyter directory")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels")


def run(args, out) -> int:
    from gpu_magics import kernelspec

    prefix = None if args.user else (args.prefix or sys.prefix)
    try:
        installed = kernelspec.install(user=args.user, prefix=prefix)
    except (FileNotFoundError, OSError) as e:
        raise UsageError(str(e)) from None
    for path in installed:
        print(f"installed {path}", file=out)
    return 0
