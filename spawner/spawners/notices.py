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

from gpu_magics.common.words import clock, count, stamp
from spawner.policy.records import PreemptionNotice, ReclaimInfo


def render_notices(notices: list[ReclaimInfo]) -> str:
    """The home page's text for a user's reclaimed servers (HTML, every value escaped)."""
    parts = []
    for r in notices:
        which = f"Your server <b>{escape(r.server_name)}</b>" if r.server_name else "Your server"
        parts.append(
            f'<p class="gpuhub-reclaim">{which} was stopped by gpuhub at '
            f"{stamp(r.created)} to give its GPUs back: {escape(r.reason)}. "
            "Your notebooks and files are saved; start the server again when you need GPUs.</p>"
        )
    return "".join(parts)


def _gpus(p) -> str:
    """What a notice takes back: the borrowed GPUs, or all of one that started ahead of the
    queue (backfill: ``borrowed`` 0), in words that read on before a verb."""
    if p.borrowed:
        return count(p.borrowed, "borrowed GPU")
    return f"{count(p.gpus, 'GPU')}, which started ahead of the queue,"


def _count(p) -> int:
    return p.borrowed or p.gpus


def render_preemptions(notices: list[PreemptionNotice], now=None) -> str:
    """The home page's text for a user's preemptions (HTML, every value escaped): a pending
    one says when its borrowed GPUs will be taken back, a done one (a server) when they were,
    a withdrawn one that they will not be, and why. Each says it once: the preemption's
    reason (the ledger's, shown to admins) would repeat the sentence."""
    parts = []
    for n in notices:
        p = n.preemption
        if p.purpose == "server":
            which = f"Your server <b>{escape(p.server_name)}</b>'s" if p.server_name else "Your server's"
        else:
            which = f"Your burst #{p.allocation_id}'s"
        attrs = f'class="gpuhub-preemption" data-preemption="{p.id}"'
        if n.withdrawn:  # the ledger's row says so: nothing is taken back
            why = (p.withdrawn_reason or "").removeprefix("withdrawn: ")
            parts.append(
                f'<p {attrs} data-state="withdrawn">{which} {_gpus(p)} will not be taken back: the '
                f"notice of {clock(p.created)} was withdrawn at {clock(p.withdrawn)}"
                f"{': ' + escape(why) if why else ''}.</p>"
            )
        elif n.pending:
            late = now is not None and now >= p.due
            are = "is" if _count(p) == 1 else "are"
            when = f"{are} being taken back now" if late else f"will be taken back at {clock(p.due)}"
            then = "gpuhub stops the server then" if p.purpose == "server" else "its engines stop then"
            parts.append(
                f'<p {attrs} data-state="pending">{which} {_gpus(p)} {when} for a request '
                f"within its limit: {then}. Save your work now.</p>"
            )
        else:
            when = n.ended or p.due
            parts.append(
                f'<p {attrs} data-state="done">{which} {_gpus(p)} '
                f"{'was' if _count(p) == 1 else 'were'} taken back at "
                f"{stamp(when)} for a request within its limit: gpuhub stopped the server. "
                "Your notebooks and files are saved; start it again within your limit, "
                "or borrow again when GPUs are free and nobody waits.</p>"
            )
    return "".join(parts)


class ReclaimNotice:
    """A template variable: the user's reclaim and preemption notices, then any announcement
    the admin set."""

    def __init__(self, config, fallback=None, cache_seconds: float = 10.0, admins=(), admin_url: str = ""):
        self.config = config
        self.fallback = fallback
        self.admins = set(admins)  # gpuhub's admins (its gpuhub-admin role): shown GPU admin's link
        self.admin_url = admin_url
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
        text = self.admin_line(user.name) + text
        if not text:
            return base
        return text + (base if isinstance(base, str) else "")

    def admin_line(self, name: str) -> str:
        """An admin's way in to GPU admin from the home page (it is also in the Services menu)."""
        if name not in self.admins or not self.admin_url:
            return ""
        return (
            f'<p class="gpuhub-admin-link">You administer gpuhub: <a href="{escape(self.admin_url)}">'
            "GPU admin</a> shows who holds which GPUs, the queue and the limits. "
            "Your own server's spawn form follows your own GPU limit (set it in GPU admin's Limits).</p>"
        )
