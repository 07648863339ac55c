"""A burst allocation of the gpuhub broker, from request to release: one object for every magic.

``%%distributed`` and ``%dask_cuda`` take extra GPUs the same way: ask the broker (within the
user's limit; a refusal becomes a ``UsageError`` with the broker's own message), renew the lease
every third of it while the GPUs are used (:class:`~gpu_magics.kernel.broker.LeaseKeeper`, which
also tells the broker how long the user's code has been idle), notice when the hub ended it
(``lost`` and ``reason``), and give it back once (``release``, which says so when the broker
could not be told). A Slurm burst holds no GPUs until its job runs: ``attach_job`` tells the
broker which job that is, and ``size`` is the count it was admitted for.

A :class:`Burst` holds :class:`Part` s, one allocation each. One part is the common case; a
pool that borrows beyond the user's limit holds two (:meth:`Burst.join`): the GPUs within the
limit, then the borrowed ones, so that a preemption takes back only the borrowed part (and the
ledger never shows an in-limit GPU preempted).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

from IPython.core.error import UsageError

from gpu_magics.common import guard
from gpu_magics.common.ranks import Slot
from gpu_magics.common.words import count
from gpu_magics.kernel.broker import BrokerClient, BrokerError, LeaseKeeper
from gpu_magics.kernel.notices import when


def burst_size(allocation: Mapping) -> int:
    """GPUs an allocation was admitted for (a Slurm burst holds none until its job runs)."""
    return allocation.get("gpu_count") or len(allocation.get("gpus") or ())


class Part:
    """One allocation of a burst: the broker's JSON and its lease, renewed until :meth:`release`."""

    def __init__(
        self,
        client: BrokerClient,
        allocation: dict,
        lease_seconds: float,
        *,
        activity: Callable[[], float | None] | None = None,
        log: Callable[[str], None] | None = print,
        check_seconds: float | None = None,
        on_notice: Callable[[Part, dict], None] | None = None,
    ):
        self.client = client
        self.allocation = allocation  # the broker's JSON, kept up to date (attach_job)
        self.lease = LeaseKeeper(
            client,
            allocation,
            lease_seconds,
            log=log,
            activity=activity,
            check_seconds=check_seconds,
            on_notice=(lambda notice: on_notice(self, notice)) if on_notice else None,
        )
        self.log = log
        self.released = False
        self._lock = threading.Lock()
        self._reporting = False
        guard.kernel_guard().add(self.id)  # the reaper gives it back should the kernel die

    @property
    def id(self) -> int:
        return self.allocation["id"]

    @property
    def size(self) -> int:
        return burst_size(self.allocation)

    @property
    def slots(self) -> list[Slot]:
        return [Slot(g["node"], g["index"]) for g in self.allocation.get("gpus") or ()]

    @property
    def borrowed(self) -> int:
        """GPUs of it beyond the user's limit (lent while idle; the only ones ever taken back)."""
        return int(self.allocation.get("borrowed") or 0)

    @property
    def preemption(self) -> dict | None:
        """The broker's notice that its borrowed GPUs are taken back: ``{"due", "reason"}``."""
        return self.lease.preemption

    @property
    def lost(self) -> bool:
        """The hub ended it (lease expired, reclaimed, released by an admin)."""
        return bool(self.lease.lost)

    @property
    def reason(self) -> str:
        return self.lease.reason or ("released by the hub" if self.lost else "")

    @property
    def expires(self) -> str | None:
        return self.lease.expires or self.allocation.get("lease_expires")

    def attach_job(self, job_id: str) -> None:
        """Tell the broker which Slurm job runs this allocation's engines."""
        self.allocation.update(self.client.attach_job(self.id, job_id))

    def report_here(self) -> None:
        """Report this allocation's GPUs' use from this process (their users run on this machine)."""
        from gpu_magics.report.reporter import start_burst_reporter

        if self._reporting:
            return
        self._reporting = True
        start_burst_reporter(self.id, [s.label for s in self.slots])

    def check_now(self) -> bool:
        """Ask the broker now whether the hub ended it (see ``LeaseKeeper.check_now``)."""
        return not self.released and self.lease.check_now()

    def lost_text(self) -> str:
        """How the hub ended it, once ``lost``: ``allocation #5 (2 borrowed GPUs) ended at
        2026-12-04 21:40:05 UTC: preempted: ...``."""
        what = f"{count(self.borrowed, 'borrowed GPU')}" if self.borrowed else count(self.size, "GPU")
        at = when(self.lease.ended)
        return f"allocation #{self.id} ({what}) ended{f' at {at}' if at else ''}: {self.reason}"

    def unguard(self) -> None:
        """The kernel answers for this allocation's end itself (it acts on its notice, or gives
        it back): the reaper no longer stops the pool when the hub ends it
        (:mod:`gpu_magics.common.guard`)."""
        guard.kernel_guard().remove(self.id)

    def release(self) -> bool:
        """Stop renewing and give the GPUs back; idempotent. True if this call released it.
        A broker that cannot be told is reported (``log``); the lease then runs out."""
        with self._lock:
            if self.released:
                return False
            self.released = True
        self.unguard()  # before the broker hears of it: the reaper then knows it was this kernel
        self.lease.stop()
        try:
            self.client.release(self.id)
        except BrokerError as e:
            if self.log:
                self.log(
                    f"gpuhub: could not release allocation {self.id}: {e}; its lease ends it "
                    f"by {when(self.expires) or 'its expiry'}."
                )
        return True


