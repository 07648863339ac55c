"""The broker's idle check: every ``c.GpuReclaim.check_seconds`` it judges each live GPU
allocation (``spawner.policy.idle.judge``), warns owners, and reclaims.

Reclaiming records the reclaim in the ledger; the GPUs stay held until what uses them has
stopped. A burst's lease renewals are refused from then on, so its kernel stops the engines
and releases it (or, gone, lets the lease run out; on Slurm the hub's watcher then cancels
the engines' job). A server is stopped through the hub's REST API, and its spawner releases
the GPUs as it stops. A reclaim whose allocation turns out to be in use before it ends (the
news of its use came late) is undone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime

from tornado.escape import url_escape
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from tornado.web import HTTPError

from spawner.broker.utilization import epoch
from spawner.policy.idle import IdleRules, Verdict, is_exempt, judge

log = logging.getLogger("gpuhub.broker")


def server_url(api_url: str, user: str, server_name: str) -> str:
    base = f"{api_url.rstrip('/')}/users/{url_escape(user, plus=False)}"
    return f"{base}/servers/{url_escape(server_name, plus=False)}" if server_name else f"{base}/server"


async def stop_server(broker, user: str, server_name: str) -> bool:
    """Ask the hub to stop a user's server (its spawner then releases the GPUs). False, and
    logged, when the hub could not be asked or refused: the caller tries again later."""
    req = HTTPRequest(
        server_url(broker.api_url, user, server_name),
        method="DELETE",
        headers={"Authorization": f"token {broker.api_token}"},
        request_timeout=60,
    )
    try:
        resp = await AsyncHTTPClient().fetch(req, raise_error=False)
    except (OSError, HTTPClientError) as e:
        log.error("could not ask the hub to stop %s's server %r: %s", user, server_name, e)
        return False
    if resp.code not in (202, 204):
        log.error(
            "the hub refused to stop %s's server %r (%s %s); will retry",
            user,
            server_name,
            resp.code,
            resp.body[:200],
        )
        return False
    return True


class ServerStops:
    """Stops of servers asked of the hub by a pass that finds them due each time (a notice's
    due time, a time limit), each asked again only after ``retry`` seconds: the hub's stop
    takes a while, and a refused one is asked again."""

    def __init__(self, broker, retry: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.broker, self.retry, self.clock = broker, retry, clock
        self._asked: dict[int, float] = {}  # allocation id -> when its server's stop was asked

    async def stop(self, due: list[tuple[int, str, str, str]]) -> None:
        """Stop each ``(allocation id, user, server name, why)``; forget the ones no longer due."""
        live = {allocation_id for allocation_id, *_ in due}
        for gone in set(self._asked) - live:
            del self._asked[gone]
        for allocation_id, user, server_name, why in due:
            asked = self._asked.get(allocation_id)
            if asked is not None and self.clock() - asked < self.retry:
                continue
            self._asked[allocation_id] = self.clock()
            if await stop_server(self.broker, user, server_name):
                log.warning("stopped %s's server %r: %s", user, server_name, why)


class Reclaimer:
    def __init__(self, broker, rules: IdleRules, clock: Callable[[], float] = time.monotonic):
        self.broker = broker
        self.rules = rules
        self.clock = clock
        self._stopping: dict[int, float] = {}  # allocation id -> when its stop was asked
        self._deadlines: dict[int, object] = {}  # what the ledger was last told (idle deadlines)

    async def check(self) -> list[int]:
        """One pass; returns the ids reclaimed (or whose server was asked to stop)."""
        broker, util = self.broker, self.broker.utilization
        live = await broker.run(broker.ledger.active)
        ids = {a.id for a in live}
        util.forget(ids)
        for ended in set(self._stopping) - ids:
            del self._stopping[ended]
        now = util.clock()
        acted = []
        for a in live:
            try:
                if await self._judge(a, now):
                    acted.append(a.id)
            except Exception:  # one allocation's trouble must not skip the others
                log.exception("the idle check of allocation %s failed", a.id)
        await self._write_deadlines(live)
        return acted

    async def _write_deadlines(self, live) -> None:
        """Tell the ledger when warned allocations will be reclaimed unless used: the queue's
        expected starts count on those ends (only changes are written)."""
        util = self.broker.utilization
        wanted = {}
        for a in live:
            v = util.verdicts.get(a.id)
            at = v.reclaim_at if v is not None and v.state in ("warned", "reclaim") else None
            wanted[a.id] = (
                None if at is None else datetime.fromtimestamp(at, UTC).replace(tzinfo=None, microsecond=0)
            )
        changed = {i: t for i, t in wanted.items() if self._deadlines.get(i, None) != t}
        self._deadlines = wanted
        if changed:
            try:
                await self.broker.run(self.broker.ledger.set_idle_deadlines, changed)
            except Exception:
                log.exception("could not write the idle deadlines to the ledger")
                self._deadlines = {}  # try them all again next pass

    async def _judge(self, a, now: float) -> bool:
        broker, util = self.broker, self.broker.utilization
        if max(a.gpu_count, len(a.gpus)) == 0:
            return False
        groups: list[str] = []
        if self.rules.exempt_groups:
            try:
                groups = await broker.groups_of(a.user)
            except HTTPError:
                return False  # never guess: the user may be exempt
        if is_exempt(self.rules, a.user, groups):
            util.verdicts[a.id] = Verdict("exempt")
            return False
        started = epoch(a.started or a.created)
        unseen = [
            g for g in a.gpus if util.latest(g.node, g.index, self.rules.stale_after, since=started) is None
        ]
        if unseen or not a.gpus:  # a GPU whose use cannot be seen is not taken
            util.verdicts[a.id] = Verdict("unknown")
            return False
        verdict = judge(util.watch(a), self.rules, groups, now)
        if verdict.state == "warned" and util.verdicts.get(a.id, Verdict("off")).state != "warned":
            util.warn(a.id)
            verdict = judge(util.watch(a), self.rules, groups, now)
            log.warning(
                "allocation %s of %s (%s): %s; %s",
                a.id,
                a.user,
                a.purpose,
                verdict.reason,
                "only warned (c.GpuReclaim.servers = 'warn')"
                if verdict.reclaim_at is None
                else f"it will be reclaimed in {verdict.reclaim_at - now:.0f} s unless used",
            )
        util.verdicts[a.id] = verdict
        if verdict.state != "reclaim" and a.id in self._stopping:
            # used again before it ended (a stop the hub refused, a burst not yet released)
            if await broker.run(broker.ledger.undo_reclaim, a.id):
                log.warning("allocation %s of %s is in use again: its reclaim is undone", a.id, a.user)
            self._stopping.pop(a.id, None)
        return verdict.state == "reclaim" and await self.reclaim(a, verdict)

    async def reclaim(self, a, verdict: Verdict) -> bool:
        broker = self.broker
        record = await broker.run(broker.ledger.record_reclaim, a.id, verdict.idle_seconds, verdict.reason)
        if record is None:
            return False  # ended meanwhile
        if a.purpose != "server":
            # its renewals are refused from now on: the kernel stops the engines and releases it
            if a.id not in self._stopping:
                self._stopping[a.id] = self.clock()
                broker.metrics.reclaims.labels(purpose=a.purpose).inc()
                log.warning("reclaimed burst allocation %s of %s: %s", a.id, a.user, verdict.reason)
            return True
        asked = self._stopping.get(a.id)
        if asked is not None and self.clock() - asked < 60:
            return False  # its stop is under way
        if asked is None:
            broker.metrics.reclaims.labels(purpose=a.purpose).inc()
        self._stopping[a.id] = self.clock()
        if not await stop_server(broker, a.user, a.server_name):
            return False
        log.warning(
            "reclaimed %s's server %r (allocation %s): %s", a.user, a.server_name, a.id, verdict.reason
        )
        return True
