"""A Dask cluster that only its owner can reach.

- Every connection (client, scheduler, nanny, worker) is mutual TLS with a certificate made in
  memory for this one cluster (distributed's ``Security.temporary()``): a process of another
  account can open the scheduler's TCP port but cannot complete the handshake, so it can neither
  submit work nor read results.
- The scheduler's HTTP server (dashboard, metrics, JSON API) listens on no TCP port at all: it
  serves a Unix socket in a directory made for it with mode 0700. The owner's browser reaches it
  through the owner's own Jupyter server (``gpu_magics.dask.dashproxy``, behind JupyterHub's login) at
  ``{JUPYTERHUB_SERVICE_PREFIX}gpuhub/dask/<token>/status``; ``client.dashboard_link`` says so.
- The workers' own HTTP servers (metrics only) serve no routes.
- Scratch space (the scheduler's and every worker's ``local_directory``, which distributed puts
  at ``sys.path[0]``, and Dask's ``temporary-directory``) is a directory made for this cluster,
  0700, inside the cluster's own private directory: never distributed's default, a name under
  the temporary place that another account could make first and fill with modules.

The socket's place is found by the Jupyter server through a pointer file in the owner's Jupyter
runtime directory (``gpuhub-dask/<token>.sock-path``), which Jupyter keeps private to the owner.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from gpu_magics.common.scratch import make_private

TOKEN = re.compile(r"[0-9a-f]{32}")


def pointer_dir() -> Path:
    """``<jupyter runtime dir>/gpuhub-dask``, created 0700 and checked to be the caller's."""
    from jupyter_core.paths import jupyter_runtime_dir

    path = Path(jupyter_runtime_dir()) / "gpuhub-dask"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return private_dir(path)


def private_dir(path: Path) -> Path:
    """``path`` if it is a directory of this user that nobody else can open, else ``PermissionError``."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise PermissionError(f"{path} is not a directory of this user; remove it and try again")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def dashboard_link(token: str, environ=os.environ) -> str:
    """Where the owner's browser finds the dashboard: their own server, under the hub's login."""
    prefix = environ.get("JUPYTERHUB_SERVICE_PREFIX") or "/"
    return f"{prefix.rstrip('/')}/gpuhub/dask/{token}/status"


def socket_for(token: str, pointers: Path | None = None) -> str | None:
    """The socket a dashboard token names, or None (an unknown or malformed token)."""
    if not TOKEN.fullmatch(token):
        return None
    try:
        return ((pointers or pointer_dir()) / f"{token}.sock-path").read_text().strip() or None
    except OSError:
        return None


@dataclass
class Private:
    """What one private cluster needs: its certificates, socket and dashboard token."""

    security: object
    token: str
    directory: Path
    socket: str
    pointer: Path
    scratch: Path

    @classmethod
    def make(cls) -> Private:
        from distributed.security import Security

        token = secrets.token_hex(16)
        # 0700, short (a socket path may hold about 100 bytes, which a home directory's runtime
        # path can exceed), under the process's private TMPDIR (gpu_magics.common.scratch)
        directory = make_private(prefix="gpuhub-dask-")
        scratch = make_private(directory, prefix="scratch-")
        pointer = pointer_dir() / f"{token}.sock-path"
        sock = str(directory / "http.sock")
        fd = os.open(pointer, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(sock)
        return cls(Security.temporary(), token, directory, sock, pointer, scratch)

    def remove(self) -> None:
        self.pointer.unlink(missing_ok=True)
        shutil.rmtree(self.directory, ignore_errors=True)

    def options(self) -> dict:
        """Keyword arguments for ``LocalCluster``/``LocalCUDACluster``."""
        return {
            "security": self.security,
            "protocol": "tls://",
            "host": "127.0.0.1",
            "dashboard_address": "private",  # not None: the dashboard routes are served
            "local_directory": str(self.scratch),
        }

    def config(self) -> dict:
        """Dask configuration to make the cluster in (workers get it from their nanny): the
        workers' HTTP routes off, and the cluster's scratch as Dask's temporary directory."""
        return {**WORKER_CONFIG, "temporary-directory": str(self.scratch)}

    def cluster_class(self, base: type) -> type:
        """``base`` whose scheduler serves HTTP on the private socket only."""
        scheduler_class = _scheduler_class(self.socket, self.token)
        link = dashboard_link(self.token)

        class PrivateCluster(base):
            async def _start(self):
                self.scheduler_spec = dict(self.scheduler_spec, cls=scheduler_class)
                await super()._start()

            @property
            def dashboard_link(self):
                return link

        PrivateCluster.__name__ = PrivateCluster.__qualname__ = f"Private{base.__name__}"
        return PrivateCluster


def _scheduler_class(sock: str, token: str) -> type:
    from distributed import Scheduler
    from distributed.http.routing import RoutingApplication
    from tornado.httpserver import HTTPServer
    from tornado.netutil import bind_unix_socket

    class PrivateScheduler(Scheduler):
        def start_http_server(self, routes, dashboard_address, default_port=0, ssl_options=None):
            self.http_application = RoutingApplication(routes)
            self.http_server = HTTPServer(self.http_application)
            self.http_server.add_socket(bind_unix_socket(sock, mode=0o600))
            # the "port" others read (scheduler_info()["services"]) is the dashboard's token
            self.http_server.address, self.http_server.port = sock, token
            self.services["dashboard"] = self.http_server

    return PrivateScheduler


WORKER_CONFIG = {"distributed.worker.http.routes": []}  # workers' HTTP servers serve nothing
