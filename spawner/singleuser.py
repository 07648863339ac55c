"""``gpuhub-singleuser``: JupyterHub's single-user server, started without a parser it never needs.

Every Jupyter server imports ``jupyter_events``, which imports ``jsonschema``, whose format
checks import ``rfc3987_syntax`` for the ``iri`` and ``iri-reference`` formats; that package
compiles about thirty Lark grammars when it is imported: 0.6 to 2.9 s of every server start
on a 2-core machine, more than the rest of the server's start (upstream:
jupyter-server#1559, jsonschema#1428). No event schema of the server, JupyterLab or
JupyterHub uses those formats.

This launcher registers a stand-in for ``rfc3987_syntax`` before anything imports it. Its
``is_valid_syntax`` imports the real package on its first call and asks it, so an ``iri``
value is judged exactly as before; only the cost moves to the first one checked (never, in
practice). Every other format check, the event validation and the server's extensions are
untouched. Where the package is not installed, nothing is registered (jsonschema then has no
``iri`` check, as without the launcher).

The same goes for JupyterLab's npm registry: ``jupyterlab.labapp`` asks for the app's version
when imported, and the ``_AppHandler`` that reads it first runs ``node yarn.js config --json``
(0.3-0.5 s of every server start where Node.js is on the PATH) for a registry that reading the
version never uses. The launcher's ``get_app_version()`` reads the same version with the
default registry given; a build or an install still asks yarn (their own ``AppOptions``).

**In a Slurm job** it also takes ``batchspawner-singleuser``'s place
(``c.GpuSlurmSpawner.batchspawner_singleuser_cmd``): ``gpuhub-singleuser COMMAND ARGS...``
picks a free port, POSTs ``{"port": N}`` to the hub's ``/hub/api/batchspawner`` with the
server's token, exactly as batchspawner's launcher does, then runs ``COMMAND ARGS...`` in this
process, as batchspawner's does (``runpy``).
batchspawner's launcher imports the ``batchspawner`` package first, and with it the hub's API
handlers, ORM and SQLAlchemy (0.6-0.8 s in every job, before the port is even reported) that
a single-user server never uses. A port the hub refuses ends the launcher with the hub's
answer (batchspawner's would start a server the hub can never find).

**Private temporary files.** The launcher gives the server a ``TMPDIR`` of the user's own
(``gpu_magics.common.scratch.private_tmpdir``: an inherited one only if it is a 0700 directory of the
user's, else a new one with a random name), which the server's kernels, their engines and Dask
inherit, so no process of the user writes to a shared name under ``/tmp`` that another account
could have made first.

**No generic proxy.** jupyter-server-proxy is installed for the private Dask dashboard
(``gpu_magics.dask.dashproxy`` uses its handler class), and its own server extension would serve
``/proxy/<port>/`` to any loopback port, another account's included, on the hub's origin with
the user's cookies. The launcher turns that extension off (:data:`SERVER_ARGS`).

**A slice's MPS daemon.** On a slice of a real GPU (``GPUHUB_SLICE_MPS=1``) the launcher
starts the user's own CUDA MPS control daemon for that GPU before the server, in the private
temporary directory, and quits it at exit: the server and its kernels run as MPS clients held to
the slice's memory and compute (``spawner.mps_run``). It never runs a slice without it.

**A quiet log.** JupyterHub's request log writes every successful request at INFO, and an
open JupyterLab polls the server every few seconds (kernels, sessions, terminals, contents):
hundreds of lines an hour that say nothing. The launcher moves a successful ``GET``/``HEAD``
that took under a second to DEBUG (:func:`is_routine`; ``--debug`` shows them); a slow
request, a redirect, a refusal, an error and every other method stay as they were.
ipyparallel 9 names its server extension the old way (``_jupyter_server_extension_paths``),
which made the server warn at every start that the name is deprecated; the launcher gives
it the new name for the same function (:func:`name_ipyparallel_extension`).

The hub's spawners start ``gpuhub-singleuser`` by default (``c.Spawner.cmd``); it takes
``jupyterhub-singleuser``'s arguments. ``python -m spawner.singleuser`` is the same.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import os
import re
import runpy
import shutil
import sys
import threading
import types

DEFERRED = "rfc3987_syntax"
# every gpuhub server's own options, after the spawner's (a later value wins)
SERVER_ARGS = ("--ServerApp.jpserver_extensions=jupyter_server_proxy=False",)
_lock = threading.Lock()


class DeferredModule(types.ModuleType):
    """Stands for a module until first used: then imports the real one and delegates."""

    def __init__(self, name: str, path: list[str] | None = None):
        super().__init__(name, f"{name}, imported when first used (spawner.singleuser)")
        self._real: types.ModuleType | None = None
        if path is not None:  # a package: its submodules import as usual
            self.__path__ = path

    def real(self) -> types.ModuleType:
        with _lock:
            if self._real is None:
                if sys.modules.get(self.__name__) is self:
                    del sys.modules[self.__name__]
                self._real = importlib.import_module(self.__name__)
            return self._real

    def is_valid_syntax(self, term: str, value: str) -> bool:
        return self.real().is_valid_syntax(term, value)

    def __getattr__(self, name: str):  # anything else: the real module's
        if name.startswith("__") or name == "_real":
            raise AttributeError(name)
        return getattr(self.real(), name)


def defer_import(name: str = DEFERRED) -> DeferredModule | None:
    """Register a stand-in for ``name`` (installed, not imported yet); None if there is nothing
    to defer."""
    spec = None if name in sys.modules else importlib.util.find_spec(name)
    if spec is None:
        return None
    locations = spec.submodule_search_locations
    module = sys.modules[name] = DeferredModule(name, list(locations) if locations is not None else None)
    return module


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` once the module ``name`` has been executed, whoever imports it
    (and only if someone does); then steps out of the import system."""

    def __init__(self, name: str, patch):
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.patch)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):  # get_resource_reader, get_source, ...: the real loader's
        return getattr(self.loader, name)


