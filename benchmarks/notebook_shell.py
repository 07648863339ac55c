"""An IPython shell in this process with gpuhub's magics and ``ranks`` simulated server GPUs
(no hub needed): what the %%distributed benchmarks run cells in."""

import os
import tempfile
from pathlib import Path


def magic_shell(ranks: int):
    """(shell, the %%distributed line for ``ranks`` ranks, rank 0's output only, with its newline)."""
    workdir = Path(tempfile.mkdtemp(prefix="gpuhub-bench-"))
    os.environ.update(
        IPYTHONDIR=str(workdir / "ipython"),
        GPUHUB_GPUS=",".join(f"bench:{i}" for i in range(ranks)),
        GPUHUB_ALLOCATION_ID="1",
    )
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "gpu_magics")
    return shell, f"%%distributed --gpus {ranks} --output rank0\n"
