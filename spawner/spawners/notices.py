"""What the hub's home page tells a user whose server was reclaimed or preempted.

``enable_broker(c)`` sets ``c.JupyterHub.template_vars["announcement_home"]`` to a
:class:`ReclaimNotice`: JupyterHub calls it with the user at each page render, and the
home page shows what it returns above the server buttons: servers stopped by an idle
reclaim, borrowed GPUs being taken back (the notice, with when), and servers whose borrowed
GPUs were taken back, until they are started again.
"""

from __future__ import annotations

import time
from html import escape

from spawner.policy.records import PreemptionNotice, ReclaimInfo


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


def _gpus(p) -> str:
    """What a notice takes back: the borrowed GPUs, or all of one that started ahead of the
    queue (backfill: ``borrowed`` 0)."""
    if p.borrowed:
        return f"{p.borrowed} borrowed GPU{'' if p.borrowed == 1 else 's'}"
    return f"{p.gpus} GPU{'' if p.gpus == 1 else 's'} (started ahead of the queue)"


def _count(p) -> int:
    return p.borrowed or p.gpus


def render_preemptions(notices: list[PreemptionNotice], now=None) -> str:
    """The home page's text for a user's preemptions (HTML, every value escaped): a pending
    one says when its borrowed GPUs will be taken back, a done one (a server) when they were,
    a withdrawn one that they will not be."""
    parts = []
    for n in notices:
        p = n.preemption
        if p.purpose == "server":
            which = f"Your server <b>{escape(p.server_name)}</b>'s" if p.server_name else "Your server's"
        else:
            which = f"Your burst #{p.allocation_id}'s"
        attrs = f'class="gpuhub-preemption" data-preemption="{p.id}"'
        reason = escape(p.reason)
        if n.withdrawn:  # the ledger's row says so: nothing is taken back
            parts.append(
                f'<p {attrs} data-state="withdrawn">{which} {_gpus(p)} will not be taken back: the '
                f"notice of {p.created:%H:%M:%S} UTC was withdrawn at {p.withdrawn:%H:%M:%S} UTC "
                f"({escape(p.withdrawn_reason or 'withdrawn')}).</p>"
            )
        elif n.pending:
            late = now is not None and now >= p.due
            are = "is" if _count(p) == 1 else "are"
            when = f"{are} being taken back now" if late else f"will be taken back at {p.due:%H:%M:%S} UTC"
            then = "gpuhub stops the server then" if p.purpose == "server" else "its engines stop then"
            parts.append(
                f'<p {attrs} data-state="pending">{which} {_gpus(p)} {when} for a request '
                f"within its limit: {then}. Save your work now. ({reason})</p>"
            )
        else:
            when = n.ended or p.due
            parts.append(
                f'<p {attrs} data-state="done">{which} {_gpus(p)} '
                f"{'was' if _count(p) == 1 else 'were'} taken back at "
                f"{when:%Y-%m-%d %H:%M} UTC for a request within its limit: gpuhub stopped the server "
                f"({reason}). Your notebooks and files are saved; start it again within your limit, "
                "or borrow again when GPUs are free and nobody waits.</p>"
            )
    return "".join(parts)


class ReclaimNotice:
    """A template variable: the user's reclaim and preemption notices, then any announcement
    the admin set."""

    def __init__(self, config, fallback=None, cache_seconds: float = 10.0):
        self.config = config
        self.fallback = fallback
        self.cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, str]] = {}  # name -> (until, text): called for every page

    def __call__(self, user) -> str | None:
        base = self.fallback(user) if callable(self.fallback) else self.fallback
        if user is None:
            return base
        from spawner.settings import GpuHub

        cached = self._cache.get(user.name)
        if cached and time.monotonic() < cached[0]:
            text = cached[1]
        else:
            try:
                ledger = GpuHub(config=self.config).open_ledger(sync=False)
                notices = ledger.reclaim_notices(user.name)
                preempted = ledger.preemption_notices(user.name)
                now = ledger.clock()
            except Exception:  # the home page must render even when the ledger cannot be read
                return base
            text = render_notices(notices) + render_preemptions(preempted, now)
            # a notice whose grace runs changes soon (taken back, then stopped): read it again sooner
            keep = min(self.cache_seconds, 2.0) if any(n.pending for n in preempted) else self.cache_seconds
            self._cache[user.name] = (time.monotonic() + keep, text)
        if not text:
            return base
        return text + (base if isinstance(base, str) else "")
