"""gpuhub's notebook magics. ``%load_ext gpu_magics`` (automatic in the "Python 3 (GPUs)" kernel).

- ``%gpus``: the GPUs this notebook server holds.
"""

from IPython.core.magic import Magics, line_magic, magics_class

from .session import describe, server_gpus

__all__ = ["load_ipython_extension", "server_gpus"]


@magics_class
class GpuMagics(Magics):
    @line_magic
    def gpus(self, line: str = ""):
        """Show the GPUs this server holds (from the gpuhub spawner's allocation)."""
        print(describe(server_gpus()))


def load_ipython_extension(ipython) -> None:
    ipython.register_magics(GpuMagics)