LAB_COMMANDS = "jupyterlab.commands"


def lab_version_without_yarn(commands: types.ModuleType) -> bool:
    """Give ``commands.get_app_version()`` (no options: the call ``jupyterlab.labapp`` makes
    at import) the default registry, so that reading the version runs no ``yarn config``.
    False (nothing changed) where JupyterLab's commands are not as expected."""
    original = getattr(commands, "get_app_version", None)
    options = getattr(commands, "AppOptions", None)
    registry = getattr(commands, "YARN_DEFAULT_REGISTRY", None)
    if original is None or options is None or not isinstance(registry, str):
        return False
    if "registry" not in getattr(options, "class_trait_names", lambda: [])():
        return False

    def get_app_version(app_options=None):
        if app_options is None:  # the version comes from the app directory, not the registry
            app_options = options(registry=registry)
        return original(app_options)

    get_app_version.__wrapped__ = original
    get_app_version.__doc__ = original.__doc__
    commands.get_app_version = get_app_version
    return True


def defer_lab_registry() -> bool:
    """Have :func:`lab_version_without_yarn` applied to JupyterLab's commands when (if ever)
    they are imported; False if they are imported already or JupyterLab is not installed."""
    if LAB_COMMANDS in sys.modules or any(
        isinstance(f, _AfterImport) and f.name == LAB_COMMANDS for f in sys.meta_path
    ):
        return False
    try:
        if importlib.util.find_spec("jupyterlab") is None:
            return False
    except (ImportError, ValueError):
        return False
    sys.meta_path.insert(0, _AfterImport(LAB_COMMANDS, lab_version_without_yarn))
    return True


# batchspawner-singleuser's part ----------------------------------------------------------


class PortRefused(RuntimeError):
    pass


