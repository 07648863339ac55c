"""The tree says what a module may load: each module of the pure and the portable rooms is
imported alone in a fresh interpreter, and what it pulled into ``sys.modules`` is checked.

- ``spawner/policy/`` (pure decisions) may not load SQLAlchemy, JupyterHub, tornado, or any
  gpuhub module outside ``spawner.policy`` but ``gpu_magics.common`` (stdlib only: the words
  and numbers every process writes the same way);
- ``gpu_magics/common/`` (imported by every process) nothing outside the standard library;
- ``gpu_magics/engine/`` (each ipyparallel engine) not IPython's magics, not the kernel's,
  launchers', reporter's or Dask's code, not the ledger.

The rooms are read from the tree, so a new module is checked the day it is added.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# run in a fresh interpreter: the modules that importing NAME adds to what Python starts with
PROBE = textwrap.dedent(
    """
    import importlib, json, sys
    before = set(sys.modules)
    importlib.import_module(sys.argv[1])
    print(json.dumps(sorted(set(sys.modules) - before)))
    """
)


def loaded_by(module: str, path: Path = ROOT) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, cwd=path, timeout=120
    )
    assert out.returncode == 0, f"importing {module} failed:\n{out.stderr[-2000:]}"
    return json.loads(out.stdout.splitlines()[-1])


def modules_of(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    names = [package] + [f"{package}.{p.stem}" for p in sorted(folder.glob("*.py")) if p.stem != "__init__"]
    return [n for n in names if not n.endswith("__main__")]


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def policy_breaks(loaded: list[str]) -> list[str]:
    """What a pure policy module must not load: the database, the hub, the web server, or
    gpuhub code outside the policy package (its parent package's ``__init__`` aside) but the
    stdlib-only ``gpu_magics.common``."""
    return [
        m
        for m in loaded
        if _under(m, ("sqlalchemy", "jupyterhub", "tornado"))
        or (
            _under(m, ("spawner", "gpu_magics"))
            and m not in ("spawner", "gpu_magics")
            and not _under(m, ("spawner.policy", "gpu_magics.common"))
        )
    ]


def common_breaks(loaded: list[str]) -> list[str]:
    """Anything outside the standard library (and gpu_magics.common itself)."""
    stdlib = sys.stdlib_module_names
    return [
        m
        for m in loaded
        if m.split(".")[0] not in stdlib
        and m != "gpu_magics"
        and not _under(m, ("gpu_magics.common",))
        and not m.startswith("_")  # the interpreter's own extension modules (_json, _socket, ...)
    ]


def engine_breaks(loaded: list[str]) -> list[str]:
    """What runs in an engine must not bring the kernel's side with it."""
    return [
        m
        for m in loaded
        if _under(m, ("IPython.core.magic", "spawner.ledger", "sqlalchemy"))
        or (
            (_under(m, ("gpu_magics",)) and m != "gpu_magics")
            and not _under(m, ("gpu_magics.common", "gpu_magics.engine"))
        )
    ]


CASES = (
    [(m, policy_breaks) for m in modules_of("spawner.policy")]
    + [(m, common_breaks) for m in modules_of("gpu_magics.common")]
    + [(m, engine_breaks) for m in modules_of("gpu_magics.engine")]
)


@pytest.mark.parametrize("module, breaks", CASES, ids=[m for m, _ in CASES])
def test_a_module_loads_only_what_its_room_allows(module, breaks):
    loaded = loaded_by(module)
    assert module in loaded or module in sys.builtin_module_names
    assert breaks(loaded) == [], f"{module} loads {breaks(loaded)}"


def test_the_rooms_are_not_empty():
    # a renamed room would otherwise check nothing
    for package, least in (("spawner.policy", 8), ("gpu_magics.common", 5), ("gpu_magics.engine", 5)):
        assert len(modules_of(package)) > least, package


def test_the_check_sees_a_forbidden_import(tmp_path):
    """The probe and the rules catch what they are for: a module that imports SQLAlchemy (or
    a third-party package) is reported; one that imports only the standard library is not."""
    pkg = tmp_path / "probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "clean.py").write_text("import json, socket\n")
    (pkg / "dirty.py").write_text("import json\nimport sqlalchemy\n")
    clean, dirty = loaded_by("probe_pkg.clean", tmp_path), loaded_by("probe_pkg.dirty", tmp_path)
    assert common_breaks([m for m in clean if not m.startswith("probe_pkg")]) == []
    assert "sqlalchemy" in common_breaks(dirty)
    assert "sqlalchemy" in policy_breaks(dirty)
    assert "sqlalchemy" in engine_breaks(dirty)
    assert engine_breaks(["gpu_magics", "gpu_magics.kernel", "gpu_magics.kernel.pool"]) == [
        "gpu_magics.kernel",
        "gpu_magics.kernel.pool",
    ]
    assert policy_breaks(["spawner", "spawner.policy.limits", "spawner.ledger"]) == ["spawner.ledger"]
