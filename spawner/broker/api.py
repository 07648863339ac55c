"""The broker's REST API, version 1 (``openapi.yaml`` is its contract).

User: ``GET me``, ``GET/POST allocations``, ``GET/DELETE allocations/{id}``,
``POST allocations/{id}/renew``, ``GET usage``. Admin: ``GET limits``,
``PUT/DELETE limits/{scope}[/{name}]``, ``GET cluster``, and every allocation and user.
"""

from __future__ import annotations

import time
from datetime import timedelta

from tornado import web
from tornado.escape import url_unescape

from spawner import policy
from spawner.broker import access, energy_views
from spawner.broker import requests as schemas
from spawner.broker import responses as views
from spawner.broker.handlers import APIHandler
from spawner.ledger import utcnow
from spawner.policy import values
from spawner.policy.energy import figures


class MeHandler(APIHandler):
    async def get(self):
        caller = self.require_caller()
        if not access.may_manage_own(caller):
            raise web.HTTPError(403, f"{caller.kind} {caller.name} has no gpuhub allocations scope.")
        groups = await self.broker.groups_of(caller.name)
        ledger = self.broker.ledger
        allowance = await self.broker.run(ledger.allowance, caller.name, groups)
        allocations = await self.broker.run(ledger.active, user=caller.name)
        notices = await self.broker.run(ledger.reclaim_notices, caller.name)
        preempted = await self.broker.run(ledger.preemption_notices, caller.name)
        util = self.broker.utilization
        idle = {a.id: views.idle_json(util.verdicts.get(a.id), util.clock()) for a in allocations}
        used = await self.broker.run(ledger.energy_per_allocation, [a.id for a in allocations])
        me = views.me_json(
            caller.name,
            groups,
            allowance,
            allocations,
            idle,
            notices,
            preempted,
            ledger.time_warnings,
            ledger.clock(),
        )
        costing = self.broker.costing
        me["energy"] = energy_views.costing_json(costing)
        server = self.get_argument("server", None)
        if server is not None:  # ?server=NAME&since=TIME: that server's session so far
            try:
                since = self.time_argument("since", None, ledger.clock())
            except values.BadValue as e:
                return self.fail(400, str(e), "bad_request")
            if since is None:
                return self.fail(400, "'server' needs 'since': when that server started.", "bad_request")
            session = await self.broker.run(ledger.session_energy, caller.name, server, since)
            me["session"] = {"server": server, "since": views.iso(since), "energy": figures(session, costing)}
        for a in me["allocations"]:
            e = used.get(a["id"])
            # None: nothing measured yet (a new allocation, or GPUs gpuhub's sampler does not read)
            a["energy"] = None if e is None else figures(e, costing)
        self.finish(me)


