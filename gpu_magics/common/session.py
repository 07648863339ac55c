"""What the notebook server was given: read from the variables the GPU spawner sets.

The spawner (spawner/spawners/base.py ``make_gpu_env``) sets ``CUDA_VISIBLE_DEVICES`` (PCI bus
order), ``GPUHUB_ALLOCATION_ID``, ``GPUHUB_GPUS`` (``node:index`` labels), ``GPUHUB_NODE``
and ``GPUHUB_GPU_MODEL``; on a slice of a GPU (``c.GpuHub.gpu_slices``) also
``GPUHUB_GPU_SLICE`` (``1/4``) and ``GPUHUB_GPU_MEMORY_MIB`` (its part of the memory), its label
then ``node:indexsN`` (slice N). Outside gpuhub none of them is set.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpu_magics.common.words import count

_SLICE = re.compile(r"s\d+$")  # a slice's label: node:index then sN


@dataclass(frozen=True)
class ServerGpus:
    on_gpuhub: bool
    allocation_id: int | None
    gpus: tuple[str, ...]
    cuda_visible_devices: str | None
    model: str | None
    slice: str | None = None  # "1/4": the server holds that slice of its one GPU
    slice_memory_mib: int | None = None
    backend: str = "local"

    @property
    def whole_labels(self) -> tuple[str, ...]:
        """The GPUs themselves (``node:index``): a slice's is the GPU it is a slice of."""
        return tuple(_SLICE.sub("", g) for g in self.gpus)

    @property
    def pool_gpus(self) -> tuple[str, ...]:
        """The server's GPUs a ``%%distributed`` pool or a Dask cluster may run on: none of a
        slice (a pool runs on whole GPUs; NCCL needs them), which then takes a burst of its own."""
        return () if self.slice else self.gpus


def backend(environ: Mapping[str, str] | None = None) -> str:
    """Which backend started this server: ``"slurm"`` or ``"local"``. The one reader of
    ``GPUHUB_BACKEND`` (set by the Slurm spawner in the server's environment)."""
    env = os.environ if environ is None else environ
    return "slurm" if env.get("GPUHUB_BACKEND") == "slurm" else "local"


def _slurm_gpus(env: Mapping[str, str]) -> tuple[str, ...]:
    """A Slurm server's GPUs as node:index, from what Slurm sets inside the job (the
    node's own indices, whatever CUDA_VISIBLE_DEVICES numbering the cluster uses)."""
    if backend(env) != "slurm":
        return ()
    node = env.get("SLURMD_NODENAME", "")
    return tuple(f"{node}:{i}" for i in env.get("SLURM_JOB_GPUS", "").split(",") if i.strip())


def server_gpus(environ: Mapping[str, str] | None = None) -> ServerGpus:
    env = os.environ if environ is None else environ
    on_gpuhub = "GPUHUB_ALLOCATION_ID" in env
    raw_id = env.get("GPUHUB_ALLOCATION_ID", "")
    return ServerGpus(
        on_gpuhub=on_gpuhub,
        allocation_id=int(raw_id) if raw_id.isdigit() else None,
        gpus=tuple(g for g in env.get("GPUHUB_GPUS", "").split(",") if g) or _slurm_gpus(env),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        model=env.get("GPUHUB_GPU_MODEL") or None,
        slice=env.get("GPUHUB_GPU_SLICE") or None,
        slice_memory_mib=int(mib) if (mib := env.get("GPUHUB_GPU_MEMORY_MIB", "")).isdigit() else None,
        backend=backend(env),
    )


def describe(s: ServerGpus) -> str:
    if not s.on_gpuhub:
        return "This kernel does not run on a gpuhub server: no GPUs were allocated to it."
    if not s.gpus:
        return "This server has no GPUs (it was started with 0). Start it again with GPUs to use them."
    if s.slice:
        [label] = s.gpus[:1] or ("",)
        if s.slice_memory_mib:
            memory = f"{s.slice_memory_mib} MiB of its memory"
        elif s.backend == "slurm":  # a Slurm shard
            memory = "its memory not divided (Slurm's shards fence no memory between their jobs)"
        else:
            memory = "its memory unknown"
        return "\n".join(
            [
                f"Server allocation #{s.allocation_id}: a {s.slice} slice of GPU {s.whole_labels[0]} "
                f"({label}), {memory}, CUDA_VISIBLE_DEVICES={s.cuda_visible_devices or ''}",
                "  shared with other users' slices; %%distributed and Dask clusters run on whole GPUs "
                "of a burst, not on a slice.",
            ]
        )
    rows = [f"{'GPU':<12}{'CUDA index':<12}MODEL"]
    for i, label in enumerate(s.gpus):
        rows.append(f"{label:<12}{i:<12}{s.model or ''}")
    head = (
        f"Server allocation #{s.allocation_id}: {count(len(s.gpus), 'GPU')}, "
        f"CUDA_VISIBLE_DEVICES={s.cuda_visible_devices or ''}"
    )
    return "\n".join([head, *rows])
