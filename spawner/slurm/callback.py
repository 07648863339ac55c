"""The server's port callback, hardened.

``batchspawner-singleuser`` (inside the job) picks a free port and POSTs ``{"port": N}``
to ``/hub/api/batchspawner`` with the server's token. batchspawner's own handler sets
*any* spawner attribute named in the body, which would let a user rewrite their
spawner's state (its job id, its GPU allocation). gpuhub replaces that route with this
handler: the server's own token only, ``port`` only, only while its spawn is pending.
"""

from __future__ import annotations

import json

from jupyterhub import apihandlers
from tornado import web

ROUTE = r"/api/batchspawner"


class PortCallbackHandler(apihandlers.base.APIHandler):
    @web.authenticated
    def post(self):
        spawners = getattr(self.current_user, "spawners", None)
        token = self.get_auth_token()
        spawner = next((s for s in (spawners or {}).values() if s.api_token == token), None)
        if spawner is None:
            raise web.HTTPError(403, "only a server's own token may report its port")
        data = self.get_json_body()
        port = data.get("port") if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or set(data) != {"port"}
            or type(port) is not int
            or not 0 < port < 65536
        ):
            raise web.HTTPError(400, 'send {"port": N} with 0 < N < 65536 and nothing else')
        if not spawner._spawn_pending:
            raise web.HTTPError(409, "the server is not starting: its port is already known")
        spawner.port = port
        self.set_status(201)
        self.finish(json.dumps({"message": "port recorded"}))


def install() -> None:
    """Route ``/hub/api/batchspawner`` to :class:`PortCallbackHandler` (idempotent)."""
    import batchspawner.api  # noqa: F401 - registers its handler; replaced below

    routes = apihandlers.default_handlers
    routes[:] = [r for r in routes if r[0] != ROUTE]
    routes.append((ROUTE, PortCallbackHandler))
