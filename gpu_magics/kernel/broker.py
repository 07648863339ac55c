"""The kernel's way to the gpuhub broker: burst allocations, leases, release.

Uses the server's own ``$JUPYTERHUB_API_TOKEN`` (which has exactly the
``custom:gpuhub:allocations`` scope for its user) and ``$GPUHUB_BROKER_URL`` (set by the hub).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from urllib.parse import urlencode

import requests


class BrokerError(Exception):
    def __init__(self, status: int, message: str, reason: str = "", fits: int | None = None):
        super().__init__(message)
        self.status, self.message, self.reason, self.fits = status, message, reason, fits


class BrokerClient:
    def __init__(self, url: str, token: str, timeout: float = 30):
        self.url = url if url.endswith("/") else url + "/"
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"token {token}"
        self.timeout = timeout

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> BrokerClient | None:
        env = os.environ if environ is None else environ
        url, token = env.get("GPUHUB_BROKER_URL"), env.get("JUPYTERHUB_API_TOKEN")
        return cls(url, token) if url and token else None

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            r = self.session.request(method, self.url + path, json=body, timeout=self.timeout)
        except requests.RequestException as e:
            raise BrokerError(0, f"The gpuhub broker at {self.url} cannot be reached: {e}") from None
        data = (
            r.json() if r.content and r.headers.get("Content-Type", "").startswith("application/json") else {}
        )
        if r.status_code >= 400:
            raise BrokerError(
                r.status_code, data.get("message", r.reason), data.get("reason", ""), data.get("fits")
            )
        return data

    def me(self, session: tuple[str, str] | None = None) -> dict:
        """``GET me``; ``session``: ``(server name, its start as an ISO time)``, for that
        server's session's energy so far (``session``)."""
        if session is None:
            return self._call("GET", "me")
        return self._call("GET", "me?" + urlencode({"server": session[0], "since": session[1]}))

    def request(
        self,
        gpus: int,
        nodes: int | None,
        gpus_per_node: int | None,
        lease_seconds: float,
        node: str | None = None,
        wait: bool = False,
    ) -> dict:
        """A burst; ``node``: every GPU on that node (beside the server's own GPUs there).
        ``wait``: when the GPUs are all taken, join the queue: the answer is then
        ``{"queued": entry}`` (see :mod:`gpu_magics.kernel.queuewait`)."""
        body = {
            "gpus": gpus,
            "nodes": nodes,
            "gpus_per_node": gpus_per_node,
            "lease_seconds": lease_seconds,
            "node": node,
            "wait": wait or None,
            # the server this kernel runs in: its stop gives the burst back at once
            "server": os.environ.get("JUPYTERHUB_SERVER_NAME"),
        }
        return self._call("POST", "allocations", {k: v for k, v in body.items() if v is not None})

    def wait_turn(self, entry_id: int) -> dict:
        """``{"entry": ..., "allocation": ... or None}``: has this queue entry's turn come?"""
        return self._call("POST", f"queue/{entry_id}/wait", {})

    def queue(self) -> dict:
        """``{"queue": [...]}``: the caller's waiting entries, each with its place."""
        return self._call("GET", "queue")

    def queue_entry(self, entry_id: int) -> dict:
        return self._call("GET", f"queue/{entry_id}")

    def leave_queue(self, entry_id: int) -> dict:
        return self._call("DELETE", f"queue/{entry_id}")

    def attach_job(self, allocation_id: int, job_id: str) -> dict:
        """Tell gpuhub which Slurm job runs a burst's engines."""
        return self._call("POST", f"allocations/{allocation_id}/job", {"job_id": str(job_id)})

    def renew(self, allocation_id: int, lease_seconds: float, idle_seconds: float | None = None) -> dict:
        body = {"lease_seconds": lease_seconds}
        if idle_seconds is not None:  # when the engines last ran a cell (idle reclaim)
            body["idle_seconds"] = round(max(0.0, idle_seconds), 1)
        return self._call("POST", f"allocations/{allocation_id}/renew", body)

    def get(self, allocation_id: int) -> dict:
        return self._call("GET", f"allocations/{allocation_id}")

    def extend(self, allocation_id: int, hours: float) -> dict:
        """More time on an allocation (its time limit); the broker decides."""
        return self._call("POST", f"allocations/{allocation_id}/extend", {"hours": hours})

    def utilization(self) -> dict:
        """The latest readings of the caller's GPUs (every GPU for an admin)."""
        return self._call("GET", "utilization")

    def report(self, allocation_id: int, body: dict) -> dict:
        """GPU samples (and activity) of an allocation; the answer holds its idle state."""
        return self._call("POST", f"allocations/{allocation_id}/samples", body)

    def release(self, allocation_id: int, why: str | None = None) -> None:
        """Give a burst back; ``why``: one of the broker's fixed reasons (``kernel_gone``)."""
        try:
            self._call("DELETE", f"allocations/{allocation_id}" + (f"?why={why}" if why else ""))
        except BrokerError as e:
            if e.status not in (404, 409):  # already gone is fine
                raise


class LeaseKeeper:
    """Renews a burst allocation's lease every third of its length until stopped.

    ``lost`` turns True when the broker says the allocation is gone (its lease expired, or an
    admin released it): the pool must then stop using those GPUs.

    An allocation with borrowed GPUs may be taken back with notice (``preemption``: the
    broker's ``{"due", "reason"}``): it is also looked at (``GET allocations/{id}``) every
    ``check_seconds`` between renewals, so that a grace period shorter than a third of the
    lease is not missed; ``on_notice(preemption)`` is called once per notice, from this
    thread. So is an allocation that started ahead of the queue (``backfill``: it may be taken
    back for the request it went ahead of). A notice the broker withdraws (the request it was
    for no longer waits: the answer's ``preemption`` is null and ``preemption_withdrawn`` says
    when and why, from the ledger's row) is passed on as ``on_notice({"withdrawn": ...})``.
    """

    def __init__(
        self,
        client: BrokerClient,
        allocation: dict,
        lease_seconds: float,
        log=None,
        activity=None,
        check_seconds: float | None = None,
        on_notice=None,
    ):
        self.client, self.allocation, self.lease_seconds, self.log = client, allocation, lease_seconds, log
        self.activity = activity  # () -> seconds since the engines last ran a cell (0: busy)
        self.expires = allocation.get("lease_expires")
        self.lost = False
        self.reason = ""  # why the broker ended it, once lost
        self.ended: str | None = None  # when, as the broker says (ISO), once lost
        self.preemption: dict | None = allocation.get("preemption")
        self.check_seconds = check_seconds
        self.on_notice = on_notice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpuhub-lease")
        self._thread.start()

    @property
    def borrowed(self) -> int:
        return int(self.allocation.get("borrowed") or 0)

    @property
    def preemptible(self) -> bool:
        """Borrowed GPUs, or GPUs that started ahead of the queue: they may be taken back."""
        return bool(self.borrowed or self.allocation.get("backfill"))

    def _run(self) -> None:
        every = self.lease_seconds / 3
        next_renewal = time.monotonic() + every
        while True:
            wait = next_renewal - time.monotonic()
            if self.preemptible and self.check_seconds:  # only such GPUs are ever taken back
                wait = min(wait, self.check_seconds)
            if self._stop.wait(max(0.0, wait)):
                return
            try:
                if time.monotonic() >= next_renewal:
                    idle = self.activity() if self.activity else None
                    answer = self.client.renew(self.allocation["id"], self.lease_seconds, idle)
                    self.expires = answer["lease_expires"]
                    next_renewal = time.monotonic() + every
                else:
                    answer = self.client.get(self.allocation["id"])
                    if self._ended(answer):
                        self._noticed(answer)
                        return
                self._noticed(answer)
            except BrokerError as e:
                if e.status in (404, 409):  # released: renewing again cannot bring it back
                    if e.reason == "preempted" and self.preemption:
                        self.reason = self.preemption.get("reason") or e.message
                    else:
                        self.reason = self._end_reason() or e.message
                    self.lost = True
                    return
                self._say(f"could not renew the lease of allocation {self.allocation['id']}: {e}")
            except Exception as e:  # a renewal thread that dies silently would lose the GPUs
                self._say(f"could not renew the lease of allocation {self.allocation['id']}: {e!r}")

    def _noticed(self, answer: dict) -> None:
        """A preemption notice in the broker's answer, passed on once (a new one, given again
        after a withdrawal, once more); a withdrawal the ledger recorded, passed on once."""
        notice = answer.get("preemption")
        if not notice:
            withdrawn = answer.get("preemption_withdrawn")
            if self.preemption and withdrawn and answer.get("state") != "released":
                self.preemption = None
                self._tell({"withdrawn": withdrawn})
            return
        if notice == self.preemption:
            return
        self.preemption = notice
        self._tell(notice)

    def _tell(self, what: dict) -> None:
        if self.on_notice is not None:
            try:
                self.on_notice(what)
            except Exception as e:  # never let it end the renewals
                self._say(f"while showing the preemption notice of allocation {self.allocation['id']}: {e!r}")

    def _end_reason(self) -> str:
        try:
            answer = self.client.get(self.allocation["id"])
        except BrokerError:
            return ""
        self.ended = answer.get("ended")
        return answer.get("end_reason") or ""

    def _ended(self, answer: dict) -> bool:
        """Take the broker's answer: True (and ``lost``, ``reason``, ``ended`` set) if it ended."""
        if not (answer.get("ended") or answer.get("state") == "released"):
            return False
        self.reason = answer.get("end_reason") or "released by the hub"
        self.ended = answer.get("ended")
        self.lost = True
        return True

    def check_now(self) -> bool:
        """Ask the broker now whether it ended the allocation, as a cell is about to use it (a
        kernel that was paused runs its cell before this thread wakes); True if it did. A
        broker that cannot answer leaves it as it was."""
        if self.lost or self._stop.is_set():
            return self.lost
        try:
            answer = self.client.get(self.allocation["id"])
        except BrokerError as e:
            if e.status == 404:
                self.reason, self.lost = e.message, True
            return self.lost
        except Exception:
            return False
        if self._ended(answer):
            self._stop.set()  # nothing left to renew
        return self.lost

    def _say(self, text: str) -> None:
        if self.log:
            self.log(f"gpuhub: {text}")

    def stop(self) -> None:
        self._stop.set()
