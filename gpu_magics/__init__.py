"""gpuhub's notebook magics. ``%load_ext gpu_magics`` (automatic in the "Python 3 (GPUs)" kernel).

- ``%%distributed --gpus N``: run the cell on one warm engine per GPU, torch.distributed ready.
- ``%distributed shutdown`` / ``status``: stop the engines (releasing burst GPUs) / show them.
- ``%gpus``: what this session holds: the server's GPUs, the engines and the burst lease, how
  busy each of the user's GPUs is, and any idle warning (``docs/reclaim.md``).
- ``%dask_cuda --gpus N`` / ``--cpu``: a Dask cluster, one worker per GPU (``daskmagic.py``).
"""

from IPython.core.magic import Magics, line_magic, magics_class

from gpu_magics.common.session import describe, server_gpus
from gpu_magics.dask.magic import DaskMagics
from gpu_magics.kernel.broker import BrokerClient, BrokerError
from gpu_magics.kernel.distributed import DistributedMagics, register
from gpu_magics.kernel.status import describe_use

__all__ = ["load_ipython_extension", "server_gpus"]


@magics_class
class GpuMagics(Magics):
    def __init__(self, shell, distributed: DistributedMagics):
        super().__init__(shell=shell)
        self.distributed = distributed

    @line_magic
    def gpus(self, line: str = ""):
        """Show the GPUs this session holds: the server's, and the %%distributed pool's."""
        print(describe(server_gpus()))
        d = self.distributed
        if d.pool is not None or d.burst is not None:
            print()
            print(d.describe().split("\n", 1)[1])
        client = BrokerClient.from_env()
        if client is not None:  # how busy the user's GPUs are, and any idle warning
            try:
                use = describe_use(client.me(), client.utilization())
            except BrokerError as e:
                use = f"(GPU use unknown: {e.message})"
            if use:
                print()
                print(use)


def load_ipython_extension(ipython) -> None:
    distributed = register(ipython)
    ipython.register_magics(GpuMagics(ipython, distributed))
    ipython.register_magics(DaskMagics(shell=ipython))
