"""Kernel specs gpuhub installs into the single-user environment.

``python3-gpus`` ("Python 3 (GPUs)"): IPython with ``gpu_magics`` loaded.
Install with ``gpuhub kernel install`` (into this Python's prefix; ``--user`` for one user).
"""

from __future__ import annotations

from pathlib import Path

SPECS = Path(__file__).parent
KERNEL_NAMES = ("python3-gpus",)


def install(user: bool = False, prefix: str | None = None) -> list[str]:
    """Install every gpuhub kernel spec; returns where each went."""
    from jupyter_client.kernelspec import KernelSpecManager

    ksm = KernelSpecManager()
    return [
        ksm.install_kernel_spec(str(SPECS / name), kernel_name=name, user=user, prefix=prefix)
        for name in KERNEL_NAMES
    ]
