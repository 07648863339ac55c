"""The broker's energy meter: gpuhub's own readings of each GPU (``sampling.ingest``), turned
into energy per allocation and day (:mod:`spawner.policy.energy`) and written to the ledger.

Only readings a user cannot write count (the broker's own sampler, ``gpuhub sampler`` on the
nodes): a user's reporter's power goes to the owner's view alone. In memory it keeps, per GPU,
the last reading and the allocations that held the GPU then (one, or the holders of its slices,
each with its share); a restarted broker starts again from its next reading, and the time in
between is counted as unknown for whoever held the GPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from spawner.broker.requests import MAX_GPU_WATTS
from spawner.broker.utilization import Sample, epoch
from spawner.policy import energy
from spawner.policy.records import AllocationInfo

log = logging.getLogger("gpuhub.broker")

Key = tuple[str, int]
# who holds each GPU: its one holder, or the holders of its slices
Holders = Mapping[Key, AllocationInfo | Sequence[AllocationInfo]]


@dataclass(frozen=True)
class Held:
    """Who held a GPU at a reading, and their part of it (a slice's share)."""

    allocation_id: int
    start: float
    share: float = 1.0


def holders_of(holders: Holders, key: Key) -> tuple[AllocationInfo, ...]:
    got = holders.get(key)
    if got is None:
        return ()
    return (got,) if isinstance(got, AllocationInfo) else tuple(got)


def _held(a: AllocationInfo) -> Held:
    return Held(a.id, epoch(a.created), 1.0 / a.slice_parts if a.slice_parts else 1.0)


class EnergyMeter:
    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.last: dict[Key, energy.Point] = {}
        self.held: dict[Key, tuple[Held, ...]] = {}
        self.power: dict[Key, tuple[float, float]] = {}  # the last power read: (time, watts)
        self.models: dict[Key, str] = {}  # each sampled GPU's model (the metrics' label)
        self.owners: dict[int, tuple[str, str]] = {}  # allocation id: (user, purpose)
        # every user's energy by purpose, all history: the ledger's at the start, then what this
        # meter wrote (the metrics' counters, read without a query per scrape)
        self.totals: dict[tuple[str, str], energy.Energy] = {}

    def seed(self, totals: Mapping[tuple[str, str], energy.Energy]) -> None:
        self.totals = dict(totals)

    def count(self, shares: Iterable[energy.Share]) -> None:
        """Add what was written to the ledger to the counters."""
        for sh in shares:
            owner = self.owners.get(sh.allocation_id)
            if owner is None:
                continue
            e = energy.Energy(
                sh.joules, sh.idle_joules, sh.measured_seconds, sh.unknown_seconds, sh.idle_seconds
            )
            self.totals[owner] = self.totals.get(owner, energy.Energy()).plus(e)
        # an allocation that holds no GPU any more has had its last share: forget its owner
        held = {h.allocation_id for hs in self.held.values() for h in hs}
        for gone in [i for i in self.owners if i not in held]:
            del self.owners[gone]

    def note_models(self, table) -> None:
        """Each GPU's model, from the ledger's table the sampler read anyway."""
        for st in table:
            self.models[(st.gpu.node, st.gpu.index)] = st.gpu.model

    def holder_user(self, key: Key) -> str:
        """Who held the GPU at its last reading ("" nobody; the holders of its slices, joined)."""
        owners = (self.owners.get(h.allocation_id) for h in self.held.get(key, ()))
        return ",".join(sorted({o[0] for o in owners if o is not None}))

    def left_holders(self, samples: Iterable[Sample], holders: Holders) -> set[int]:
        """The allocations that held a GPU at its last reading and no longer do: their end
        times are needed (``ledger.ended_times``) to share the interval fairly."""
        out = set()
        for s in samples:
            key = (s.node, s.index)
            now = {a.id for a in holders_of(holders, key)}
            out |= {h.allocation_id for h in self.held.get(key, ()) if h.allocation_id not in now}
        return out

    def observe(
        self,
        samples: Iterable[Sample],
        holders: Holders,
        ended: Mapping[int, datetime | None],
        threshold: float,
        max_gap: float,
        now: float | None = None,
    ) -> list[energy.Share]:
        """The energy since each GPU's last reading, shared among the allocations that held it
        (a slice's holder gets its share of the GPU's energy)."""
        now = self.clock() if now is None else now
        out: list[energy.Share] = []
        for s in samples:
            key = (s.node, s.index)
            point = energy.Point(now, s.power_watts, s.energy_mj, s.utilization < threshold)
            found = holders_of(holders, key)
            current = tuple(_held(a) for a in found)
            for a in found:
                self.owners[a.id] = (a.user, a.purpose)
            before, prev = self.held.get(key, ()), self.last.get(key)
            if s.power_watts is not None:
                self.power[key] = (now, s.power_watts)
            self.last[key], self.held[key] = point, current
            if prev is None:
                continue  # the first reading of this GPU: nothing to integrate yet
            spans = []
            staying = {c.allocation_id for c in current}
            first = min((c.start for c in current), default=None)
            for b in before:
                if b.allocation_id in staying:
                    continue
                end = ended.get(b.allocation_id)
                # where its end is not known, it held the GPU until the next holder began
                end_t = epoch(end) if end is not None else (first if first is not None else now)
                spans.append(energy.Span(b.allocation_id, b.start, end_t, b.share))
            spans += [energy.Span(c.allocation_id, c.start, None, c.share) for c in current]
            if not spans:
                continue
            iv = energy.interval(prev, point, max_gap, MAX_GPU_WATTS)
            out.extend(energy.attribute(iv, spans))
        return energy.merge(out)

    def watts(self, key: Key, stale_after: float, now: float | None = None) -> float | None:
        """The GPU's last power reading, if it is recent."""
        now = self.clock() if now is None else now
        got = self.power.get(key)
        if got is None or now - got[0] > stale_after:
            return None
        return got[1]
