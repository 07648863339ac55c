"""GPU slices on Slurm (pure): ``c.GpuHub.gpu_slices`` as Slurm's ``gres/shard``.

Slurm splits a node's GPUs in shards (``gres.conf``: ``Name=shard Count=N File=/dev/nvidiaK``
per GPU; ``sinfo`` shows the node's total, typed as its GPUs: ``shard:a100:16``) and keeps a GPU
either whole (``gres/gpu``) or in shards. A slice of ``1/P`` of a GPU is
``--gres=shard:a100:K``, where ``K`` is the node's shards per GPU divided by ``P``.

Slurm binds a shard job to its GPU (``CUDA_VISIBLE_DEVICES``, the device cgroup) and counts it;
it fences no memory and no compute between the jobs that share the GPU (time-slicing).

- :func:`check_shards`: the offers checked against what ``sinfo`` reports, at the hub's start:
  every node of an offered model has shards of it, the same number per GPU, that the offer's
  count divides. Each refusal names the setting and what to change.
- :func:`slice_gres`: the ``--gres`` value of one slice.
"""

from __future__ import annotations

from collections.abc import Mapping

from spawner.policy.slices import SETTING, Offer
from spawner.slurm.commands import gres_request
from spawner.slurm.sinfo import Cluster, SlurmNode


def _count(entries, model: str | None) -> int:
    return sum(e.count for e in entries if e.type == model)


def _gres_model(model: str, untyped: str) -> str | None:
    """Slurm's GRES type of a ledger model (None: the untyped GPUs the ledger calls ``untyped``)."""
    return None if model == untyped else model


def _gpus_and_shards(node: SlurmNode, model: str, untyped: str) -> tuple[int, int]:
    """(GPUs of ``model``, shards of ``model``) on ``node``."""
    t = _gres_model(model, untyped)
    return _count(node.gres, t), _count(node.shards, t)


def check_shards(offers: Mapping[str, Offer], cluster: Cluster, untyped: str = "GPU") -> dict[str, int]:
    """Shards per slice of each offered model; ``ValueError`` naming the setting where Slurm
    cannot give that slice: a node of the model without its shards, shards that do not divide
    evenly over its GPUs, different counts on different nodes, or more slices than a GPU has
    shards."""
    out: dict[str, int] = {}
    for model, offer in sorted(offers.items()):
        per: dict[int, list[str]] = {}
        for node in cluster.nodes:
            gpus, shards = _gpus_and_shards(node, model, untyped)
            if not gpus:
                continue
            if not shards:
                raise ValueError(
                    f"{SETTING} splits {model} GPUs in {offer.count}, but Slurm reports no gres/shard "
                    f"of them on node {node.name}. Add shards to its GPUs (gres.conf: Name=shard "
                    "Count=N per GPU; slurm.conf: GresTypes=gpu,shard and shard:TOTAL in the node's "
                    f"Gres), or leave {model} out of the setting."
                )
            if shards % gpus:
                raise ValueError(
                    f"{SETTING}: node {node.name} has {shards} shards for {gpus} {model} GPUs, not "
                    "the same number per GPU; give each GPU the same Count in gres.conf."
                )
            per.setdefault(shards // gpus, []).append(node.name)
        if not per:
            raise ValueError(f"{SETTING} names {model!r}, but Slurm reports no node with {model} GPUs.")
        if len(per) > 1:
            seen = "; ".join(f"{k} per GPU on {', '.join(v)}" for k, v in sorted(per.items()))
            raise ValueError(
                f"{SETTING} splits {model} GPUs, but Slurm gives them different shard counts ({seen}): "
                "a slice must be the same request on every node. Give each GPU the same Count."
            )
        [each] = per
        if each % offer.count:
            raise ValueError(
                f"{SETTING} splits {model} GPUs in {offer.count}, but Slurm splits each in {each} "
                f"shards, which {offer.count} slices do not share evenly. Offer a count that divides "
                f"{each}, or change gres.conf's Count."
            )
        out[model] = each // offer.count
    return out


def slice_gres(model: str, shards_per_slice: int, untyped: str = "GPU") -> str:
    """``--gres`` value of one slice: ``shard:a100:2`` (``shard:2`` for untyped GPUs)."""
    return gres_request(shards_per_slice, _gres_model(model, untyped), "shard")
