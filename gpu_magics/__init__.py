"""gpuhub's notebook magics. ``%load_ext gpu_magics`` (automatic in the "Python 3 (GPUs)" kernel).

- ``%%distributed --gpus N``: run the cell on one warm engine per GPU, torch.distributed ready.
- ``%distributed shutdown`` / ``status``: stop the engines (releasing burst GPUs) / show them.
- ``%gpus``: what this session holds: the server's GPUs, the engines and the burst lease, how
  busy each of the user's GPUs is, and any idle warning (``docs/reclaim.md``).
- ``%dask_cuda --gpus N`` / ``--cpu``: a Dask cluster, one worker per GPU (``gpu_magics.dask.magic``).
"""

__all__ = ["load_ipython_extension"]


def load_ipython_extension(ipython) -> None:
    # imported here: engines and the server import gpu_magics.engine/common/report, which must
    # not load the kernel's magics (tests/test_layers.py)
    from gpu_magics.dask.magic import DaskMagics
    from gpu_magics.kernel.distributed import register
    from gpu_magics.kernel.status import GpuMagics

    distributed = register(ipython)
    ipython.register_magics(GpuMagics(ipython, distributed))
    ipython.register_magics(DaskMagics(shell=ipython))
