"""What ``sinfo`` prints, parsed: the cluster's nodes, their GPUs and partitions. No I/O here.

Format relied on (Slurm 22.05 and later): ``sinfo -h -N -o '%N|%G|%P|%T'``, one line per
node and partition, e.g. ``gpu-node1|gpu:a100:4(S:0)|gpu*|idle`` (``*`` marks the default
partition). Slurm's hostlist syntax (``gpu-node[1-2,4]``), which ``squeue`` prints too, is
read here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from spawner.policy.placement import Gpu
from spawner.slurm import SlurmError

SINFO_FORMAT = "%N|%G|%P|%T"


def expand_hostlist(expr: str) -> list[str]:
    """``gpu-node[1-2,4],login01`` to its host names (Slurm's hostlist syntax, zero padding kept)."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", expr.strip()):
        m = re.fullmatch(r"([^\[]*)\[([^\]]+)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            width = len(lo)
            for n in range(int(lo), int(hi or lo) + 1):
                for rest in expand_hostlist(suffix) if "[" in suffix else [suffix]:
                    hosts.append(f"{prefix}{n:0{width}d}{rest}")
    return hosts


def parse_index_list(text: str) -> list[int]:
    """``0-1,3`` to ``[0, 1, 3]``."""
    out: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, _, hi = item.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


@dataclass(frozen=True)
class GresEntry:
    type: str | None  # "a100", or None for untyped GPUs
    count: int


def parse_gres(text: str, name: str = "gpu") -> list[GresEntry]:
    """The GPU entries of a node's GRES string: ``gpu:a100:4(S:0),gpu:2`` -> entries in order.
    ``name="shard"``: its ``gres/shard`` entries (``shard:a100:16``, GPU slices)."""
    out = []
    for item in re.split(r",(?![^(]*\))", text or ""):
        item = re.sub(r"\(.*\)$", "", item.strip())
        fields = item.split(":")
        if fields[0] != name or len(fields) < 2:
            continue
        count = fields[-1]
        if not count.isdigit():
            continue
        out.append(GresEntry(fields[1] if len(fields) == 3 else None, int(count)))
    return out


@dataclass(frozen=True)
class SlurmNode:
    name: str
    gres: tuple[GresEntry, ...]
    partitions: tuple[str, ...]
    state: str
    shards: tuple[GresEntry, ...] = ()  # gres/shard, typed as its GPUs (spawner.slurm.shards)

    def gpus(self, untyped_model: str = "GPU") -> list[Gpu]:
        """The node's GPUs, indexed as Slurm indexes them (gres.conf order, from 0)."""
        out, index = [], 0
        for entry in self.gres:
            for _ in range(entry.count):
                out.append(Gpu(self.name, index, entry.type or untyped_model))
                index += 1
        return out


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[SlurmNode, ...]
    partitions: tuple[str, ...]  # the default partition first, then by name
    default_partition: str | None

    def partition_nodes(self, partition: str) -> set[str]:
        return {n.name for n in self.nodes if partition in n.partitions}

    def inventory(self, untyped_model: str = "GPU") -> list[Gpu]:
        return [g for n in self.nodes for g in n.gpus(untyped_model)]


def parse_sinfo(text: str) -> Cluster:
    nodes: dict[str, dict] = {}
    partitions: list[str] = []
    default = None
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.split("|")
        if len(fields) != 4:
            raise SlurmError(f"unexpected sinfo line: {line!r}")
        name, gres, partition, state = (f.strip() for f in fields)
        if partition.endswith("*"):
            partition = partition[:-1]
            default = partition
        if partition not in partitions:
            partitions.append(partition)
        node = nodes.setdefault(
            name,
            {
                "gres": tuple(parse_gres(gres)),
                "partitions": [],
                "state": state,
                "shards": tuple(parse_gres(gres, "shard")),
            },
        )
        node["partitions"].append(partition)
    return Cluster(
        nodes=tuple(
            SlurmNode(name, d["gres"], tuple(d["partitions"]), d["state"].rstrip("*~#$@+^-"), d["shards"])
            for name, d in sorted(nodes.items())
        ),
        partitions=tuple(sorted(partitions, key=lambda p: (p != default, p))),
        default_partition=default,
    )
