"""gpuhub's own GPU readings: the ones that decide idle reclaims (``c.GpuReclaim.readings``).

A user's server and engines report their GPUs' use (``gpu_magics.report.reporter``), but they run as
that user, who could report an idle GPU as busy and keep it from everyone who waits. With
``readings = "sampler"`` (the default) only readings taken by gpuhub itself, where the user
cannot write, move the idle clocks; the owners' reports are kept for their own view:

- **The broker's own machine**: the broker (the hub's account) samples every GPU of the nodes
  its inventory has on this machine (a local backend's NVML inventory; every node of a
  simulated one) each ``c.GpuHub.report_seconds``, through the source a server would use
  (``gpu_magics.report.gpustats``: NVML, or the simulated file).
- **Other machines** (Slurm nodes): ``gpuhub sampler`` on each node, run as root or the hub's
  account (:mod:`spawner.cli.sampler`), posts its node's readings to ``POST nodes/{node}/samples``
  with a token that holds ``custom:gpuhub:sample`` (the ``gpuhub-sampler`` role), which no
  user's token has.

A GPU that nobody samples has unknown use, and is never reclaimed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence

from tornado import web

from spawner.broker import requests as schemas
from spawner.broker.access import SAMPLE_SCOPE
from spawner.broker.handlers import APIHandler
from spawner.broker.utilization import Sample
from spawner.policy.records import AllocationInfo

log = logging.getLogger("gpuhub.broker")


def own_nodes(readings: str, inventory: str, local_nodes: Iterable[str]) -> frozenset[str]:
    """The nodes whose GPUs the broker samples itself (pure): those of its own machine, when
    gpuhub's sampler decides; a Slurm inventory's nodes are other machines."""
    if readings != "sampler" or inventory == "slurm":
        return frozenset()
    return frozenset(local_nodes)


def holders_in(table) -> dict[tuple[str, int], tuple[AllocationInfo, ...]]:
    """Who holds each GPU of the ledger's ``gpu_table``: its holder, or its slices' holders."""
    out = {}
    for st in table:
        found = (st.holder,) if st.holder is not None else tuple(h for _g, h in st.slices)
        if found:
            out[(st.gpu.node, st.gpu.index)] = found
    return out


def by_holder(
    samples: Iterable[Sample], holders: Mapping[tuple[str, int], Sequence[AllocationInfo]]
) -> list[tuple[AllocationInfo | None, list[Sample]]]:
    """``samples`` grouped by the live allocations that hold each GPU (None: held by nobody;
    a GPU held in slices: its reading on each slice holder's clock), in the order first seen
    (pure)."""
    groups: dict[int | None, tuple[AllocationInfo | None, list[Sample]]] = {}
    for s in samples:
        found = holders.get((s.node, s.index)) or (None,)
        for a in found:
            groups.setdefault(None if a is None else a.id, (a, []))[1].append(s)
    return list(groups.values())


def ingest(broker, samples: list[Sample], table) -> int:
    """Store gpuhub's own readings as decisive; the allocations that hold those GPUs (in
    ``table``, the ledger's ``gpu_table`` read for this report) get them on their idle clocks.
    Returns how many allocations were updated."""
    holders = holders_in(table)
    rules = broker.reclaim_rules
    updated = 0
    for a, group in by_holder(samples, holders):
        if a is None:
            broker.utilization.record(group)
        else:
            broker.utilization.add_samples(a, group, rules.threshold, rules.stale_after)
            updated += 1
    return updated


async def meter(broker, samples: list[Sample], table) -> int:
    """The energy since each sampled GPU's last reading, written to the ledger for the
    allocations that held it (:mod:`.energy_meter`); returns how many rows changed."""
    holders = holders_in(table)
    broker.energy.note_models(table)
    left = broker.energy.left_holders(samples, holders)
    ended = await broker.run(broker.ledger.ended_times, left) if left else {}
    rules = broker.reclaim_rules
    shares = broker.energy.observe(samples, holders, ended, rules.threshold, rules.stale_after)
    if not shares:
        return 0
    changed = await broker.run(broker.ledger.add_energy, shares)
    broker.energy.count(shares)
    return changed


class OwnSampler:
    """The broker's sampler of the GPUs on its own machine (see the module's docstring)."""

    def __init__(self, broker, nodes: frozenset[str], environ: Mapping[str, str]):
        self.broker, self.nodes, self.environ = broker, nodes, dict(environ)
        self.source = None
        self.failed = False

    def _sample(self, gpus: list[tuple[str, int]]) -> list[Sample]:
        from gpu_magics.report.gpustats import make_source

        if self.source is None:
            self.source = make_source(self.environ)
        out = []
        for node in sorted({n for n, _ in gpus}):
            for s in self.source.sample(node, [i for n, i in gpus if n == node]):
                out.append(
                    Sample(
                        s.node,
                        s.index,
                        s.utilization,
                        s.memory_used_mib,
                        s.memory_total_mib,
                        s.power_watts,
                        s.energy_mj,
                    )
                )
        return out

    async def tick(self) -> int:
        """Sample once; the number of allocations whose readings came in."""
        table = await self.broker.run(self.broker.ledger.gpu_table)
        gpus = [(st.gpu.node, st.gpu.index) for st in table if st.present and st.gpu.node in self.nodes]
        if not gpus:
            return 0
        try:
            samples = await asyncio.to_thread(self._sample, gpus)
        except Exception as e:  # NVML gone, a bad file: unknown use, never a reclaim
            if not self.failed:
                log.warning(
                    "gpuhub's own GPU sampler cannot read the GPUs here (%s): their use is unknown", e
                )
            self.failed = True
            self.source = None
            return 0
        if self.failed:
            log.info("gpuhub's own GPU sampler reads the GPUs again")
            self.failed = False
        updated = ingest(self.broker, samples, table)
        await meter(self.broker, samples, table)
        return updated


class NodeSamplesHandler(APIHandler):
    """``POST nodes/{node}/samples``: a node's sampler (``gpuhub sampler``) reports every GPU
    of its node. Only a caller with ``custom:gpuhub:sample``."""

    async def post(self, node: str):
        caller = self.require_caller()
        if SAMPLE_SCOPE not in caller.scopes:
            raise web.HTTPError(
                403,
                f"{caller.kind} {caller.name} may not report a node's GPUs: only gpuhub's sampler "
                f"(a token with {SAMPLE_SCOPE}, the gpuhub-sampler role) may.",
            )
        try:
            body = schemas.parse_json_object(self.request.body, self.broker.settings.max_body_bytes)
            report = schemas.parse_samples(body)
        except schemas.BadRequest as e:
            return self.fail(400, str(e), "bad_request")
        self.broker.count_refused(report.refused, f"node {node}'s sampler")
        stray = sorted({s.node for s in report.samples} - {node})
        if stray or report.idle_seconds is not None:
            return self.fail(
                400,
                f"A report for node {node} holds only that node's GPUs, and no idle_seconds"
                + (f" (it named {', '.join(stray)})." if stray else "."),
                "bad_request",
            )
        table = await self.broker.run(self.broker.ledger.gpu_table)
        known = {(st.gpu.node, st.gpu.index) for st in table}
        unknown = [f"{s.node}:{s.index}" for s in report.samples if (s.node, s.index) not in known]
        if unknown:
            return self.fail(400, f"GPU {', '.join(unknown)} is not in gpuhub's inventory.", "not_a_gpu")
        updated = ingest(self.broker, list(report.samples), table)
        await meter(self.broker, list(report.samples), table)
        self.finish({"node": node, "gpus": len(report.samples), "allocations": updated})
