"""Slices of GPUs (a part of :class:`spawner.ledger.Ledger`): ``c.GpuHub.gpu_slices``.

A slice holder holds its GPU's ``allocation_gpus`` row with its ``part`` (1 to ``parts``): the
partial unique indexes keep each part to one holder and a whole GPU to one holder; that a
GPU is never held whole and in parts at once is kept here, under the write lock, as the
limits are: a whole request sees a GPU held in any part as taken (``freeset``), and a slice
goes only on a GPU that is free or already split (:func:`spawner.policy.slices.place_slice`).

A slice counts as its share of a GPU against limits, in GPU-hours and in budgets
(``allocations.slice_parts``). It waits in the queue like any request: the queue's plan
places whole requests, then the waiting slices in the queue's order
(:func:`spawner.policy.slices.grant_slices`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from fractions import Fraction

from sqlalchemy.orm import Session

from spawner import policy
from spawner.policy import schedule as queueplan
from spawner.policy import slices
from spawner.policy.limits import zero_limit_message
from spawner.policy.records import AllocationRequest


class SliceRecords:
    """What slices may be asked for, where one starts now, and their part of the queue's plan.

    Uses ``_present``/``_free_state_in`` (``GpuRecords``) and ``budget_refusal_in``
    (``EnergyRecords``); admission calls ``check_slice_in`` and ``place_now_in``, the queue's
    scene ``plan_slices_in``."""

    def slice_uses_in(
        self, s: Session, offer: slices.Offer, on_nodes: frozenset[str] | None = None
    ) -> list[slices.GpuUse]:
        """Each present GPU of ``offer``'s model (on ``on_nodes``): free, held whole, or which
        of its slices are held."""
        present, state = self._present(s), self._free_state_in(s)
        gpus = [
            g for g in present.gpus if g.model == offer.model and (on_nodes is None or g.node in on_nodes)
        ]
        free = {g for node in {g.node for g in gpus} for g in state.groups.get(node, ())}  # one pass per node
        by_id = present.by_id
        split = {by_id[i]: held for i, held in state.split.items() if i in by_id}
        return slices.uses_of(gpus, free, split, offer.count)

    def slice_room(self) -> dict[str, tuple[slices.Offer, int, int]]:
        """Each offer, with how many of its slices could start now and how many there are."""
        with self._read() as s:
            out = {}
            for model, offer in self.slice_offers.items():
                uses = self.slice_uses_in(s, offer)
                out[model] = (offer, slices.free_slices(uses, offer), len(uses) * offer.count)
            return out

    def slice_room_by_node(self) -> dict[tuple[str, str, str], tuple[int, int]]:
        """The metrics' slices: (node, model, size such as ``1/4``) to (held, could start now)."""
        out: dict[tuple[str, str, str], tuple[int, int]] = {}
        with self._read() as s:
            for model, offer in self.slice_offers.items():
                for u in self.slice_uses_in(s, offer):
                    key = (u.gpu.node, model, f"1/{offer.count}")
                    held, free = out.get(key, (0, 0))
                    room = 0 if u.whole else offer.count - len(u.slices)
                    out[key] = (held + len(u.slices), free + room)
        return out

    def check_whole_in(self, req: AllocationRequest) -> None:
        """Refuse whole GPUs to a user whose every group takes slices (``c.GpuHub.slice_groups``)."""
        groups = set(req.groups)
        if not groups or not groups <= self.slice_groups:
            return
        offered = ", ".join(f"{o.label} of {o.model}" for o in self.slice_offers.values())
        ask = f"ask for {offered}" if offered else "no slices are offered here; ask an admin"
        purpose = "a %%distributed pool needs whole GPUs (NCCL runs on whole GPUs). " * (
            req.purpose == "distributed"
        )
        raise policy.Refusal(
            f"Members of {', '.join(sorted(groups))} take slices of GPUs here, not whole GPUs "
            f"(c.GpuHub.slice_groups): {purpose}{ask[0].upper() + ask[1:]}.",
            reason="over_limit",
            fits=0,
        )

    def offer_for(self, req: AllocationRequest) -> slices.Offer:
        """The offer a slice request asks for; a refusal saying what may be asked otherwise."""
        offer = self.slice_offers.get(req.model or "")
        if offer is None or offer.count != req.slice_parts:
            split = ", ".join(f"{o.model} ({o.label})" for o in self.slice_offers.values()) or "none"
            what = f"{req.model} GPUs are" if req.model else "A slice names its GPU model: no GPUs are"
            raise policy.Refusal(
                f"{what} not split in {req.slice_parts} here (slices offered: {split}). Ask for one of "
                "those, or for whole GPUs.",
                reason="bad_request",
            )
        if req.count != 1:
            raise policy.Refusal(
                f"A request for a slice is for one slice ({offer.label}); got {req.count}. "
                "For more, ask for whole GPUs.",
                reason="bad_request",
                fits=1,
            )
        return offer

    def check_slice_in(
        self,
        s: Session,
        req: AllocationRequest,
        eff: policy.EffectiveLimit,
        holdings: policy.Holdings,
    ) -> None:
        """The checks of a slice request a user can act on, in order: what is offered, a GPU
        it could ever run on, the GPU-hours quota, the limit (in GPUs: a slice is its share),
        the energy budget. What is free now is the queue's."""
        offer = self.offer_for(req)
        if not self.slice_uses_in(s, offer, req.on_nodes):
            where = "on this server" if req.on_nodes is not None else "here"
            raise policy.Refusal(
                f"No {offer.model} GPU is {where} to take a slice of. Ask for another model.",
                reason="too_large",
                fits=0,
            )
        lim, asked = eff.limit, Fraction(1, offer.count)
        if lim.max_gpus == 0:
            raise policy.Refusal(zero_limit_message(1, eff), reason="over_limit", fits=0)
        if lim.gpu_hours is not None and holdings.gpu_hours >= lim.gpu_hours:
            raise policy.Refusal(
                f"You have used {holdings.gpu_hours:.1f} of your {lim.gpu_hours:g} GPU-hours over the "
                f"last {lim.window_hours:g} hours ({eff.source}). Start a server without GPUs (0), "
                "or wait until older usage leaves the window.",
                reason="quota_exhausted",
                fits=0,
            )
        room = policy.remaining(eff, holdings)
        if room is not None and asked > room:
            raise policy.Refusal(
                f"You asked for {offer.label}, but you hold {slices.units_text(Fraction(holdings.held))} "
                f"of {policy.describe_limit(eff)} GPUs, which leaves "
                f"{slices.units_text(Fraction(room))}. Stop something you hold first, or ask an admin "
                "to raise your limit.",
                reason="over_limit",
                fits=0,
            )
        spent = self.budget_refusal_in(s, req.user, req.groups)
        if spent:
            raise policy.Refusal(spent, reason="energy_budget_spent", fits=0)

    def place_now_in(
        self, s: Session, req: AllocationRequest, asked: policy.Request, free, inventory
    ) -> tuple[policy.Gpu, ...] | None:
        """Where ``req`` starts now with nothing waiting: whole GPUs where they fit, or one
        slice (on a GPU already split where one has room)."""
        if not req.slice_parts:
            return policy.place(asked, free, inventory)
        offer = self.offer_for(req)
        placed = slices.place_slice(self.slice_uses_in(s, offer, req.on_nodes), offer)
        return None if placed is None else (slices.slice_gpu(*placed, offer.count),)

    def plan_slices_in(
        self,
        s: Session,
        plan: queueplan.Plan,
        order: Sequence[int],
        waiting: Sequence[queueplan.Waiting],
        now: datetime,
        frees: Mapping[str, Sequence[tuple[datetime, str, int]]] = {},
    ) -> None:
        """Add the waiting slices to ``plan`` (made for the whole requests): those that start
        now, on the GPUs its grants leave; the others expect to start as slices of their model
        free up (``frees``: when, how sure, how many), in the queue's order
        (:func:`spawner.policy.slices.expected_starts`)."""
        waits, uses = {}, {}
        for w in waiting:
            if not w.slice_parts:
                continue
            offer = self.slice_offers.get(w.request.model or "")
            if offer is None or offer.count != w.slice_parts:
                plan.expected[w.id] = queueplan.Expected(None, "unknown")  # offered no longer
                continue
            waits[w.id] = slices.SliceWait(w.id, offer, w.on_nodes)
            if offer.model not in uses:
                # granted whole now: no slice there (one reserved for a whole request is kept
                # from the slices behind that request: grant_slices)
                taken = {g for gpus in plan.grants.values() for g in gpus}
                uses[offer.model] = [
                    slices.GpuUse(u.gpu, whole=True) if u.gpu in taken else u
                    for u in self.slice_uses_in(s, offer)
                ]
        whole_waits = [w.id for w in waiting if not w.slice_parts and w.id not in plan.grants]
        all_uses = [u for model_uses in uses.values() for u in model_uses]
        for entry, g in slices.grant_slices(order, waits, whole_waits, all_uses, plan.reserved).items():
            plan.grants[entry] = (g,)
            plan.expected[entry] = queueplan.Expected(now, "now")
        left = {
            m: [e for e in order if e in waits and e not in plan.grants and waits[e].offer.model == m]
            for m in uses
        }
        for model, entries in left.items():
            for entry, when in zip(
                entries, slices.expected_starts(frees.get(model, ()), len(entries)), strict=True
            ):
                if when is not None:
                    plan.expected[entry] = queueplan.Expected(*when)
        for entry in waits:
            plan.expected.setdefault(entry, queueplan.Expected(None, "slice"))
