"""The admin settings of GPU slices (``c.GpuHub.gpu_slices``, ``c.GpuHub.slice_groups``): a part
of :class:`spawner.settings.GpuHub`, kept in a module of its own."""

from __future__ import annotations

from collections.abc import Iterable

from traitlets import Dict, List, Unicode
from traitlets.config import Configurable

from spawner.policy import slices
from spawner.policy.placement import Gpu


class SliceSettings(Configurable):
    """How GPUs may be split, and who takes slices rather than whole GPUs."""

    gpu_slices = Dict(
        help="""GPU models whose GPUs may be split into equal slices, and how many: model
        name (as the inventory reports it) to a whole number from 2 to 48. A slice has that
        part of the GPU's memory and compute; it counts as that part of a GPU against limits,
        in GPU-hours and in budgets, and waits in the queue like any request. A GPU is held
        whole or in slices, never both: a whole-GPU request waits while any slice of a GPU is
        held, and slices fill GPUs already split before they split another. The memory must
        divide into equal parts; a model not in the inventory, 0, 1 or a count that does not
        divide the memory stops the hub at start with this setting named. On the local backend
        a slice's server gets its GPU through CUDA MPS with its memory limit and thread
        percentage where NVML is the inventory (docs/slices.md says what that isolates and what
        not); simulated GPUs only count. On a Slurm inventory a slice is Slurm's ``gres/shard``
        (``--gres=shard:a100:K``, K the shards per GPU over this count): every node of the model
        needs shards (gres.conf), the same number per GPU, which this count divides, or the hub
        stops at start with the reason; Slurm binds the GPU and fences neither memory nor
        compute. Default: no GPU is split.
        ``c.GpuHub.gpu_slices = {"A100": 4}``
        """,
    ).tag(config=True)

    slice_groups = List(
        Unicode(),
        help="""JupyterHub groups whose members take slices rather than whole GPUs: their spawn
        form offers slices only, and a request of theirs for whole GPUs (form, REST API,
        ``%%distributed``) is refused with the reason. A user who is also in a group not listed
        here may take either, as anyone else may: every user sees the slices on the form where
        ``gpu_slices`` offers any. Default: none.
        ``c.GpuHub.slice_groups = ["students"]``
        """,
    ).tag(config=True)

    def slice_offers(self, inventory: Iterable[Gpu]) -> dict[str, slices.Offer]:
        """``gpu_slices`` checked against the GPUs the ledger has and, on a Slurm inventory,
        against the shards Slurm gives them (a bad value raises ``ValueError`` naming the
        setting)."""
        offers = slices.check_gpu_slices(self.gpu_slices, inventory)
        if offers and getattr(self, "inventory", "") == "slurm":
            from spawner.slurm import shards
            from spawner.slurm.cluster import read_cluster

            shards.check_shards(offers, read_cluster())  # the sinfo the inventory was just read from
        return offers

    def slices_only(self, groups: Iterable[str]) -> bool:
        """Whether a user of ``groups`` takes slices only: every group of theirs is listed."""
        groups = set(groups)
        return bool(groups) and groups <= set(self.slice_groups)
