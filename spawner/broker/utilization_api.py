"""The broker's GPU-use API (version 1, in ``openapi.yaml``).

- ``POST allocations/{id}/samples``: a server or engine reports its GPUs' utilization and
  memory (and, from a server, how long ago its kernels were last active). Only the owner's
  token, only for the allocation's own GPUs. The answer is the allocation's idle verdict,
  which the server writes to its log.
- ``POST nodes/{node}/samples``: gpuhub's own sampler on a node reports its GPUs
  (:mod:`.sampling`); only a token with ``custom:gpuhub:sample``.
- ``GET utilization``: the live grid. Admins see every GPU and every user; a user sees the
  GPUs they hold.
- ``GET reclaims``: reclaims with their reasons and the idle GPU-hours they ended, per user
  and in total (a user sees their own).
- ``GET preemptions``: borrowed allocations taken back, with their reasons, and per user the
  borrowed GPU-hours and the preemptions of the period (a user sees their own).
"""

from __future__ import annotations

from datetime import timedelta

from tornado import web

from spawner.broker import access
from spawner.broker import requests as schemas
from spawner.broker import responses as views
from spawner.broker.handlers import APIHandler
from spawner.broker.utilization import epoch
from spawner.ledger import utcnow
from spawner.ledger.reclaims import totals
from spawner.policy import values
from spawner.policy.energy import JOULES_PER_KWH, reclaim_saving


class SamplesHandler(APIHandler):
    async def post(self, allocation_id: str):
        caller, a = await self.find_allocation(allocation_id)
        if caller.name != a.user and not access.is_admin(caller):
            raise web.HTTPError(404, f"No allocation {allocation_id} of yours.")
        wait = self.broker.utilization.admit(a)
        if wait:
            self.set_header("Retry-After", str(max(1, round(wait))))
            return self.fail(
                429,
                f"Allocation {a.id} reported more often than c.GpuReclaim.reports_per_gpu_minute allows; "
                f"this report was not stored. Try again in {wait:.0f} s.",
                "too_many_reports",
            )
        try:
            body = schemas.parse_json_object(self.request.body, self.broker.settings.max_body_bytes)
            report = schemas.parse_samples(body)
        except schemas.BadRequest as e:
            return self.fail(400, str(e), "bad_request")
        self.broker.count_refused(report.refused, f"allocation {a.id}'s reporter")
        if not a.active:
            return self.fail(409, f"Allocation {a.id} was already released ({a.end_reason}).", "released")
        held = {(g.node, g.index) for g in a.gpus}
        stray = [f"{s.node}:{s.index}" for s in report.samples if (s.node, s.index) not in held]
        if stray:
            return self.fail(
                400, f"GPU {', '.join(stray)} is not one of allocation {a.id}'s GPUs.", "not_its_gpu"
            )
        broker = self.broker
        rules = broker.reclaim_rules
        if report.samples:  # the owner's word: decisive only where c.GpuReclaim.readings says so
            decisive = broker.readings == "owners"
            broker.utilization.add_samples(a, report.samples, rules.threshold, rules.stale_after, decisive)
        if report.idle_seconds is not None:
            broker.utilization.add_activity(a, report.idle_seconds)
        verdict = broker.utilization.verdicts.get(a.id)
        self.finish({"allocation_id": a.id, "idle": views.idle_json(verdict, broker.utilization.clock())})


class UtilizationHandler(APIHandler):
    async def get(self):
        caller = self.require_caller()
        everyone = access.is_admin(caller)
        if not everyone and not access.may_manage_own(caller):
            raise web.HTTPError(403, f"{caller.kind} {caller.name} has no gpuhub allocations scope.")
        broker = self.broker
        table = await broker.run(broker.ledger.gpu_table)
        if not everyone:
            table = [mine for st in table if (mine := st.mine(caller.name)) is not None]
        self.finish(views.utilization_json(table, broker.utilization, broker.reclaim_rules.stale_after))


class _SinceHandler(APIHandler):
    def since_argument(self, now):
        """``since`` (default: the usage days), or None with a 400 sent."""
        try:
            since = self.time_argument("since", f"{self.broker.settings.usage_days}d", now)
        except values.BadValue as e:
            return self.fail(400, str(e), "bad_request")
        if since > now + timedelta(seconds=1):
            return self.fail(400, "'since' is in the future.", "bad_request")
        return since


class ReclaimsHandler(_SinceHandler):
    async def get(self):
        who = self.whose("reclaims")
        now = utcnow()
        since = self.since_argument(now)
        if since is None:
            return
        found = await self.broker.run(self.broker.ledger.reclaims, who, since)
        per_user = totals(found)
        saved = await self.savings(found, now)
        shown = [{**views.reclaim_json(r), "saved_kwh_estimate": saved[r.id]} for r in found]
        self.finish(
            {
                "since": views.iso(since),
                "reclaims": shown,
                "users": per_user,
                "total": {
                    "reclaims": len(found),
                    "gpu_hours": round(sum(r.gpu_hours for r in found), 4),
                    "saved_kwh_estimate": round(sum(v for v in saved.values() if v is not None), 6),
                },
            }
        )

    async def savings(self, found, now) -> dict[int, float | None]:
        """Each reclaim's estimated saving in kWh at the GPUs (``policy.energy.reclaim_saving``;
        None where its GPUs were never measured idle)."""
        ledger = self.broker.ledger
        used = await self.broker.run(ledger.energy_per_allocation, [r.allocation_id for r in found])
        out = {}
        for r in found:
            a = await self.broker.run(ledger.get, r.allocation_id)
            e = used.get(r.allocation_id)
            ends = a.time_ends if a is not None else None
            joules = reclaim_saving(
                e.idle_watts if e is not None else None,
                r.gpus,
                r.idle_seconds,
                epoch(r.created),
                epoch(ends) if ends is not None else None,
                epoch(now),
            )
            out[r.id] = None if joules is None else round(joules / JOULES_PER_KWH, 6)
        return out


class PreemptionsHandler(_SinceHandler):
    async def get(self):
        who = self.whose("preemptions")
        now = utcnow()
        since = self.since_argument(now)
        if since is None:
            return
        ledger = self.broker.ledger
        found = await self.broker.run(ledger.preemption_records, who, since)
        admin = access.is_admin(self.require_caller())  # for_user: admins only
        per_user = await self.broker.run(ledger.borrowing_totals, since, now, who)
        self.finish(
            {
                "since": views.iso(since),
                "preemptions": [views.preemption_json(n, admin) for n in found],
                "users": per_user,
                "total": {
                    "preemptions": len(found),
                    "borrowed_gpu_hours": round(sum(t["borrowed_gpu_hours"] for t in per_user.values()), 4),
                },
            }
        )
