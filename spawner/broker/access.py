"""Who may do what in the broker: pure functions over the scopes JupyterHub gives a caller.

Scopes (defined by ``enable_broker`` as JupyterHub custom scopes):

- ``custom:gpuhub:allocations``: read and manage one's own allocations. Granted to every user
  as ``custom:gpuhub:allocations!user`` (JupyterHub expands it to ``...!user=<name>``), and to
  each single-user server's token, so the magics can ask for burst GPUs.
- ``custom:gpuhub:admin``: limits, every allocation, the cluster view, everyone's usage.
- ``custom:gpuhub:sample``: report a node's GPU readings (gpuhub's own sampler on each node,
  the ``gpuhub-sampler`` service); no user has it.

A caller without a scope gets 403; a caller asking for someone else's allocation gets 404,
so allocation ids of other users are not even confirmed to exist.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

OWN_SCOPE = "custom:gpuhub:allocations"
ADMIN_SCOPE = "custom:gpuhub:admin"
SAMPLE_SCOPE = "custom:gpuhub:sample"
METRICS_SCOPES = (ADMIN_SCOPE, "read:metrics")


@dataclass(frozen=True)
class Caller:
    name: str
    kind: str  # "user" or "service"
    scopes: frozenset[str]

    @classmethod
    def from_model(cls, model: dict) -> Caller:
        return cls(model["name"], model.get("kind", "user"), frozenset(model.get("scopes") or ()))


def has_scope(scopes: Iterable[str], scope: str, user: str | None = None) -> bool:
    """``scope`` unfiltered, or filtered to ``user`` (``scope!user=name`` / ``scope!user``)."""
    scopes = set(scopes)
    if scope in scopes:
        return True
    return user is not None and f"{scope}!user={user}" in scopes


def is_admin(caller: Caller) -> bool:
    return ADMIN_SCOPE in caller.scopes


def may_manage_own(caller: Caller) -> bool:
    return caller.kind == "user" and (is_admin(caller) or has_scope(caller.scopes, OWN_SCOPE, caller.name))


def may_see(caller: Caller, owner: str) -> bool:
    """Whether ``caller`` may see and act on an allocation of ``owner``."""
    return is_admin(caller) or (owner == caller.name and may_manage_own(caller))


def may_read_metrics(caller: Caller) -> bool:
    return any(s in caller.scopes for s in METRICS_SCOPES)
