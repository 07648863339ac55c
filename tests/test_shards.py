"""GPU slices as Slurm's gres/shard (pure): what sinfo says of shards, the offers checked
against it (each refusal naming the setting), and the --gres of one slice."""

import pytest

from spawner.policy.slices import Offer
from spawner.slurm import shards
from spawner.slurm.sinfo import GresEntry, parse_sinfo
from spawner.slurm.spawner import slice_gres, slurm_gpu_env


def cluster(*lines):
    return parse_sinfo("\n".join(lines))


TWO = cluster(
    "gpu-node1|gpu:a100:4(S:0),shard:a100:16(S:0)|gpu*|idle",
    "gpu-node2|gpu:a100:4,shard:a100:16|gpu*|mixed",
)


def test_sinfo_reads_shards_typed_as_their_gpus():
    node = TWO.nodes[0]
    assert node.shards == (GresEntry("a100", 16),) and node.gres == (GresEntry("a100", 4),)
    assert cluster("n|gpu:2,shard:6|p*|idle").nodes[0].shards == (GresEntry(None, 6),)
    assert cluster("n|gpu:a100:2|p*|idle").nodes[0].shards == ()


@pytest.mark.parametrize(
    "offers, sinfo, want",
    [
        ({"a100": 4}, TWO, {"a100": 1}),
        ({"a100": 2}, TWO, {"a100": 2}),
        ({"GPU": 3}, cluster("n|gpu:2,shard:6|p*|idle"), {"GPU": 1}),
        (
            {"a100": 4},
            cluster("n1|gpu:a100:2,shard:a100:8,gpu:t4:1|p*|idle", "n2|gpu:t4:2|p*|idle"),
            {"a100": 1},
        ),
        ({"a100": 8}, TWO, "splits each in 4 shards, which 8 slices do not share evenly"),
        ({"a100": 3}, TWO, "Offer a count that divides 4"),
        (
            {"a100": 4},
            cluster("n1|gpu:a100:4,shard:a100:16|p*|idle", "n2|gpu:a100:2|p*|idle"),
            "no gres/shard of them on node n2",
        ),
        ({"a100": 4}, cluster("n1|gpu:a100:4,shard:a100:10|p*|idle"), "10 shards for 4 a100 GPUs"),
        (
            {"a100": 2},
            cluster("n1|gpu:a100:4,shard:a100:16|p*|idle", "n2|gpu:a100:2,shard:a100:4|p*|idle"),
            "different shard counts (2 per GPU on n2; 4 per GPU on n1)",
        ),
        ({"h100": 2}, TWO, "Slurm reports no node with h100 GPUs"),
    ],
)
def test_offers_are_checked_against_slurms_shards(offers, sinfo, want):
    offers = {m: Offer(m, n) for m, n in offers.items()}
    if isinstance(want, dict):
        assert shards.check_shards(offers, sinfo) == want
        return
    with pytest.raises(ValueError) as e:
        shards.check_shards(offers, sinfo)
    assert want in str(e.value) and "c.GpuHub.gpu_slices" in str(e.value)


@pytest.mark.parametrize(
    "asked, want",
    [(("a100", 4), "shard:a100:1"), (("a100", 2), "shard:a100:2"), (None, None)],
)
def test_a_slice_asks_slurm_for_its_shards(asked, want):
    assert slice_gres(asked, TWO) == want


@pytest.mark.parametrize("model, n", [("a100", 0), ("a100", True), ("a 100", 1)])
def test_a_bad_shard_request_is_never_written(model, n):
    with pytest.raises(ValueError):
        shards.slice_gres(model, n)


def test_a_slurm_slice_server_is_told_its_share_and_asks_for_no_mps():
    from spawner.policy.records import AllocationInfo

    fields = AllocationInfo.__dataclass_fields__
    base = {k: None for k in fields}
    info = AllocationInfo(**{**base, "id": 7, "slice_parts": 4})
    env = slurm_gpu_env(info)
    assert env["GPUHUB_GPU_SLICE"] == "1/4" and env["GPUHUB_SLICE_MPS"] == "0"
    assert "GPUHUB_GPU_MEMORY_MIB" not in env  # Slurm fences no memory: none is promised
    assert "GPUHUB_GPU_SLICE" not in slurm_gpu_env(AllocationInfo(**{**base, "id": 8}))


def test_slurm_slices_are_checked_at_the_hubs_start(monkeypatch):
    from spawner.policy.placement import Gpu
    from spawner.settings import GpuHub
    from spawner.slurm import cluster as cluster_mod

    inventory = [Gpu(n.name, i, "a100") for n in TWO.nodes for i in range(4)]
    monkeypatch.setattr(cluster_mod, "read_cluster", lambda *a, **k: TWO)
    assert GpuHub(inventory="slurm", gpu_slices={"a100": 4}).slice_offers(inventory)["a100"].count == 4
    with pytest.raises(ValueError, match=r"c\.GpuHub\.gpu_slices splits a100 GPUs in 8"):
        GpuHub(inventory="slurm", gpu_slices={"a100": 8}).slice_offers(inventory)


@pytest.mark.parametrize(
    "gpus, per_gpu, asked, want",
    [
        (3, 2, None, 6),
        (1, 2, ("a100", 4), 1),
        (1, 8, ("a100", 4), 2),
        (1, 8, ("a100", 2), 4),
        (0, 2, None, 1),
    ],
)
def test_a_slices_job_asks_for_its_share_of_the_cpus(gpus, per_gpu, asked, want):
    from spawner.slurm.spawner import job_cpus

    assert job_cpus(gpus, per_gpu, asked) == want


def test_a_slices_script_asks_for_its_shard_and_a_server_without_gpus_for_none():
    from spawner.slurm.spawner import GpuSlurmSpawner
    from spawner.spawners import form

    sp = GpuSlurmSpawner()
    args = ("alice", "/home/alice", ["PATH"], ["gpuhub-singleuser"])
    quarter = form.GpuOptions(count=1, model=None, partition=None, hours=None, share="1/4")
    text = sp.script_for(*args, quarter, "gpu", slice_asked=("a100", 4), cluster=TWO)
    assert "#SBATCH --gres=shard:a100:1\n" in text and "#SBATCH --cpus-per-task=1\n" in text
    # the same spawner's next start without GPUs (a slice asked before is not this start's)
    none = form.GpuOptions(count=0, model=None, partition=None, hours=None, share=None)
    text = sp.script_for(*args, none, "gpu", slice_asked=("a100", 4), cluster=TWO)
    assert "--gres" not in text and "export CUDA_VISIBLE_DEVICES=" in text


@pytest.mark.parametrize(
    "answered, words",
    [
        (False, "It was ended before your server answered: no work ran there. Start again."),
        (True, "Your server was stopped with it: what its kernels held in memory is lost. Start again."),
    ],
)
def test_a_gpu_given_twice_says_what_ending_the_job_cost_within_a_ledger_reason(answered, words):
    from spawner.slurm.watcher import GAVE_TWICE, conflict_reason

    text = conflict_reason(ValueError("GPU n:1 went to job 5; job 4 of bob holds a slice of it"), answered)
    assert text.startswith(GAVE_TWICE) and text.endswith(words) and "job 4 of bob" in text
    long = conflict_reason(ValueError("x" * 400), answered)
    assert len(long) == 255 and long.endswith(words)  # the ledger keeps 255 characters of a reason