class AllocationsHandler(APIHandler):
    async def get(self):
        caller = self.require_caller()
        who = self.get_argument("user", None)
        everyone = self.get_argument("all", "") in ("1", "true")
        if (everyone or (who and who != caller.name)) and not access.is_admin(caller):
            raise web.HTTPError(403, "Only gpuhub admins may list other users' allocations.")
        if not everyone and who in (None, caller.name) and not access.may_manage_own(caller):
            raise web.HTTPError(403, f"{caller.kind} {caller.name} has no gpuhub allocations scope.")
        where = {} if everyone else {"user": who or caller.name}
        found = await self.broker.run(self.broker.ledger.active, **where)
        self.finish({"allocations": [self.allocation_json(a) for a in found]})

    async def post(self):
        caller = self.require_caller()
        if not access.may_manage_own(caller):
            raise web.HTTPError(403, f"{caller.kind} {caller.name} may not request GPUs.")
        cfg = self.broker.settings
        metrics = self.broker.metrics
        try:
            body = schemas.parse_json_object(self.request.body, cfg.max_body_bytes)
            req = schemas.parse_burst_request(body, max_lease_seconds=cfg.max_lease_seconds)
        except schemas.BadRequest as e:
            metrics.refusals.labels(reason="bad_request").inc()
            return self.fail(400, str(e), "bad_request")
        if req.node is not None and self.broker.backend == "slurm":
            # Slurm's scheduler places a burst's job; the ledger cannot promise a node for it
            metrics.refusals.labels(reason="bad_request").inc()
            return self.fail(
                400,
                "'node' is for the local backend; on Slurm, leave it out (Slurm places the job).",
                "bad_request",
            )
        if req.node is not None:
            table = await self.broker.run(self.broker.ledger.gpu_table)
            if req.node not in {st.gpu.node for st in table if st.present}:
                metrics.refusals.labels(reason="bad_request").inc()
                return self.fail(
                    400, f"There is no node {values.show(req.node)} with GPUs here.", "bad_request"
                )
        groups = await self.broker.groups_of(caller.name)
        started = time.perf_counter()
        slurm = self.broker.backend == "slurm"
        ledger = self.broker.ledger
        queued = req.wait and not slurm  # on Slurm, the job waits in Slurm's own queue
        try:
            got = await self.broker.run(
                ledger.request if queued else ledger.allocate,
                caller.name,
                groups,
                req.gpus,
                purpose="distributed",
                model=req.gpu_model,
                max_nodes=req.nodes,
                gpus_per_node=req.gpus_per_node,
                backend=self.broker.backend,
                lease_seconds=req.lease_seconds or cfg.lease_seconds,
                on_nodes=None if req.node is None else [req.node],
                server_name=req.server or "",
                of_server=req.server is not None,
                hours=req.hours,
                **({} if queued else {"deferred": slurm}),
            )
        except policy.Refusal as e:
            metrics.refusals.labels(reason=e.reason).inc()
            return self.fail(e.status_code, e.message, e.reason, fits=e.fits)
        allocation = got.allocation if queued else got
        if allocation is None:  # waiting: the caller polls POST queue/{id}/wait
            self.set_status(202)
            self.set_header("Location", f"{self.broker.prefix}api/v1/queue/{got.entry.id}")
            return self.finish({"queued": views.queue_json(got.entry, utcnow())})
        metrics.allocation_seconds.observe(time.perf_counter() - started)
        self.set_status(201)
        self.set_header("Location", f"{self.broker.prefix}api/v1/allocations/{allocation.id}")
        self.finish(self.allocation_json(allocation))


# DELETE allocations/{id}?why=...: what the owner's own processes may say about a release
RELEASE_WHY = {"kernel_gone": "its kernel ended (given back by the pool's reaper)"}


class AllocationHandler(APIHandler):
    async def get(self, allocation_id: str):
        _caller, a = await self.find_allocation(allocation_id)
        self.finish(self.allocation_json(a))

    async def delete(self, allocation_id: str):
        caller, a = await self.find_allocation(allocation_id)
        if not a.active:
            return self.fail(409, f"Allocation {a.id} was already released ({a.end_reason}).", "released")
        if a.purpose == "server":
            # its server keeps running on those GPUs: releasing would let them be booked twice
            return self.fail(
                409,
                f"Allocation {a.id} belongs to the notebook server of {a.user}; stop the server "
                "(on the hub's home or admin page) to release its GPUs.",
                "server_allocation",
            )
        who = "admin " + caller.name if caller.name != a.user else "owner"
        why = self.get_argument("why", None)  # the owner's side says why, from a fixed set
        if why is not None and why not in RELEASE_WHY:
            return self.fail(
                400, f"'why' must be one of {', '.join(sorted(RELEASE_WHY))}, or absent.", "bad_request"
            )
        reason = RELEASE_WHY[why] if why else f"released through the API by {who}"
        await self.broker.run(self.broker.ledger.release, a.id, reason)
        self.finish(self.allocation_json(await self.broker.run(self.broker.ledger.get, a.id)))


