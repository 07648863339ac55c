"""The gpuhub broker: a JupyterHub-managed service with a REST API, pages and metrics.

In ``jupyterhub_config.py``, after the ``c.GpuHub`` / ``c.GpuBroker`` / ``c.GpuReclaim`` settings and
``admin_users``::

    from spawner.broker import enable_broker
    enable_broker(c)

It adds the service, its custom scopes and roles, and gives each single-user server's token
exactly the scopes the magics need.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from spawner.broker.access import ADMIN_SCOPE, OWN_SCOPE, SAMPLE_SCOPE
from spawner.spawners.notices import ReclaimNotice

SERVICE = "gpuhub"  # the service's name: its URL (/services/gpuhub/) and scopes depend on it
DISPLAY_NAME = "My GPUs"  # what the hub's Services menu shows (templates/hub/page.html)
HUB_TEMPLATES = str(Path(__file__).with_name("templates") / "hub")
SAMPLER_SERVICE = "gpuhub-sampler"  # the nodes' samplers (gpuhub sampler), with sampler_token_file


SECTIONS = ("GpuHub", "GpuBroker", "GpuReclaim", "SlurmAccounting")


def _as_json(value):
    if isinstance(value, set | frozenset):  # e.g. c.GpuReclaim.exempt_users = {"alice"}
        return sorted(value)
    raise TypeError(
        f"{value!r} in a c.GpuHub/c.GpuBroker/c.GpuReclaim/c.SlurmAccounting setting cannot be "
        "passed to the broker service: use numbers, strings, lists, sets and dicts"
    )


def _settings_json(c) -> str:
    sections = {name: dict(c[name]) for name in SECTIONS if name in c}
    return json.dumps(sections, default=_as_json)


def _replace(items: list, new: dict) -> list:
    return [r for r in items if r.get("name") != new["name"]] + [new]


def read_sampler_token(path: str) -> str:
    """The node samplers' token from ``path``, which only its owner may read (it lets its holder
    decide what counts as idle)."""
    st = os.stat(path)
    if st.st_mode & 0o077:
        raise ValueError(
            f"enable_broker: sampler_token_file {path} has mode {st.st_mode & 0o777:04o}; "
            f"others may read it: chmod 600 {path}"
        )
    token = open(path).read().strip()
    if len(token) < 32:
        raise ValueError(
            f"enable_broker: sampler_token_file {path} holds {len(token)} characters; put a random "
            f"token of at least 32 there, e.g. openssl rand -hex 32 > {path}"
        )
    return token


class AdminsLandOnGpuAdmin:
    """``c.JupyterHub.default_url`` for a hub with gpuhub: where a user lands after logging in
    (or at ``/hub/``). A gpuhub admin (``admin_users``, or a JupyterHub admin) lands on GPU
    admin; everyone else as JupyterHub lands them (their server, or its spawn form)."""

    def __init__(self, admins):
        self.admins = frozenset(admins)

    def __call__(self, handler) -> str:
        user = handler.current_user
        if user is None or not (user.name in self.admins or getattr(user, "admin", False)):
            return ""  # JupyterHub's own default
        return f"{handler.base_url.rstrip('/')}/services/{SERVICE}/admin"


def enable_broker(
    c, *, url: str = "http://127.0.0.1:10101", admin_users=None, sampler_token_file: str | None = None
) -> None:
    """Configure the broker service on a JupyterHub config object ``c``.

    ``sampler_token_file``: a file (0600) with the token that ``gpuhub sampler`` on each Slurm
    node reports its GPUs with (the ``gpuhub-sampler`` service and role, docs/reclaim.md)."""
    access = f"access:services!service={SERVICE}"
    service = {
        "name": SERVICE,
        "url": url,
        "command": [sys.executable, "-m", "spawner.broker"],
        "cwd": os.getcwd(),  # a relative SQLite URL means the same file as for the hub
        "environment": {"GPUHUB_SETTINGS": _settings_json(c)},
        "oauth_client_allowed_scopes": [OWN_SCOPE, ADMIN_SCOPE],
        "oauth_no_confirm": True,
        "display": True,
        # JupyterHub's Services menu shows the name; templates/hub/page.html shows this instead
        "info": {"display_name": DISPLAY_NAME, "admin_page": "admin"},
    }
    services = _replace(list(c.JupyterHub.get("services", [])), service)
    if sampler_token_file is not None:
        sampler = {"name": SAMPLER_SERVICE, "api_token": read_sampler_token(sampler_token_file)}
        services = _replace(services, sampler)
    c.JupyterHub.services = services
    c.JupyterHub.custom_scopes = {
        **c.JupyterHub.get("custom_scopes", {}),
        OWN_SCOPE: {"description": "Read and manage your own GPU allocations in gpuhub."},
        ADMIN_SCOPE: {"description": "Administer gpuhub: limits, every allocation, the cluster view."},
        SAMPLE_SCOPE: {"description": "Report a node's GPU readings to gpuhub (its trusted sampler)."},
    }
    admins = sorted(admin_users if admin_users is not None else c.Authenticator.get("admin_users", ()))
    roles = list(c.JupyterHub.get("load_roles", []))
    for role in (
        {
            "name": "user",
            "description": "Standard user privileges, with their own GPUs in gpuhub",
            "scopes": ["self", f"{OWN_SCOPE}!user", access],
        },
        {
            "name": "gpuhub-admin",
            "description": "Administers gpuhub",
            "scopes": [ADMIN_SCOPE, access],
            "users": admins,
        },
        {
            "name": "gpuhub-service",
            "description": "What the gpuhub broker needs from the hub",
            # delete:servers (JupyterHub's narrowest scope that stops a server, without
            # starting any): to stop a server whose GPUs sat idle (c.GpuReclaim)
            "scopes": ["read:users:groups", "read:users:name", "delete:servers"],
            "services": [SERVICE],
        },
        {
            "name": "gpuhub-sampler",
            "description": "gpuhub's GPU sampler on each node: its readings decide idle reclaims",
            "scopes": [SAMPLE_SCOPE, access],
            "services": [SAMPLER_SERVICE] if sampler_token_file is not None else [],
        },
    ):
        roles = _replace(roles, role)
    c.JupyterHub.load_roles = roles
    # the notebook's magics reach the broker directly (no need to know the public URL)
    c.Spawner.environment = {
        **c.Spawner.get("environment", {}),
        "GPUHUB_BROKER_URL": f"{url.rstrip('/')}/services/{SERVICE}/api/v1/",
        # My GPUs under the hub's base URL: JupyterLab's GPU panel links to it
        "GPUHUB_PAGES_PATH": f"services/{SERVICE}/",
    }
    # gpuhub's admins arrive at GPU admin, not at a spawn form (their own server is on Home);
    # an admin's own c.JupyterHub.default_url wins
    if "default_url" not in c.JupyterHub:
        c.JupyterHub.default_url = AdminsLandOnGpuAdmin(admins)
    # the Services menu reads "My GPUs" (and "GPU admin" for gpuhub's admins)
    paths = list(c.JupyterHub.get("template_paths", []))
    if HUB_TEMPLATES not in paths:
        c.JupyterHub.template_paths = [*paths, HUB_TEMPLATES]
    # the home page tells a user why their server was reclaimed, and an admin where GPU admin is
    template_vars = dict(c.JupyterHub.get("template_vars", {}))
    previous = template_vars.get("announcement_home")
    base_url = c.JupyterHub.get("base_url", "/") or "/"
    admin_url = f"{base_url.rstrip('/')}/services/{SERVICE}/admin"
    if isinstance(previous, ReclaimNotice):
        previous.admins, previous.admin_url = set(admins), admin_url
    else:
        template_vars["announcement_home"] = ReclaimNotice(c, previous, admins=admins, admin_url=admin_url)
    c.JupyterHub.template_vars = template_vars
    c.Spawner.server_token_scopes = [
        "users:activity!user",
        "access:servers!server",
        f"{OWN_SCOPE}!user",
        access,
    ]