class Burst:
    """One live burst: its parts' leases renewed until :meth:`release`."""

    def __init__(self, parts: list[Part]):
        self.parts = list(parts)
        self._done = threading.Event()

    @classmethod
    def request(
        cls,
        magic: str,
        gpus: int,
        *,
        lease_seconds: float,
        nodes: int | None = 1,
        gpus_per_node: int | None = None,
        node: str | None = None,
        held: int = 0,
        wanted: int | None = None,
        activity: Callable[[], float | None] | None = None,
        log: Callable[[str], None] | None = print,
        wait: bool = True,
        show: Callable[[str], None] | None = None,
        check_seconds: float | None = None,
        on_notice: Callable[[Part, dict], None] | None = None,
        beside: str = "this server's",
    ) -> Burst:
        """Ask the broker for ``gpus`` GPUs (``node``: all on that node, beside the server's own).

        ``magic`` names the caller in messages (``%%distributed``); ``held`` is how many GPUs the
        server holds itself, ``wanted`` the total the user asked for (default: ``gpus``). Raises a
        UsageError, with the broker's reason, when there is no broker or it refuses; then
        nothing is held. A refusal keeps the broker's answer as the error's ``refusal``.

        ``wait``: when the GPUs are all taken, wait in gpuhub's queue with the place shown
        (``show``, default a line of the cell's output updated in place); Ctrl-C leaves it
        (:class:`~gpu_magics.kernel.queuewait.QueueInterrupt`), holding nothing.

        ``check_seconds``/``on_notice``: for borrowed GPUs, how often to look for a preemption
        notice, and whom to tell (``on_notice(part, {"due", "reason"})``, from the lease's
        thread).
        """
        wanted = gpus if wanted is None else wanted
        client = BrokerClient.from_env()
        if client is None:
            raise UsageError(
                f"{magic} --gpus {wanted} needs {wanted} GPUs; this server holds {held} and no gpuhub "
                f"broker is configured (GPUHUB_BROKER_URL). Ask for at most {held} GPUs, or start "
                "the server with more."
            )
        try:
            alloc = client.request(gpus, nodes, gpus_per_node, lease_seconds, node=node, wait=wait)
            if "queued" in alloc:
                from gpu_magics.kernel.queuewait import wait_for_turn

                alloc = wait_for_turn(
                    client, alloc["queued"], magic=magic, poll=queue_poll_seconds(), show=show
                )
        except BrokerError as e:
            raise refused(magic, gpus, wanted, held, e, beside) from None
        part = Part(
            client,
            alloc,
            lease_seconds,
            activity=activity,
            log=log,
            check_seconds=check_seconds,
            on_notice=on_notice,
        )
        return cls([part])

    def join(self, other: Burst) -> Burst:
        """One burst of both bursts' parts (this one's first)."""
        return Burst([*self.parts, *other.parts])

    # what it holds ----------------------------------------------------------------------

    @property
    def id(self) -> int:
        """The first part's allocation (the only one but where the pool borrows)."""
        return self.parts[0].id

    @property
    def allocation(self) -> dict:
        return self.parts[0].allocation

    @property
    def lease(self) -> LeaseKeeper:
        return self.parts[0].lease

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    @property
    def slots(self) -> list[Slot]:
        return [s for p in self.parts for s in p.slots]

    @property
    def borrowed(self) -> int:
        return sum(p.borrowed for p in self.parts)

    def report_ids(self) -> list[int]:
        """The allocation each of its GPUs (``slots``, in order) belongs to."""
        return [p.id for p in self.parts for _ in p.slots]

    @property
    def lost(self) -> bool:
        """The hub ended a part of it (lease expired, reclaimed, released by an admin)."""
        return any(p.lost for p in self.parts)

    @property
    def reason(self) -> str:
        return next((p.reason for p in self.parts if p.lost), "")

    def check_now(self) -> bool:
        """Ask the broker now whether the hub ended a part (a cell is about to use the GPUs)."""
        return any([p.check_now() for p in self.parts])

    def lost_text(self) -> str:
        """How the hub ended the parts it ended (``Part.lost_text``), ``; ``-joined."""
        return "; ".join(p.lost_text() for p in self.parts if p.lost)

    @property
    def expires(self) -> str | None:
        return min((p.expires for p in self.parts if p.expires), default=None)

    @property
    def released(self) -> bool:
        return all(p.released for p in self.parts)

    # its life -----------------------------------------------------------------------------

    def attach_job(self, job_id: str) -> None:
        """Tell the broker which Slurm job runs this burst's engines (a Slurm burst is one part)."""
        self.parts[0].attach_job(job_id)

    def report_here(self) -> None:
        """Report this burst's GPUs' use from this process (their users run on this machine)."""
        for p in self.parts:
            p.report_here()

    def watch(self, on_lost: Callable[[Burst], None], interval: float) -> None:
        """Call ``on_lost(self)`` once, from a daemon thread, if the hub ends a part of the burst
        before :meth:`release`."""

        def run():
            while not self.released:
                if self.lost:
                    if not self.released:
                        on_lost(self)
                    return
                self._done.wait(interval)

        threading.Thread(target=run, daemon=True, name="gpuhub-burst-watch").start()

    def release(self) -> bool:
        """Give every part back; idempotent. True if this call released one."""
        done = [p.release() for p in self.parts]
        self._done.set()
        return any(done)


