"""What the hub's home page tells a user whose server was reclaimed.

``enable_broker(c)`` sets ``c.JupyterHub.template_vars["announcement_home"]`` to a
:class:`ReclaimNotice`: JupyterHub calls it with the user at each page render, and the
home page shows what it returns above the server buttons.
"""

from __future__ import annotations

import time
from html import escape

from .reclaims import ReclaimInfo


def render_notices(notices: list[ReclaimInfo]) -> str:
    """The home page's text for a user's reclaimed servers (HTML, every value escaped)."""
    parts = []
    for r in notices:
        which = f"Your server <b>{escape(r.server_name)}</b>" if r.server_name else "Your server"
        parts.append(
            f'<p class="gpuhub-reclaim">{which} was stopped by gpuhub at '
            f"{r.created:%Y-%m-%d %H:%M} UTC to give its GPUs back: {escape(r.reason)}. "
            "Your notebooks and files are saved; start the server again when you need GPUs.</p>"
        )
    return "".join(parts)


class ReclaimNotice:
    """A template variable: the user's reclaim notices, then any announcement the admin set."""

    def __init__(self, config, fallback=None, cache_seconds: float = 10.0):
        self.config = config
        self.fallback = fallback
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, str]] = {}  # JupyterHub calls this for every page

    def __call__(self, user) -> str | None:
        base = self.fallback(user) if callable(self.fallback) else self.fallback
        if user is None:
            return base
        from .settings import GpuHub

        cached = self._cache.get(user.name)
        if cached and time.monotonic() - cached[0] < self.cache_seconds:
            text = cached[1]
        else:
            try:
                notices = GpuHub(config=self.config).open_ledger(sync=False).reclaim_notices(user.name)
            except Exception:  # the home page must render even when the ledger cannot be read
                return base
            text = render_notices(notices)
            self._cache[user.name] = (time.monotonic(), text)
        if not text:
            return base
        return text + (base if isinstance(base, str) else "")
