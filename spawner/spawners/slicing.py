"""A server on a slice of a GPU (``c.GpuHub.gpu_slices``): the request a ``gpu_share`` option
makes, and what the server runs with. Pure; the spawners call it.

A slice's server sees its GPU (``CUDA_VISIBLE_DEVICES``, as any GPU server) and is told its
share: ``GPUHUB_GPU_SLICE`` (``1/4``), ``GPUHUB_GPU_MEMORY_MIB`` (its part of the memory). On
GPUs that NVML reports, ``GPUHUB_SLICE_MPS=1`` asks the server's launcher
(``spawner.singleuser``) to run it through a CUDA MPS control daemon of the user's own, with the
slice's memory limit and thread percentage (:mod:`spawner.policy.mps`); on simulated GPUs the
slice is counted and nothing holds it to its share.
"""

from __future__ import annotations

from spawner import policy
from spawner.policy import slices
from spawner.policy.records import AllocationInfo


def slice_request(share: str | None, model: str | None, offers) -> dict:
    """The ledger arguments of a start that asks for ``share`` (None: whole GPUs): the model and
    how many parts its GPUs are split in; a refusal saying what may be asked otherwise."""
    if share is None:
        return {}
    try:
        offer = slices.resolve_share(share, model, offers)
    except ValueError as e:
        raise policy.Refusal(f"{str(e)[0].upper()}{str(e)[1:].rstrip('.')}.", reason="bad_request") from None
    return {"model": offer.model, "slice_parts": offer.count}


def slice_env(allocation: AllocationInfo | None, mps: bool) -> dict[str, str]:
    """What a server on a slice runs with beyond its GPU ({} for whole GPUs)."""
    if allocation is None or not allocation.slice_parts or not allocation.gpus:
        return {}
    [g] = allocation.gpus
    env = {
        "GPUHUB_GPU_SLICE": f"1/{g.parts}",
        "GPUHUB_GPU_SLICE_PART": str(g.part),
        "GPUHUB_GPU_MEMORY_MIB": "" if g.memory_mib is None else str(g.memory_mib),
        "GPUHUB_SLICE_MPS": "1" if mps else "0",
    }
    if mps and g.uuid:
        env["GPUHUB_SLICE_UUID"] = g.uuid
    return env
