"""Extensions of a running allocation's time limit (the ledger's part ``ExtensionRecords``).

:meth:`extend` decides and records in one transaction, under the ledger's write lock: the
allocation must be live and time-limited; the policy (:mod:`spawner.policy.extensions`)
caps the total and refuses an extension that would make anyone waiting start later than the
queue now expects (the queue's plan is computed with and without it, in the same
transaction); an admin's extension passes both. The new limit is written to the allocation
(what the broker's time-limit pass, the queue and the kernel read) and one
``time_extensions`` row says who, when and how much. :meth:`undo_extension` takes back one
that the backend could not carry out (Slurm refused the job's new TimeLimit).
"""

from __future__ import annotations

from sqlalchemy import exists, func, select

from spawner.ledger.models import Allocation, QueueEntry, TimeExtension
from spawner.ledger.transactions import _info
from spawner.policy import extensions as policy
from spawner.policy.limits import Refusal
from spawner.policy.records import AllocationInfo, ExtensionInfo

WAITING = QueueEntry.state == "waiting"


def _ext_info(e: TimeExtension) -> ExtensionInfo:
    return ExtensionInfo(
        e.id, e.allocation_id, e.user, e.by, e.at, e.seconds, e.before_seconds, e.after_seconds
    )


class ExtensionRecords:
    """Uses ``_tx``/``_read`` (``LedgerBase``), ``scene_in`` (``QueueRecords``) and the
    ledger's ``extend_settings`` (``c.GpuHub.extension_*``)."""

    def extend(
        self, allocation_id: int, hours: float, by: str, *, admin: bool = False
    ) -> tuple[AllocationInfo, ExtensionInfo]:
        """Extend ``allocation_id``'s time limit by ``hours`` for ``by`` (its user, or an admin
        with ``admin``); a :class:`Refusal` says why not (``not_found``: no such live
        allocation; ``extension_refused``: no time limit, or the policy's reason)."""
        rules = self.extend_settings
        with self._tx() as s:
            a = s.get(Allocation, allocation_id)
            if a is None or a.state == "released":
                raise Refusal(
                    f"Allocation {allocation_id} has ended; there is nothing to extend.", reason="not_found"
                )
            if a.time_limit_seconds is None:
                raise Refusal(
                    f"Allocation {allocation_id} has no time limit; it needs no extension.",
                    reason="extension_refused",
                )
            seconds = hours * 3600.0
            if not admin:
                done = s.scalar(
                    select(func.coalesce(func.sum(TimeExtension.seconds), 0.0)).where(
                        TimeExtension.allocation_id == a.id, TimeExtension.by == a.user
                    )
                )
                cap = (hours, float(done or 0.0), rules.max_hours, "c.GpuHub.extension_max_hours")
                why = policy.extension_refusal(*cap, 0, rules.delays_waiters)
                if why is None and not rules.delays_waiters and s.scalar(select(exists().where(WAITING))):
                    # the queue planned without it and with it, in this transaction: only
                    # when it may be granted by the cap and someone waits
                    now = self.clock()
                    before = self._expected_starts(s, now)
                    a.time_limit_seconds += seconds
                    s.flush()
                    after = self._expected_starts(s, now)
                    a.time_limit_seconds -= seconds  # decided here; written once, below
                    why = policy.extension_refusal(*cap, len(policy.delayed(before, after)), False)
                if why is not None:
                    raise why
            row = TimeExtension(
                allocation_id=a.id,
                user=a.user,
                by=by,
                at=self.clock(),
                seconds=seconds,
                before_seconds=a.time_limit_seconds,
                after_seconds=a.time_limit_seconds + seconds,
            )
            a.time_limit_seconds = row.after_seconds
            s.add(row)
            s.flush()
            return _info(a), _ext_info(row)

    def _expected_starts(self, s, now) -> dict:
        """Each waiting entry's expected start as the queue plans it now (in ``s``)."""
        scene = self.scene_in(s, now)
        return {entry: getattr(scene.plan.expected.get(entry), "at", None) for entry in scene.order}

    def undo_extension(self, extension_id: int) -> None:
        """Take back an extension the backend could not carry out (its row goes)."""
        with self._tx() as s:
            e = s.get(TimeExtension, extension_id)
            if e is None:
                return
            a = s.get(Allocation, e.allocation_id)
            if a is not None and a.time_limit_seconds is not None:
                a.time_limit_seconds -= e.seconds
            s.delete(e)

    def extensions(self, user: str | None = None, allocation_id: int | None = None, limit: int = 200):
        """The newest extensions first, of one user or allocation, or all."""
        q = select(TimeExtension).order_by(TimeExtension.id.desc()).limit(limit)
        if user is not None:
            q = q.where(TimeExtension.user == user)
        if allocation_id is not None:
            q = q.where(TimeExtension.allocation_id == allocation_id)
        with self._read() as s:
            return [_ext_info(e) for e in s.scalars(q)]
