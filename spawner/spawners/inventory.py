"""Where the GPUs come from: NVML on a real GPU server, a simulated list, or a Slurm cluster.

``SOURCES`` holds one :class:`Source` per ``c.GpuHub.inventory``; :func:`read_inventory` and
:func:`local_nodes` ask the configured one. ``parse_simulated`` and ``nvml_gpus`` return
:class:`spawner.policy.placement.Gpu` tuples; the ledger is synced from them when the hub starts
(``Ledger.sync_inventory``), which keeps every existing allocation.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spawner.policy.placement import Gpu

if TYPE_CHECKING:
    from spawner.ledger import Ledger
    from spawner.settings import GpuHub


class InventoryError(RuntimeError):
    """The inventory cannot be read; the message says what to configure."""


def parse_simulated(entries: Iterable[Mapping[str, Any]]) -> tuple[Gpu, ...]:
    """``[{"node": "n1", "count": 4, "model": "A100", "memory_mib": 40960}]`` to GPUs.

    Indices run from 0 on each node unless an entry gives ``"first_index"``.
    """
    gpus: list[Gpu] = []
    for i, entry in enumerate(entries):
        unknown = set(entry) - {"node", "count", "model", "memory_mib", "first_index"}
        if unknown:
            raise InventoryError(
                f"c.GpuHub.simulated_gpus[{i}] has unknown keys {sorted(unknown)}; "
                "use node, count, model, memory_mib, first_index, e.g. "
                '{"node": "gpu1", "count": 4, "model": "A100"}'
            )
        count = entry.get("count")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InventoryError(
                f"c.GpuHub.simulated_gpus[{i}]['count'] must be a whole number >= 0; got {count!r}"
            )
        node = str(entry.get("node") or socket.gethostname())
        first = int(entry.get("first_index", 0))
        for k in range(count):
            gpus.append(
                Gpu(
                    node=node,
                    index=first + k,
                    model=str(entry.get("model", "Simulated GPU")),
                    memory_mib=entry.get("memory_mib"),
                    uuid=f"GPU-SIMULATED-{node}-{first + k}",
                )
            )
    return checked(gpus)


def checked(gpus: Iterable[Gpu]) -> tuple[Gpu, ...]:
    """Sorted; a (node, index) pair listed twice is refused, since it would be booked twice."""
    seen: set[tuple[str, int]] = set()
    for g in gpus:
        if (g.node, g.index) in seen:
            raise InventoryError(f"GPU {g.label} appears twice in the inventory")
        seen.add((g.node, g.index))
    return tuple(sorted(gpus))


def nvml_gpus(node: str | None = None, nvml: Any = None) -> tuple[Gpu, ...]:
    """The GPUs NVML reports on this machine, indexed in PCI bus order.

    NVML's own index is PCI bus order, the same as CUDA with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``,
    which the spawner sets, so an index here is the index a server's CUDA sees.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as e:  # pragma: no cover - nvidia-ml-py is a dependency
            raise InventoryError("nvidia-ml-py is not installed: pip install nvidia-ml-py") from e
    node = node or socket.gethostname()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise InventoryError(
            f"NVML could not start ({e}): this machine has no NVIDIA driver. For a machine "
            "without GPUs use simulated ones: c.GpuHub.inventory = 'simulated' and "
            'c.GpuHub.simulated_gpus = [{"count": 4, "model": "Simulated GPU"}]'
        ) from e
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            uuid = nvml.nvmlDeviceGetUUID(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024)
            gpus.append(
                Gpu(
                    node=node,
                    index=i,
                    model=name.decode() if isinstance(name, bytes) else str(name),
                    memory_mib=int(mem),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                )
            )
        return checked(gpus)
    finally:
        nvml.nvmlShutdown()


@dataclass(frozen=True)
class Source:
    """One kind of inventory: its GPUs, and the ledger nodes it speaks for."""

    gpus: Callable[[GpuHub], tuple[Gpu, ...]]
    nodes: Callable[[GpuHub], set[str]]


def _host(settings: GpuHub) -> str:
    return settings.node_name or socket.gethostname()


def _slurm_gpus(settings: GpuHub) -> tuple[Gpu, ...]:
    from spawner.slurm.cluster import read_cluster

    return tuple(read_cluster(max_age=0).inventory())


def _slurm_nodes(settings: GpuHub) -> set[str]:
    from spawner.slurm.cluster import read_cluster

    return {n.name for n in read_cluster().nodes}


SOURCES: dict[str, Source] = {
    "nvml": Source(gpus=lambda s: nvml_gpus(_host(s)), nodes=lambda s: {_host(s)}),
    "simulated": Source(
        gpus=lambda s: parse_simulated(s.simulated_gpus),
        nodes=lambda s: {g.node for g in parse_simulated(s.simulated_gpus)},
    ),
    "slurm": Source(gpus=_slurm_gpus, nodes=_slurm_nodes),
}


def read_inventory(settings: GpuHub) -> tuple[Gpu, ...]:
    """The GPUs of ``c.GpuHub.inventory``."""
    return SOURCES[settings.inventory].gpus(settings)


def local_nodes(settings: GpuHub) -> set[str]:
    """The ledger nodes this inventory speaks for (a Slurm hub: every node of the cluster)."""
    return SOURCES[settings.inventory].nodes(settings)


def sync(ledger: Ledger, settings: GpuHub) -> None:
    """Write this inventory to ``ledger``: its nodes' GPUs; GPUs other machines reported stay."""
    ledger.sync_inventory(read_inventory(settings), nodes=local_nodes(settings))
