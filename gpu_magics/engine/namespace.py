"""Runs inside each ``%%distributed`` engine: which names in its namespace are the user's.

``engine.setup_rank`` puts ``device``, ``rank``, ``world_size``, ``local_rank``, ``dist`` and
``torch`` there, IPython its own (``In``, ``Out``, ``get_ipython``, ``exit``...), and
ipyparallel its temporary ``_``-names; everything else a cell defined. Modules the user
imported are not counted (importing again loses nothing), nor what the user imported from
them (``from torch.nn.parallel import DistributedDataParallel as DDP``: a class, function
or other importable object whose module is not the cell's), nor ``_``-names (as ``%who``).
"""

from __future__ import annotations

SETUP_NAMES = frozenset({"device", "rank", "world_size", "local_rank", "dist", "torch"})


def user_names(ns: dict | None = None, hidden: dict | None = None) -> list[str]:
    """The names a cell defined in this engine's namespace, sorted."""
    import types

    if ns is None:
        from IPython import get_ipython

        shell = get_ipython()
        ns, hidden = shell.user_ns, shell.user_ns_hidden
    hidden = hidden or {}
    missing = object()
    return sorted(
        name
        for name, value in ns.items()
        if not name.startswith("_")
        and name not in SETUP_NAMES
        and value is not hidden.get(name, missing)
        and not isinstance(value, types.ModuleType)
        and not _imported(value, ns.get("__name__", "__main__"))
    )


def _imported(value, here: str) -> bool:
    """A class, function or other named object defined in a module (not in a cell: those
    have the namespace's ``__name__``, ``__main__``): importing it again loses nothing."""
    import inspect

    if not (inspect.isclass(value) or inspect.isroutine(value)):
        return False
    module = getattr(value, "__module__", None)
    return bool(module) and module not in (here, "__main__")
