"""The "Python 3 (GPUs)" kernel, executed through a real Jupyter kernel with nbclient."""

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
    assert out[0].splitlines()[0] == "Server allocation #12: 2 GPU(s), CUDA_VISIBLE_DEVICES=2,3"
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
