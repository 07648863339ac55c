"""Authentication and error plumbing shared by the broker's API and pages.

Browsers authenticate with JupyterHub OAuth (a cookie of this service, XSRF-checked on
writes); programs with a JupyterHub API token in the ``Authorization`` header. The caller's
scopes, as JupyterHub reports them, decide everything else (``access.py``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime
from typing import Any

from jupyterhub.services.auth import HubOAuthenticated, UserNotAllowed
from tornado import web
from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from spawner.broker import access
from spawner.broker.access import Caller
from spawner.broker.energy_meter import EnergyMeter
from spawner.broker.utilization import Utilization
from spawner.policy import values
from spawner.policy.energy import Costing
from spawner.policy.idle import IdleRules

log = logging.getLogger("gpuhub.broker")


class Broker:
    """What every handler shares: the ledger, settings, metrics and a group cache."""

    def __init__(self, ledger, settings, metrics, api_url: str, api_token: str, prefix: str):
        self.ledger = ledger
        self.settings = settings
        self.metrics = metrics
        self.api_url = api_url.rstrip("/")
        self.api_token = api_token
        self.prefix = prefix
        self.backend = "local"  # "slurm": bursts are Slurm jobs the user submits (deferred GPUs)
        self.accounting = None  # a SlurmAccounting: limits written to Slurm associations too
        self.utilization = Utilization()  # what servers and engines report of their GPUs
        self.energy = EnergyMeter()  # energy per allocation, from gpuhub's own readings
        self.costing = Costing()  # c.GpuHub.pue, energy_price, energy_currency, carbon_intensity
        self.reclaim_rules = IdleRules()  # c.GpuReclaim
        self.readings = "sampler"  # c.GpuReclaim.readings: whose readings decide reclaims
        self._groups: dict[str, tuple[float, list[str]]] = {}
        self.in_flight = 0  # requests being answered
        self.stopping = False  # SIGTERM came: what is in flight finishes, nothing new starts
        self.refused_readings: dict[str, int] = {}  # impossible readings left out, per field
        self._refused_from: set[str] = set()

    def count_refused(self, refused, whose: str) -> None:
        """Impossible readings left out of a report (``requests.parse_samples``): counted for the
        metrics (``gpuhub_refused_readings_total``), and the first of each reporter logged."""
        for label, field, value in refused:
            self.refused_readings[field] = self.refused_readings.get(field, 0) + 1
            if whose not in self._refused_from:
                self._refused_from.add(whose)
                log.warning(
                    "%s reported an impossible %s of GPU %s (%r): left out", whose, field, label, value
                )

    async def drained(self, timeout: float) -> bool:
        """Wait until no request is being answered (at most ``timeout`` s): whether none is."""
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight

    async def run(self, fn, *args, **kw):
        """Ledger calls are short blocking transactions: keep them off the event loop."""
        return await asyncio.to_thread(fn, *args, **kw)

    async def groups_of(self, user: str) -> list[str]:
        cached = self._groups.get(user)
        if cached and time.monotonic() - cached[0] < self.settings.group_cache_seconds:
            return cached[1]
        req = HTTPRequest(
            f"{self.api_url}/users/{url_escape(user, plus=False)}",
            headers={"Authorization": f"token {self.api_token}"},
        )
        try:
            resp = await AsyncHTTPClient().fetch(req, raise_error=False)
            groups = json.loads(resp.body)["groups"] if resp.code == 200 else None
        except (OSError, ValueError, KeyError, HTTPClientError):
            groups = None
        if groups is None:
            # never guess: a missing group could hide a stricter limit; nothing is cached
            raise web.HTTPError(503, "The hub did not tell the user's groups; try again shortly.")
        self._groups[user] = (time.monotonic(), sorted(groups))
        return self._groups[user][1]


class BaseHandler(HubOAuthenticated, web.RequestHandler):
    def initialize(self, broker: Broker):
        self.broker = broker

    def count_in(self) -> None:
        """This request is in flight until ``on_finish``: the broker's stop lets it finish."""
        self.broker.in_flight += 1
        self._in_flight = True

    async def prepare(self):
        self.count_in()
        # authenticate asynchronously (the synchronous default would block the loop)
        try:
            model = await self.hub_auth.get_user(self, sync=False)
            self._hub_auth_user_cache = self.check_hub_user(model) if model else None
        except UserNotAllowed:
            self._hub_auth_user_cache = None

    def on_finish(self):
        if getattr(self, "_in_flight", False):
            self._in_flight = False
            self.broker.in_flight -= 1

    @property
    def caller(self) -> Caller | None:
        return Caller.from_model(self.current_user) if self.current_user else None


class APIHandler(BaseHandler):
    """JSON in, JSON out; errors are JSON ``{"status", "reason", "message"}``; no redirects."""

    def get_login_url(self):
        raise web.HTTPError(403, "Authenticate with a JupyterHub token or log in to the hub.")

    def allocation_json(self, a) -> dict:
        """An allocation as the API answers it, with the notice a borrowed one would get."""
        from spawner.broker import responses

        ledger = self.broker.ledger
        return responses.allocation_json(a, ledger.borrow_settings.grace_seconds, ledger.time_warnings)

    def require_caller(self) -> Caller:
        if self.caller is None:
            raise web.HTTPError(403, "Authenticate with a JupyterHub token or log in to the hub.")
        return self.caller

    def whose(self, what: str) -> str | None:
        """The ``user`` a read is about: any (or None: everyone) for admins; otherwise only the
        caller, who needs the allocations scope."""
        caller = self.require_caller()
        who = self.get_argument("user", None) or None  # ``user=`` (empty): no one in particular
        if access.is_admin(caller):
            return who
        if who not in (None, caller.name):
            raise web.HTTPError(403, f"Only gpuhub admins may see other users' {what}.")
        if not access.may_manage_own(caller):
            raise web.HTTPError(403, f"{caller.kind} {caller.name} has no gpuhub allocations scope.")
        return caller.name

    async def find_allocation(self, allocation_id: str):
        """The caller and the allocation, or 404: another user's is not even confirmed to exist."""
        caller = self.require_caller()
        a = await self.broker.run(self.broker.ledger.get, int(allocation_id))
        if a is None or not access.may_see(caller, a.user):
            raise web.HTTPError(404, f"No allocation {allocation_id} of yours.")
        return caller, a

    def time_argument(self, name: str, default: str | None, now: datetime) -> datetime | None:
        """A query argument read as a timestamp (``values.parse_timestamp``); raises ``BadValue``."""
        raw = self.get_argument(name, None) or default  # ``until=`` (empty) means the default
        return None if raw is None else values.parse_timestamp(raw, repr(name), now)

    def fail(self, status: int, message: str, reason: str, **extra: Any) -> None:
        self.set_status(status)
        self.finish({"status": status, "reason": reason, "message": message, **extra})

    def write_error(self, status_code: int, **kwargs):
        exc = kwargs.get("exc_info", (None, None))[1]
        message = getattr(exc, "log_message", None) or self._reason
        if status_code >= 500 and self.broker.stopping:  # the broker's own stop broke it
            status_code = 503
            self.set_status(503)
            message = "The GPU service is restarting; try again in a moment."
        elif status_code >= 500:
            message = "Internal error in the gpuhub broker; the hub admin can find it in its log."
        reason = {400: "bad_request", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}
        self.finish({"status": status_code, "reason": reason.get(status_code, "error"), "message": message})