class RenewHandler(APIHandler):
    async def post(self, allocation_id: str):
        _caller, a = await self.find_allocation(allocation_id)
        cfg = self.broker.settings
        try:
            body = schemas.parse_json_object(self.request.body, cfg.max_body_bytes)
            seconds = schemas.parse_renew(body, max_lease_seconds=cfg.max_lease_seconds)
            idle_seconds = schemas.parse_activity(body)
        except schemas.BadRequest as e:
            return self.fail(400, str(e), "bad_request")
        active_at = None if idle_seconds is None else utcnow() - timedelta(seconds=idle_seconds)
        try:
            renewed = await self.broker.run(
                self.broker.ledger.renew, a.id, seconds or cfg.lease_seconds, active_at
            )
        except LookupError as e:
            if "was preempted" in str(e):
                why = str(e).split(" was ", 1)[1]
                return self.fail(
                    409, f"Allocation {a.id} was {why}. Stop its engines and release it.", "preempted"
                )
            if "was reclaimed" in str(e):
                why = str(e).split(" was ", 1)[1]
                return self.fail(
                    409, f"Allocation {a.id} was {why}. Stop its engines and release it.", "reclaimed"
                )
            return self.fail(409, f"Allocation {a.id} was already released; request a new one.", "released")
        except ValueError:
            return self.fail(409, f"Allocation {a.id} is a server's; it has no lease to renew.", "no_lease")
        if idle_seconds is not None:  # the kernel's word on when its engines last ran a cell
            self.broker.utilization.add_activity(renewed, idle_seconds)
        self.finish(self.allocation_json(renewed))


class JobHandler(APIHandler):
    """``POST allocations/{id}/job {"job_id": "123"}``: the Slurm job that runs a burst's
    engines. Checked with Slurm: the job must exist and belong to the allocation's user.
    The hub's watcher then writes the job's GPUs and ends the allocation with the job."""

    async def post(self, allocation_id: str):
        _caller, a = await self.find_allocation(allocation_id)
        cfg = self.broker.settings
        if self.broker.backend != "slurm" or a.purpose != "distributed":
            return self.fail(409, f"Allocation {a.id} is not a Slurm burst; it takes no job id.", "not_slurm")
        try:
            body = schemas.parse_json_object(self.request.body, cfg.max_body_bytes)
            job_id = schemas.parse_job(body)
        except schemas.BadRequest as e:
            return self.fail(400, str(e), "bad_request")
        if not a.active:
            return self.fail(409, f"Allocation {a.id} was already released; request a new one.", "released")
        from spawner.slurm import SlurmError
        from spawner.slurm.commands import squeue_json_argv
        from spawner.slurm.squeue import parse_squeue_json
        from spawner.slurm.watcher import run_command

        try:  # from Slurm's JSON, never from text a job's comment could imitate
            out = await run_command(squeue_json_argv(), 20)
            job = parse_squeue_json(out, {"gpuhub-engines"}).jobs.get(job_id)
        except SlurmError:
            job = None
        if (
            job is None
            or job.ended
            or job.user != a.user
            or job.name != "gpuhub-engines"
            or job.allocation_id != a.id
        ):
            return self.fail(
                400,
                f"Slurm has no live job {job_id} of {a.user} named gpuhub-engines and tagged "
                f"--comment=gpuhub:{a.id}.",
                "bad_job",
            )
        try:
            attached = await self.broker.run(self.broker.ledger.attach_job, a.id, job_id)
        except LookupError:
            return self.fail(409, f"Allocation {a.id} was already released; request a new one.", "released")
        except ValueError as e:
            return self.fail(409, f"{e}.", "has_job")
        self.finish(self.allocation_json(attached))


