"""The "Python 3 (GPUs)" kernel, executed through a real Jupyter kernel with nbclient."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

from gpu_magics.common.session import describe, server_gpus


def run_notebook(*sources: str) -> list[str]:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    NotebookClient(nb, kernel_name="python3-gpus", timeout=60).execute()
    return ["".join(o.get("text", "") for o in cell.outputs) for cell in nb.cells]


def test_gpu_kernel_loads_the_magics_and_sees_the_servers_gpus(monkeypatch):
    # the variables the GPU spawner gives a server (spawner.spawners.base.make_gpu_env)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("GPUHUB_ALLOCATION_ID", "12")
    monkeypatch.setenv("GPUHUB_GPUS", "n1:2,n1:3")
    monkeypatch.setenv("GPUHUB_GPU_MODEL", "A100")
    out = run_notebook("%gpus", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])")
    assert out[0].splitlines()[0] == "Server allocation #12: 2 GPUs, CUDA_VISIBLE_DEVICES=2,3"
    assert out[0].splitlines()[2].split() == ["n1:2", "0", "A100"]
    assert out[1].strip() == "2,3"


def test_gpus_outside_gpuhub(monkeypatch):
    for var in ("GPUHUB_ALLOCATION_ID", "GPUHUB_GPUS"):
        monkeypatch.delenv(var, raising=False)
    assert "does not run on a gpuhub server" in run_notebook("%gpus")[0]


@pytest.mark.parametrize(
    "env, words",
    [
        ({"GPUHUB_ALLOCATION_ID": "", "CUDA_VISIBLE_DEVICES": ""}, "has no GPUs"),
        ({}, "does not run on a gpuhub server"),
    ],
)
def test_describe(env, words):
    assert words in describe(server_gpus(env))


def test_a_line_the_magics_cannot_read_is_a_usage_error_and_quotes_are_a_shells(tmp_path):
    from .kerneltools import own_gpus_env
    from .kerneltools import run_notebook as run_cells

    afile = tmp_path / "a-file"
    afile.write_text("not a directory")
    runs = tmp_path / "my runs"
    cells = run_cells(
        [
            "%distributed '",  # 0
            "%%distributed --gpus 1 '\nx = 1",
            "%dask_cuda '",
            '%distributed status "',
            "%gpus now",  # 4
            f"%%distributed --gpus 1 --autosave x --dir {afile}\nx = 1",  # 5: refused at once
            f"%%distributed --gpus 1 --autosave x --dir '{runs}'\nx = 1",  # 6
            f'%distributed save x --dir "{runs}"',
            "%gpus",
        ],
        own_gpus_env(tmp_path, "t:0"),
        timeout=120,
    )

    def usage_error(cell) -> str:
        """IPython shows a UsageError as one stderr message, with no traceback."""
        assert cell.error is None and cell.stderr.startswith("UsageError: "), cell
        assert "Traceback" not in cell.stderr and "gpu_magics" not in cell.stderr, cell
        return cell.stderr

    for i in range(4):
        said = usage_error(cells[i])
        assert "quote that is not closed" in said and "usage: %" in said, said
        assert "No closing quotation" not in said and "ValueError" not in said
    said = usage_error(cells[4])
    assert "%gpus takes no arguments (got 'now')" in said and "usage: %gpus" in said, said
    said = usage_error(cells[5])
    assert f"--autosave: {afile} is a file, not a directory; choose another --dir" in said, said
    assert "Starting engines" not in cells[5].shown  # refused when given, before any engine
    assert cells[6].error is None, cells[6]
    assert f"gpuhub: autosave of x to {runs} before the engines stop" in cells[6].shown
    assert cells[7].error is None and f"saved from rank 0 to {runs} (" in cells[7].shown, cells[7]
    assert sorted(p.name for p in tmp_path.iterdir() if "runs" in p.name) == ["my runs"]  # no quotes kept
    assert os.listdir(runs) == ["x.pt"]
    assert cells[8].error is None and "GPU(s)" not in cells[8].shown


def test_a_resize_refusal_quotes_what_was_typed_and_lists_only_the_users_data(tmp_path):
    from .kerneltools import own_gpus_env
    from .kerneltools import run_notebook as run_cells

    cells = run_cells(
        [
            "%%distributed --gpus 2\n"
            "import torch.nn as nn\n"
            "from torch.nn.parallel import DistributedDataParallel as DDP\n"
            "from json import dumps\n"
            "def step():\n    pass\n"
            "w = 1",
            "%%distributed --gpus 1\nw",  # 1
            "%%distributed --gpus 2 --timeout 60\nw",  # 2
            "%%distributed --gpus 2 --timeout 60 --restart\nw = 2",  # 3
            "%%distributed\nimport os\nprint(w, os.getpid())",  # 4: bare: the warm pool as it is
            "%%distributed --gpus 2 --timeout 60\nprint(w, os.getpid())",  # 5
        ],
        own_gpus_env(tmp_path, "t:0,t:1"),
        timeout=120,
    )
    assert cells[0].error is None and not cells[0].stderr, cells[0]
    said = cells[1].stderr
    assert said.startswith(
        "UsageError: %%distributed --gpus 1 needs new engines (the pool runs --gpus 2), and the pool "
        "holds your variables (step, w); nothing was changed."
    ), said
    assert "--timeout" not in said and "DDP" not in said and "dumps" not in said
    said = cells[2].stderr
    assert said.startswith(
        "UsageError: %%distributed --gpus 2 --timeout 60 needs new engines (the pool runs --gpus 2 "
        "with the default timeout of 300 s), and the pool holds your variables (step, w)"
    ), said
    # a cell that types no setting runs on the warm pool, whatever its --timeout: same processes
    for i in (3, 4, 5):
        assert cells[i].error is None and not cells[i].stderr, cells[i]
    assert cells[4].stdout == cells[5].stdout and cells[4].stdout.count("2 ") == 2, cells[4]
