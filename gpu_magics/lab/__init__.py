"""gpuhub in JupyterLab: the server extension (:mod:`.handlers`) that the lab extension
(``labextension/``, built by ``scripts/setup`` and installed with the package) asks for this
server's GPUs, their use, the queue and gpuhub's notices (``docs/jupyterlab.md``)."""

from __future__ import annotations


def _jupyter_server_extension_points():
    return [{"module": "gpu_magics.lab"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from gpu_magics.lab.handlers import setup

    setup(serverapp)
    serverapp.log.info("gpuhub: JupyterLab's GPU status at gpuhub/api/status")
