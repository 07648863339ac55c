"""``python -m spawner.hub``: JupyterHub itself, started without the parser it never needs.

The hub imports ``jupyter_events`` too (for its event log), and with it ``rfc3987_syntax``
and its thirty Lark grammars: 2 to 5 s of every hub start on a loaded 2-core machine, about
half of the hub's import. This is ``jupyterhub`` with the stand-in of ``spawner.singleuser``
registered first: the same application, arguments and configuration (``python -m
spawner.hub -f jupyterhub_config.py``); an ``iri`` value, if anything ever checks one, is
judged by the real package, imported then.
"""

from __future__ import annotations

import sys

from spawner.singleuser import defer_import


def main() -> None:
    defer_import()
    from jupyterhub.app import main as hub_main

    sys.exit(hub_main())


if __name__ == "__main__":
    main()
