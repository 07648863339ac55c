"""The "Python 3 (GPUs)" kernel spec (``python3-gpus``): IPython with ``gpu_magics`` loaded.

``pip install jupyterhub-gpuhub`` puts it in the environment's
``share/jupyter/kernels/python3-gpus`` as wheel data, where Jupyter finds it with no command
(as ipykernel ships its own). The repository's ``kernels/`` folder is its source.
``gpuhub kernel install [--user | --prefix P]`` copies it elsewhere: another environment's
prefix, or one user's Jupyter directory.

With it go **gpuhub's JupyterLab defaults** (``kernels/jupyterlab/gpuhub.json``, installed as
``PREFIX/share/jupyter/lab/settings/overrides.d/gpuhub.json``, where JupyterLab reads a
package's defaults): no toast asking each new user whether to fetch Jupyter's news feed, and
no check for JupyterLab updates, which the servers' users cannot install. A user's own
settings still win; an admin's ``overrides.json`` there too. And JupyterLab's GPU panel
(:mod:`gpu_magics.lab.install`).
"""

from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

KERNEL_NAMES = ("python3-gpus",)
REPO_SPECS = Path(__file__).resolve().parent.parent / "kernels"  # a checkout (editable install)
LAB_DEFAULTS = "gpuhub.json"


def spec_dir(name: str, prefix: str | Path = sys.prefix) -> Path:
    """The source of kernel spec ``name``: a checkout's ``kernels/`` folder (an editable
    install), else the wheel's data in ``prefix``."""
    user_base = Path(sysconfig.get_path("data", f"{os.name}_user")) / "share" / "jupyter" / "kernels"
    for base in (REPO_SPECS, Path(prefix) / "share" / "jupyter" / "kernels", user_base):  # pip --user
        if (base / name / "kernel.json").is_file():
            return base / name
    raise FileNotFoundError(
        f"gpuhub's kernel spec {name!r} is not in {prefix}/share/jupyter/kernels: "
        "reinstall gpuhub (pip install jupyterhub-gpuhub) into this environment"
    )


def install(user: bool = False, prefix: str | None = None) -> list[str]:
    """Install every gpuhub kernel spec; returns where each is."""
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager()
    done = []
    for name in KERNEL_NAMES:
        source = spec_dir(name)
        target = Path(ksm._get_destination_dir(name, user=user, prefix=prefix))
        if target.resolve() == source.resolve():  # jupyter_client would delete it, then copy nothing
            done.append(str(target))  # the wheel put it there already
            continue
        done.append(ksm.install_kernel_spec(str(source), kernel_name=name, user=user, prefix=prefix))
    if not user:
        from gpu_magics.lab.install import install_panel

        done.append(install_lab_defaults(prefix or sys.prefix))
        done += install_panel(prefix or sys.prefix)  # JupyterLab's GPU panel, from a checkout
    return done


def install_lab_defaults(prefix: str | Path) -> str:
    """Write gpuhub's JupyterLab defaults into ``prefix`` (a wheel install has them there
    already: then nothing changes); returns the file's path."""
    target = Path(prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / LAB_DEFAULTS
    installed = Path(sys.prefix) / target.relative_to(prefix)  # a wheel's, in this environment
    for source in (REPO_SPECS / "jupyterlab" / LAB_DEFAULTS, installed, target):
        if source.is_file():
            break
    else:
        raise FileNotFoundError(f"gpuhub's JupyterLab defaults are not in {target.parent}: reinstall gpuhub")
    if source.resolve() != target.resolve():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(source.read_bytes())
        target.chmod(0o644)
    return str(target)
