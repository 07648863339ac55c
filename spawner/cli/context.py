"""What a ``gpuhub`` command reads of the hub: its ``c.GpuHub`` settings (``--config``, by
default ``./jupyterhub_config.py``, as ``jupyterhub`` itself finds it) and its ledger
(``--db-url`` or ``$GPUHUB_DB_URL`` over ``c.GpuHub.db_url``), each failure one
:class:`~.output.UsageError`. Every command that reads the settings says on stderr, in one
line, which config it read or that it read none."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from spawner.cli.output import UsageError, first_line

if TYPE_CHECKING:
    from spawner.ledger import Ledger
    from spawner.settings import GpuHub


def load_settings(args: argparse.Namespace) -> GpuHub:
    from traitlets import TraitError
    from traitlets.config import Config, PyFileConfigLoader

    path = args.config
    if path is None and os.path.exists("jupyterhub_config.py"):
        path = "jupyterhub_config.py"
    config = Config()
    if not path:
        print(
            "gpuhub: no hub config read (no ./jupyterhub_config.py here, no --config): c.GpuHub's "
            "built-in defaults only; run it in the hub's directory or name the hub's config with --config",
            file=sys.stderr,
        )
    else:
        if not os.path.isfile(path):
            raise UsageError(f"no config file at {path}: name a jupyterhub_config.py with --config")
        loader = PyFileConfigLoader(os.path.basename(path), path=os.path.dirname(os.path.abspath(path)))
        try:
            config = loader.load_config()
        except Exception as e:  # the admin's own Python: any error it raises is theirs to fix
            raise UsageError(f"cannot read {path}: {type(e).__name__}: {first_line(e)}") from None
        print(f"gpuhub: read {os.path.abspath(path)}", file=sys.stderr)
    from spawner.settings import GpuHub

    try:
        settings = GpuHub(config=config)
    except (TraitError, ValueError) as e:
        raise UsageError(f"{path}: {first_line(e)}") from None
    if args.db_url:
        settings.db_url = args.db_url
    elif os.environ.get("GPUHUB_DB_URL"):
        settings.db_url = os.environ["GPUHUB_DB_URL"]
    return settings


def open_ledger(settings: GpuHub) -> Ledger:
    """The ledger read-only of its inventory, or a one-line ``UsageError`` naming the URL."""
    from sqlalchemy.exc import SQLAlchemyError

    from spawner.ledger import db

    try:
        return settings.open_ledger(sync=False)  # the hub keeps the inventory; this only reads it
    except (SQLAlchemyError, OSError, ImportError, ValueError) as e:
        raise UsageError(
            f"cannot open the ledger at {db.safe_url(settings.db_url)} ({first_line(e)}); "
            "check --db-url or c.GpuHub.db_url, e.g. sqlite:////srv/jupyterhub/gpuhub.sqlite"
        ) from None
