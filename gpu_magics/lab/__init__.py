"""gpuhub in JupyterLab: the server extension (:mod:`.handlers`) that the lab extension
(``labextension/``, built by ``scripts/setup`` and installed with the package) asks for this
server's GPUs, their use, the queue and gpuhub's notices (``docs/jupyterlab.md``)."""

from __future__ import annotations

from pathlib import Path


def _jupyter_server_extension_points():
    return [{"module": "gpu_magics.lab"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from gpu_magics.lab.handlers import setup

    setup(serverapp)
    if panel_installed():
        serverapp.log.info("gpuhub: JupyterLab's GPU status at gpuhub/api/status")
    else:  # a package installed where Node was missing: the API answers, nothing shows it
        serverapp.log.warning(
            "gpuhub: JupyterLab's GPU panel is not installed here (scripts/setup builds it with "
            "Node.js); gpuhub/api/status answers, but JupyterLab shows no GPU status"
        )


def panel_installed() -> bool:
    from jupyter_core.paths import jupyter_path

    return any(Path(d, "gpuhub-lab", "package.json").is_file() for d in jupyter_path("labextensions"))
