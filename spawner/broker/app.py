"""The broker service process: a tornado app started and stopped by JupyterHub.

JupyterHub gives it ``JUPYTERHUB_SERVICE_URL`` (where to listen), ``JUPYTERHUB_SERVICE_PREFIX``,
``JUPYTERHUB_API_URL`` and ``JUPYTERHUB_API_TOKEN``; ``enable_broker`` adds
``GPUHUB_SETTINGS``, the hub's ``c.GpuHub`` and ``c.GpuBroker`` as JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
from urllib.parse import urlparse

from tornado import web
from tornado.ioloop import PeriodicCallback
from traitlets.config import Config

from spawner.broker.energy_metrics import EnergyCollector
from spawner.broker.handlers import Broker
from spawner.broker.metrics import Metrics, UtilizationCollector
from spawner.broker.preempter import Preempter
from spawner.broker.reclaimer import Reclaimer
from spawner.broker.routes import routes
from spawner.broker.sampling import OwnSampler, own_nodes
from spawner.broker.settings import GpuBroker, GpuReclaim
from spawner.broker.timekeeper import TimeKeeper
from spawner.broker.utilization import Utilization
from spawner.ledger.db import safe_url
from spawner.settings import GpuHub
from spawner.spawners import inventory

log = logging.getLogger("gpuhub.broker")


def make_app(broker: Broker) -> web.Application:
    handlers = routes(broker.prefix, broker)
    # XSRF: JupyterHub's HubOAuth checks it on every cookie-authenticated write (a write
    # without the token is not authenticated at all); token requests need none. Tornado's
    # own check would run before the token is known, so it stays off.
    return web.Application(handlers, cookie_secret=secrets.token_bytes(32), log_function=log_request)


def log_request(handler: web.RequestHandler) -> None:
    """Tornado's access log, less the GPU reports that succeed (every server sends one each
    ``c.GpuHub.report_seconds``): those go to the debug level."""
    status = handler.get_status()
    quiet = status < 400 and handler.request.path.endswith("/samples")
    level = logging.DEBUG if quiet else logging.INFO if status < 400 else logging.WARNING
    ms = 1000.0 * handler.request.request_time()
    logging.getLogger("tornado.access").log(level, "%d %s %.2fms", status, handler._request_summary(), ms)


def load_settings(environ=os.environ) -> tuple[GpuHub, GpuBroker, GpuReclaim]:
    config = Config(json.loads(environ.get("GPUHUB_SETTINGS", "{}")))
    return GpuHub(config=config), GpuBroker(config=config), GpuReclaim(config=config)


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(levelname)1.1s %(asctime)s gpuhub-broker] %(message)s")
    hub_settings, settings, reclaim = load_settings()
    rules = reclaim.rules()  # a bad policy stops the service with the reason in its log
    if rules.enabled and hub_settings.report_seconds * 2 > rules.stale_after:
        raise ValueError(
            f"c.GpuReclaim.stale_seconds ({rules.stale_after:g}) must be at least twice "
            f"c.GpuHub.report_seconds ({hub_settings.report_seconds:g}), or every report would "
            "look like the first after a gap and nothing would ever count as idle"
        )
    ledger = hub_settings.open_ledger()  # syncs the inventory too, like the hub
    resumed = ledger.resume_waiting()  # nobody could ask while the broker was down
    if resumed:
        log.info("the queue's %d waiting entries count as asked about now (the broker was down)", resumed)
    broker = Broker(
        ledger,
        settings,
        Metrics(ledger),
        api_url=os.environ["JUPYTERHUB_API_URL"],
        api_token=os.environ["JUPYTERHUB_API_TOKEN"],
        prefix=os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/services/gpuhub/"),
    )
    broker.backend = "slurm" if hub_settings.inventory == "slurm" else "local"
    broker.costing = hub_settings.costing()
    broker.energy.seed(ledger.energy_by_purpose())  # the counters go on from the ledger's totals
    broker.utilization = Utilization(
        reclaim.history_seconds,
        min_interval=reclaim.sample_seconds,
        reports_per_gpu_minute=reclaim.reports_per_gpu_minute,
    )
    broker.reclaim_rules = rules
    broker.readings = reclaim.readings.lower()
    broker.metrics.registry.register(UtilizationCollector(broker))
    broker.metrics.registry.register(EnergyCollector(broker))
    reclaimer = Reclaimer(broker, rules)
    from spawner.slurm.accounting import SlurmAccounting

    broker.accounting = SlurmAccounting(config=hub_settings.config)
    url = urlparse(os.environ.get("JUPYTERHUB_SERVICE_URL", "http://127.0.0.1:10101"))
    server = make_app(broker).listen(url.port, url.hostname)

    preempter = Preempter(broker)
    timekeeper = TimeKeeper(broker)

    async def sweep():
        expired = await asyncio.to_thread(ledger.expire_leases)
        if expired:
            log.info("released expired leases: %s", ", ".join(map(str, expired)))
        ended = await asyncio.to_thread(ledger.end_stale_waits)
        if ended:
            log.info("ended waits nobody asked about: %s", ", ".join(map(str, ended)))
        try:
            await preempter.check()
        except Exception:  # one bad pass must not end the sweeps
            log.exception("the preemption pass failed; it runs again in %s s", settings.sweep_seconds)
        try:
            await timekeeper.check()
        except Exception:
            log.exception("the time-limit pass failed; it runs again in %s s", settings.sweep_seconds)

    PeriodicCallback(sweep, settings.sweep_seconds * 1000).start()

    async def check_idle():
        try:
            await reclaimer.check()
        except Exception:  # one bad pass must not end the checks
            log.exception("the idle check failed; it runs again in %s s", reclaim.check_seconds)

    PeriodicCallback(check_idle, reclaim.check_seconds * 1000).start()

    nodes = own_nodes(broker.readings, hub_settings.inventory, inventory.local_nodes(hub_settings))
    if nodes:
        sampler = OwnSampler(broker, nodes, hub_settings.report_env())

        async def sample():
            try:
                await sampler.tick()
            except Exception:  # one bad pass must not end the sampling
                log.exception(
                    "gpuhub's own GPU sampling failed; it runs again in %s s", hub_settings.report_seconds
                )

        PeriodicCallback(sample, hub_settings.report_seconds * 1000).start()
        log.info("sampling the GPUs of %s itself (c.GpuReclaim.readings = sampler)", ", ".join(sorted(nodes)))
    log.info(
        "gpuhub broker at %s%s, ledger %s", url.geturl().rstrip("/"), broker.prefix, safe_url(ledger.url)
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("gpuhub broker stopping")
    broker.stopping = True
    server.stop()  # no new requests; those in flight finish on the ledger before it closes
    if not await broker.drained(5.0):
        log.warning(
            "gpuhub broker: %s request(s) still in flight after 5 s; stopping anyway", broker.in_flight
        )
    ledger.close()
