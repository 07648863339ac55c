"""The spawn-pending page while a start waits for GPUs: gpuhub's ``spawn_pending.html``.

JupyterHub's page says "Your server is starting up" over a bar of the progress events. While
a start waits in gpuhub's queue that is not true: gpuhub's template (``templates/``, extending
JupyterHub's own) says "Waiting for GPUs: 2nd of 3 in the queue", from the ``gpuhub`` field of
the spawner's progress events (``GpuSpawnerMixin._progress``), and the bar follows the place
(:func:`spawner.policy.waitline.queue_progress`).

The spawner supplies the template itself (:func:`install_templates`, from its constructor), so
no hub configuration has to name it: the directory goes into the hub's template search path
just before JupyterHub's own templates, after any ``c.JupyterHub.template_paths`` of the admin
(whose own ``spawn_pending.html`` still wins). Naming :data:`TEMPLATES` in
``c.JupyterHub.template_paths`` does the same.
"""

from __future__ import annotations

import os

from jinja2 import ChoiceLoader, FileSystemLoader, PrefixLoader

TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")


def _base_path(loader: ChoiceLoader) -> str | None:
    """JupyterHub's own template directory: the one its ``templates/`` prefix names."""
    for sub in loader.loaders:
        if isinstance(sub, PrefixLoader):
            own = sub.mapping.get("templates")
            if isinstance(own, FileSystemLoader) and own.searchpath:
                return own.searchpath[0]
    return None


def install_templates(settings: dict | None) -> bool:
    """Put :data:`TEMPLATES` ahead of JupyterHub's own in the hub's Jinja environments
    (``settings``: the hub's tornado settings). True when it is (or already was) there;
    False where the hub's loaders are not as JupyterHub 5 and 6 build them (the page is
    then JupyterHub's own, and says the place in its progress line only)."""
    found = False
    for key in ("jinja2_env", "jinja2_env_sync"):
        loader = getattr((settings or {}).get(key), "loader", None)
        if not isinstance(loader, ChoiceLoader):
            continue
        base = _base_path(loader)
        for sub in loader.loaders:
            if isinstance(sub, FileSystemLoader) and base in sub.searchpath:
                if TEMPLATES not in sub.searchpath:
                    sub.searchpath.insert(sub.searchpath.index(base), TEMPLATES)
                found = True
    return found