def queue_poll_seconds() -> float:
    """How often a waiting burst asks whether its turn came (``c.GpuHub.queue_poll_seconds``,
    passed to the server as ``GPUHUB_QUEUE_POLL_SECONDS``)."""
    try:
        return max(0.2, float(os.environ.get("GPUHUB_QUEUE_POLL_SECONDS", "1")))
    except ValueError:
        return 1.0


def refused(
    magic: str, gpus: int, wanted: int, held: int, e: BrokerError, beside: str = "this server's"
) -> UsageError:
    """The broker's refusal as the user reads it; ``e`` stays on it as ``.refusal``. ``held``
    GPUs are ``beside``'s (the server's own, or a pool's that grows)."""
    if held and wanted > gpus:
        text = (
            f"gpuhub refused {count(gpus, 'more GPU')} for {magic} --gpus {wanted} (beside {beside} "
            f"{held}): {e.message}"
        )
        if e.reason == "over_limit" and e.fits is not None:  # the broker counts GPUs beyond the server's
            text += f" In this cell that is {magic} --gpus {held + e.fits} or fewer."
    else:
        text = f"gpuhub refused {count(gpus, 'GPU')} for {magic}: {e.message}" + (
            f" Own server GPUs: {held}." if held else ""
        )
    err = UsageError(text)
    err.refusal = e
    return err
