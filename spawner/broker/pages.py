"""The broker's pages, in the hub's look: a user's GPUs and an admin's cluster view.

Rendered on the server from the same ledger calls as the API; the buttons, the in-place
limit editor and the usage plot call the API from the page (``static/gpuhub.js``), carrying
JupyterHub's XSRF token.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import jinja2
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from tornado import web

from gpu_magics.common import words
from spawner.broker import access
from spawner.broker import responses as views
from spawner.broker.handlers import BaseHandler

TEMPLATES = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    autoescape=True,
)


def utc(iso: str | None) -> str:
    """The API's ``2026-12-03T07:34:40Z`` as people read it: ``2026-12-03 07:34:40 UTC``."""
    return "" if not iso else words.stamp(datetime.fromisoformat(iso.removesuffix("Z")))


def gpu_noun(n: int) -> str:
    """The noun after a number shown on its own: ``GPU`` for 1, ``GPUs`` otherwise."""
    return words.count(n, "GPU").split(" ", 1)[1]


TEMPLATES.filters.update(
    utc=utc, gpus=lambda n: words.count(n, "GPU"), gpu_noun=gpu_noun, duration=words.duration
)


class PageHandler(BaseHandler):
    def render_page(self, name: str, **ns) -> None:
        hub_prefix = self.hub_auth.hub_prefix
        html = TEMPLATES.get_template(name).render(
            prefix=self.broker.prefix,
            hub_prefix=hub_prefix,
            static=f"{self.broker.prefix}static/",
            xsrf=self.xsrf_token.decode() if isinstance(self.xsrf_token, bytes) else self.xsrf_token,
            caller=self.caller,
            is_admin=access.is_admin(self.caller),
            **ns,
        )
        self.finish(html)


class UserPage(PageHandler):
    @web.authenticated
    async def get(self):
        caller = self.caller
        if not access.may_manage_own(caller):
            raise web.HTTPError(403)
        groups = await self.broker.groups_of(caller.name)
        ledger = self.broker.ledger
        allowance = await self.broker.run(ledger.allowance, caller.name, groups)
        allocations = await self.broker.run(ledger.active, user=caller.name)
        me = views.me_json(
            caller.name, groups, allowance, allocations, warnings=ledger.time_warnings, now=ledger.clock()
        )
        self.render_page(
            "user.html",
            me=me,
            usage_days=self.broker.settings.usage_days,
            extend_hours=ledger.extend_settings.max_hours,  # 0: no extensions, no button
        )


class AdminPage(PageHandler):
    @web.authenticated
    async def get(self):
        if not access.is_admin(self.caller):
            raise web.HTTPError(403, "The gpuhub admin page needs the custom:gpuhub:admin scope.")
        ledger = self.broker.ledger
        cluster = views.cluster_json(await self.broker.run(ledger.gpu_table))
        limits = [views.limit_entry_json(e) for e in await self.broker.run(ledger.limit_entries)]
        extended = [views.extension_json(e) for e in await self.broker.run(ledger.extensions, None, None, 50)]
        self.render_page(
            "admin.html",
            cluster=cluster,
            limits=limits,
            extensions=extended,
            usage_days=self.broker.settings.usage_days,
        )


class MetricsHandler(BaseHandler):
    def get_login_url(self):
        raise web.HTTPError(403)

    async def get(self):
        if self.caller is None or not access.may_read_metrics(self.caller):
            raise web.HTTPError(403, "Scrape with a token that has read:metrics or custom:gpuhub:admin.")
        body = await self.broker.run(generate_latest, self.broker.metrics.registry)
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.finish(body)
