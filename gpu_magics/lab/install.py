"""JupyterLab's GPU panel into an environment's prefix, from a checkout.

A wheel install puts the built panel (``share/jupyter/labextensions/gpuhub-lab``), the server
extension's switch (``etc/jupyter/jupyter_server_config.d/gpuhub-lab.json``) and the page
config that turns ipyparallel's lab extension off (``etc/jupyter/labconfig/page_config.json``)
in place as wheel data. An editable install (a checkout other users can read) gets no wheel
data: ``gpuhub kernel install`` (``scripts/setup`` runs it) copies them from the checkout,
where ``scripts/setup`` built the panel into ``build/labextension``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # a checkout: its build/ and kernels/
NAME = "gpuhub-lab"
DISABLED = {"ipyparallel-labextension": True}


def install_panel(prefix: str | Path) -> list[str]:
    """Copy what a checkout has into ``prefix``; returns what was written (nothing from a
    wheel install, whose data are in place already)."""
    prefix = Path(prefix)
    done = []
    built = REPO / "build" / "labextension" / NAME
    if (built / "package.json").is_file():
        target = prefix / "share" / "jupyter" / "labextensions" / NAME
        if target.resolve() != built.resolve():
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(built, target)
            done.append(str(target))
    switch = REPO / "kernels" / "jupyterlab" / "gpuhub-lab.json"
    if switch.is_file():
        target = prefix / "etc" / "jupyter" / "jupyter_server_config.d" / switch.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(switch, target)
        done.append(str(target))
        done.append(disable_extensions(prefix / "etc" / "jupyter" / "labconfig" / "page_config.json"))
    return done


def disable_extensions(path: Path) -> str:
    """Add gpuhub's ``disabledExtensions`` to a page config, keeping whatever else it says."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        config = {}
    config.setdefault("disabledExtensions", {}).update(DISABLED)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o644)
    return str(path)
