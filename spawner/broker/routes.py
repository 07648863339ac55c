"""The broker's one URL table: every page and API path, and the handler that answers it.

Paths are under the service prefix (``JUPYTERHUB_SERVICE_PREFIX``, ``/services/gpuhub/``);
the API is version 1, ``api/v1/...``, whose contract is ``openapi.yaml`` (served here too).
Which methods a path answers, and which scope each needs, are the handlers' own
(:mod:`.api`, :mod:`.extend_api`, :mod:`.queue_api`, :mod:`.utilization_api`,
:mod:`.sampling`, :mod:`.pages`).
Tornado tries the paths in this order; each matches the whole path.
"""

from __future__ import annotations

from pathlib import Path

from jupyterhub.services.auth import HubOAuthCallbackHandler
from tornado import web

from spawner.broker import api, extend_api, queue_api, utilization_api
from spawner.broker.pages import AdminPage, MetricsHandler, UserPage
from spawner.broker.sampling import NodeSamplesHandler

STATIC = Path(__file__).with_name("static")
SPEC_DIR = Path(__file__).parent  # openapi.yaml, served at api/v1/openapi.yaml
ID = r"(\d{1,18})"  # an allocation's or queue entry's id; beyond 18 digits: no such id (404)
NODE = r"([A-Za-z0-9][A-Za-z0-9._-]{0,254})"

# (path under the prefix, handler): every one is given the broker
BROKER_ROUTES: tuple[tuple[str, type[web.RequestHandler]], ...] = (
    ("", UserPage),
    ("admin", AdminPage),
    ("metrics", MetricsHandler),
    # the REST API (openapi.yaml)
    ("api/v1/queue", queue_api.QueueHandler),
    (f"api/v1/queue/{ID}", queue_api.QueueEntryHandler),
    (f"api/v1/queue/{ID}/wait", queue_api.QueueWaitHandler),
    (f"api/v1/queue/{ID}/front", queue_api.QueueFrontHandler),
    ("api/v1/me", api.MeHandler),
    ("api/v1/allocations", api.AllocationsHandler),
    (f"api/v1/allocations/{ID}", api.AllocationHandler),
    (f"api/v1/allocations/{ID}/renew", api.RenewHandler),
    (f"api/v1/allocations/{ID}/job", api.JobHandler),
    (f"api/v1/allocations/{ID}/extend", extend_api.ExtendHandler),
    ("api/v1/extensions", extend_api.ExtensionsHandler),
    ("api/v1/usage", api.UsageHandler),
    ("api/v1/limits", api.LimitsHandler),
    (r"api/v1/limits/(default|group|user)(?:/([^/]+))?", api.LimitHandler),
    ("api/v1/cluster", api.ClusterHandler),
    (f"api/v1/allocations/{ID}/samples", utilization_api.SamplesHandler),
    (f"api/v1/nodes/{NODE}/samples", NodeSamplesHandler),
    ("api/v1/utilization", utilization_api.UtilizationHandler),
    ("api/v1/reclaims", utilization_api.ReclaimsHandler),
    ("api/v1/preemptions", utilization_api.PreemptionsHandler),
)


def routes(prefix: str, broker) -> list[tuple]:
    """Tornado's handler list for a broker served under ``prefix`` (ends with ``/``)."""
    ctx = {"broker": broker}
    return [
        (f"{prefix}oauth_callback", HubOAuthCallbackHandler),
        (rf"{prefix}static/(.*)", web.StaticFileHandler, {"path": str(STATIC)}),
        (rf"{prefix}api/v1/(openapi\.yaml)", web.StaticFileHandler, {"path": str(SPEC_DIR)}),
        *[(prefix + path, handler, ctx) for path, handler in BROKER_ROUTES],
    ]
