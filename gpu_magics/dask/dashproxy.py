"""The owner's way to a private Dask dashboard (``gpu_magics.dask.private``): a Jupyter server
handler at ``{base_url}gpuhub/dask/<token>/...`` that proxies HTTP and websockets to the
dashboard's Unix socket, found through the owner's Jupyter runtime directory. The server runs
as the owner and is behind JupyterHub's login, so nobody else gets through it; jupyter-server-proxy
does the proxying."""

from __future__ import annotations

from tornado import web

from gpu_magics.dask.private import socket_for


def _handler_class():
    from jupyter_server_proxy.handlers import LocalProxyHandler

    class DaskDashboardHandler(LocalProxyHandler):
        """``token`` takes the place of jupyter-server-proxy's port; the socket is the owner's."""

        async def prepare(self, *args, **kwargs):
            await super().prepare(*args, **kwargs)  # the server's login first, whatever the token
            token = (self.path_args or [""])[0]
            sock = socket_for(token)
            if sock is None:
                raise web.HTTPError(404, "no Dask dashboard of this server has that address")
            self.unix_socket = sock
            self.proxy_base = f"gpuhub/dask/{token}"

        def proxy(self, token, proxied_path):
            return super().proxy(80, proxied_path)  # a port for the URL; the socket is what counts

        async def open(self, token, proxied_path):
            return await self.proxy_open("localhost", 80, proxied_path)

    return DaskDashboardHandler


def _jupyter_server_extension_points():
    return [{"module": "gpu_magics.dask.dashproxy"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from jupyter_server.utils import url_path_join

    try:
        handler = _handler_class()
    except ImportError as e:
        serverapp.log.warning("gpuhub: no Dask dashboards through this server (%s)", e)
        return
    route = url_path_join(serverapp.web_app.settings["base_url"], r"gpuhub/dask/([0-9a-f]{32})(.*)")
    serverapp.web_app.add_handlers(".*", [(route, handler, {})])
