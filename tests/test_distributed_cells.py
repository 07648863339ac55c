"""What a ``%%distributed`` cell sends back, through a real kernel, real ipyparallel engines and
real torch.distributed (gloo on CPU), on the server's own (simulated) GPUs: no broker.

The engines send only what the kernel shows (``engine.quiet_cells``): these check that what a
user sees and what each rank keeps stay the same.
"""

import pytest

from .kerneltools import own_gpus_env, run_notebook


@pytest.fixture
def kernel_env(tmp_path):
    return own_gpus_env(tmp_path, "t:0,t:1,t:2")


def test_rank_0s_value_is_the_result_and_every_rank_keeps_its_own(kernel_env):
    head = "%%distributed --gpus 3 --timeout 30\n"
    cells = run_notebook(
        [
            head + 'print("before", rank)\nrank * 10 + 7',
            head + 'print("kept", _, Out[max(Out)])\nimport sys\nprint("err", rank, file=sys.stderr)',
            head.replace("\n", " --targets 1,2\n") + "[rank] * 2",
            head + 'print("kept", _)\n{"rank": rank}',
            "%distributed shutdown",
        ],
        kernel_env,
    )
    for i, c in enumerate(cells):
        assert c.error is None, (i, c)
    first, kept, targeted, again, _ = cells
    assert first.result == 7  # rank 0's, as before
    assert first.rank_lines() == {r: [f"before {r}"] for r in range(3)}
    # every rank's own last value, in _ and in Out, though only rank 0's was shown
    assert kept.rank_lines() == {r: [f"kept {r * 10 + 7} {r * 10 + 7}"] for r in range(3)}
    assert kept.rank_lines("stderr") == {r: [f"err {r}"] for r in range(3)}
    assert kept.result is None
    assert targeted.result is None  # rank 0 did not run it: no result shown
    assert again.rank_lines() == {0: ["kept 7"], 1: ["kept [1, 1]"], 2: ["kept [2, 2]"]}
    assert again.result == {"rank": 0}
