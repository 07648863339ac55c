"""``gpuhub-singleuser``: JupyterHub's single-user server, started without a parser it never needs.

Every Jupyter server imports ``jupyter_events``, which imports ``jsonschema``, whose format
checks import ``rfc3987_syntax`` for the ``iri`` and ``iri-reference`` formats; that package
compiles about thirty Lark grammars when it is imported: 0.6 to 2.9 s of every server start
on a 2-core machine, more than the rest of the server's start (upstream:
jupyter-server#1559, jsonschema#1428). No event schema of the server, JupyterLab or
JupyterHub uses those formats.

This launcher registers a stand-in for ``rfc3987_syntax`` before anything imports it. Its
``is_valid_syntax`` imports the real package on its first call and asks it, so an ``iri``
value is judged exactly as before; only the cost moves to the first one checked (never, in
practice). Every other format check, the event validation and the server's extensions are
untouched. Where the package is not installed, nothing is registered (jsonschema then has no
``iri`` check, as without the launcher).

The hub's spawners start ``gpuhub-singleuser`` by default (``c.Spawner.cmd``); it takes
``jupyterhub-singleuser``'s arguments. ``python -m spawner.singleuser`` is the same.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types

DEFERRED = "rfc3987_syntax"
_lock = threading.Lock()


class DeferredModule(types.ModuleType):
    """Stands for a module until first used: then imports the real one and delegates."""

    def __init__(self, name: str, path: list[str] | None = None):
        super().__init__(name, f"{name}, imported when first used (spawner.singleuser)")
        self._real: types.ModuleType | None = None
        if path is not None:  # a package: its submodules import as usual
            self.__path__ = path

    def real(self) -> types.ModuleType:
        with _lock:
            if self._real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                self._real = importlib.import_module(self.__name__)
            return self._real

    def is_valid_syntax(self, term: str, value: str) -> bool:
        return self.real().is_valid_syntax(term, value)

    def __getattr__(self, name: str):  # anything else: the real module's
        if name.startswith("__") or name == "_real":
            raise AttributeError(name)
        return getattr(self.real(), name)


def defer_import(name: str = DEFERRED) -> DeferredModule | None:
    """Register a stand-in for ``name`` (installed, not imported yet); None if there is nothing
    to defer."""
    spec = None if name in sys.modules else importlib.util.find_spec(name)
    if spec is None:
        return None
    locations = spec.submodule_search_locations
    module = sys.modules[name] = DeferredModule(name, list(locations) if locations is not None else None)
    return module


def main() -> None:
    defer_import()
    from jupyterhub.singleuser import main as singleuser_main

    sys.exit(singleuser_main())


if __name__ == "__main__":
    main()