class UsageHandler(APIHandler):
    async def get(self):
        who = self.whose("usage")
        now = utcnow()
        try:
            since = self.time_argument("since", f"{self.broker.settings.usage_days}d", now)
            until = self.time_argument("until", None, now) or now
            bucket = values.parse_hours(
                self.get_argument("bucket_hours", "24"), "'bucket_hours'", lo=0.01, hi=24 * 366
            )
        except values.BadValue as e:
            return self.fail(400, str(e), "bad_request")
        fmt = self.get_argument("format", "json")
        if fmt not in ("json", "csv"):
            return self.fail(400, "'format' is json (the default) or csv.", "bad_request")
        if until <= since or (until - since) / timedelta(hours=bucket) > 1000:
            return self.fail(400, "Ask for a period after 'since', in at most 1000 buckets.", "bad_request")
        ledger = self.broker.ledger
        totals = await self.broker.run(ledger.usage, since, until, who)
        starts, series = await self.broker.run(ledger.usage_series, since, until, bucket, who)
        borrowing = await self.broker.run(ledger.borrowing_totals, since, until, who)
        usage = views.usage_json(since, until, totals, starts, series, borrowing)
        usage["energy"] = await self.energy(since, until, who, starts)
        if fmt == "csv":
            self.set_header("Content-Type", "text/csv; charset=utf-8")
            self.set_header("Content-Disposition", 'attachment; filename="gpuhub-usage.csv"')
            return self.finish(views.usage_csv(usage))
        self.finish(usage)

    async def energy(self, since, until, who, starts) -> dict:
        ledger = self.broker.ledger
        energy = await self.broker.run(ledger.energy_totals, since, until, who)
        days = await self.broker.run(ledger.energy_days, since, until, who)
        groups = None
        if who is None:  # an admin's view of everyone: per group too
            groups = {u: await self.broker.groups_of(u) for u in energy}
        return energy_views.usage_energy_json(self.broker.costing, energy, days, since, starts, groups)


class AdminHandler(APIHandler):
    def require_admin(self):
        caller = self.require_caller()
        if not access.is_admin(caller):
            raise web.HTTPError(403, "This needs the custom:gpuhub:admin scope.")
        return caller


class LimitsHandler(AdminHandler):
    async def get(self):
        self.require_admin()
        entries = await self.broker.run(self.broker.ledger.limit_entries)
        self.finish({"limits": [views.limit_entry_json(e) for e in entries]})


class LimitHandler(AdminHandler):
    def _key(self, scope: str, name: str | None) -> tuple[str, str]:
        if scope == "default" and not name:
            return scope, ""
        if scope in ("group", "user") and name:
            name = url_unescape(name)
            if self.request.method == "PUT":  # a new key: the CLI's rule; DELETE finds any stored one
                try:
                    values.parse_name(name, f"the {scope} name", spaces=scope == "group")
                except values.BadValue as e:
                    raise web.HTTPError(400, str(e)) from None
            return scope, name
        raise web.HTTPError(404, "Limits live at limits/default, limits/group/NAME and limits/user/NAME.")

    async def put(self, scope: str, name: str | None = None):
        self.require_admin()
        scope, name = self._key(scope, name)
        try:
            body = schemas.parse_json_object(self.request.body, self.broker.settings.max_body_bytes)
            lim = schemas.parse_limit_body(body, policy.DEFAULT_WINDOW_HOURS)
        except schemas.BadRequest as e:
            return self.fail(400, str(e), "bad_request")
        limit = policy.Limit(lim.max_gpus, lim.gpu_hours, lim.window_hours)
        await self.broker.run(self.broker.ledger.set_limit, scope, name, limit)
        if await self._sync_slurm(scope, name):
            self.finish({"scope": scope, "name": name, "origin": "ledger", **views.limit_json(limit)})

    async def delete(self, scope: str, name: str | None = None):
        self.require_admin()
        scope, name = self._key(scope, name)
        if not await self.broker.run(self.broker.ledger.unset_limit, scope, name):
            raise web.HTTPError(404, f"No ledger {scope} limit {name!r} to remove.")
        if await self._sync_slurm(scope, name):
            self.set_status(204)
            self.finish()

    async def _sync_slurm(self, scope: str, name: str) -> bool:
        """Write the change to Slurm's associations (when enabled): the user's, or every known
        user's after a default or group change. False (and a 502 sent) when Slurm refused."""
        accounting = self.broker.accounting
        if accounting is None or not accounting.enabled:
            return True
        ledger = self.broker.ledger

        def sync():
            users = sorted({name, *ledger.effective_limits()}) if scope == "user" else None
            return accounting.sync(ledger, users)

        from spawner.slurm import SlurmError

        try:
            await self.broker.run(sync)
        except SlurmError as e:
            self.fail(
                502, f"The ledger's limit is changed, but Slurm's accounting is not: {e}", "slurm_accounting"
            )
            return False
        return True


class ClusterHandler(AdminHandler):
    async def get(self):
        self.require_admin()
        table = await self.broker.run(self.broker.ledger.gpu_table)
        self.finish(views.cluster_json(table))