def report_port(port: int | None = None) -> int:
    """What ``batchspawner-singleuser`` does before it starts the server: pick a free port,
    tell the hub (``POST {"port": N}`` to ``$JUPYTERHUB_API_URL/batchspawner``, with the
    server's token and the hub's internal TLS where it has one) and put the port into
    ``$JUPYTERHUB_SERVICE_URL``. Returns the port; :class:`PortRefused` if the hub refused it."""
    import requests
    from jupyterhub.services.auth import HubAuth
    from jupyterhub.utils import random_port, url_path_join

    port = port or random_port()
    hub_auth = HubAuth()
    kwargs = {}
    if hub_auth.certfile and hub_auth.keyfile:
        kwargs["cert"] = (hub_auth.certfile, hub_auth.keyfile)
    if hub_auth.client_ca:
        kwargs["verify"] = hub_auth.client_ca
    r = requests.post(
        url_path_join(hub_auth.api_url, "batchspawner"),
        headers={"Authorization": f"token {hub_auth.api_token}"},
        json={"port": port},
        timeout=60,
        **kwargs,
    )
    if r.status_code >= 400:
        raise PortRefused(f"the hub refused the server's port {port}: {r.status_code} {r.text[:500]}")
    service_url = os.environ.get("JUPYTERHUB_SERVICE_URL", "")
    if service_url:
        from urllib.parse import urlparse, urlunparse

        url = urlparse(service_url)
        os.environ["JUPYTERHUB_SERVICE_URL"] = urlunparse(url._replace(netloc=f"{url.hostname}:{port}"))
    else:  # JupyterHub < 2.0 passes the port on the command line
        sys.argv.append(f"--port={port}")
    return port


def launched_command(argv: list[str]) -> str | None:
    """In ``gpuhub-singleuser COMMAND ARGS...`` (batchspawner-singleuser's place), the path of
    ``COMMAND``; None when ``argv`` is a server's own command line (its arguments are options)."""
    if len(argv) < 2 or argv[1].startswith("-"):
        return None
    return shutil.which(argv[1])


def server_argv(argv: list[str]) -> list[str]:
    """``argv`` with :data:`SERVER_ARGS` after the spawner's options (pure)."""
    return [*argv, *(a for a in SERVER_ARGS if a not in argv)]


# JupyterHub's request line: "200 GET /user/alice/api/kernels?1 (alice@127.0.0.1) 3.21ms"
_REQUEST = re.compile(r"(?P<status>\d{3}) (?P<method>[A-Z]+) \S.* (?P<ms>\d+(?:\.\d+)?)ms$")


def is_routine(message: str) -> bool:
    """Whether a request log line is a successful ``GET``/``HEAD`` answered in under a
    second: JupyterLab's polls, not worth INFO (pure)."""
    m = _REQUEST.match(message)
    return bool(
        m and 200 <= int(m["status"]) < 300 and m["method"] in ("GET", "HEAD") and float(m["ms"]) < 1000
    )


class RoutineToDebug(logging.Filter):
    """On ``tornado.access``: a routine request is a DEBUG record, kept only when the log
    shows DEBUG (the server's ``--debug``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not is_routine(record.getMessage()):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def quiet_routine_requests() -> None:
    access = logging.getLogger("tornado.access")
    if not any(isinstance(f, RoutineToDebug) for f in access.filters):
        access.addFilter(RoutineToDebug())


def name_ipyparallel_extension() -> bool:
    """Give ipyparallel's server extension the name Jupyter Server looks for first, so the
    server does not warn at each start that the old name is deprecated (the same function)."""
    try:
        import ipyparallel
    except ImportError:
        return False
    if hasattr(ipyparallel, "_jupyter_server_extension_points"):
        return False
    old = getattr(ipyparallel, "_jupyter_server_extension_paths", None)
    if old is None:
        return False
    ipyparallel._jupyter_server_extension_points = old
    return True


def main() -> None:
    from gpu_magics.common.scratch import private_tmpdir
    from spawner import mps_run

    private = private_tmpdir()
    try:  # a slice of a real GPU: its MPS daemon, as this user, before the server (spawner/mps_run.py)
        mps_run.start(os.environ, str(private))
    except mps_run.MpsError as e:
        sys.exit(f"gpuhub-singleuser: this server's GPU slice: {e}")
    defer_import()
    defer_lab_registry()
    command = launched_command(sys.argv)
    if command is not None:
        try:
            report_port()
        except PortRefused as e:
            sys.exit(f"gpuhub-singleuser: {e}")
        sys.argv = sys.argv[1:]
        # as batchspawner-singleuser runs it (gpuhub-singleuser itself: main() again, which
        # finds its deferrals in place and the server's options in sys.argv)
        runpy.run_path(command, run_name="__main__")
        return
    from jupyterhub.singleuser import main as singleuser_main

    quiet_routine_requests()
    name_ipyparallel_extension()
    sys.argv = server_argv(sys.argv)
    sys.exit(singleuser_main())


if __name__ == "__main__":
    main()
