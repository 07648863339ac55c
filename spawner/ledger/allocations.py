"""The life of an allocation once admitted (a part of :class:`spawner.ledger.Ledger`): started,
given its job and GPUs, renewed, released, expired; and the reads of allocations. Admission
itself is ``spawner/ledger/admission.py``."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session, selectinload

from spawner.ledger.db import connection
from spawner.ledger.models import (
    Allocation,
    AllocationGpu,
    GpuRow,
    Preemption,
    QueueEntry,
    Reclaim,
    is_live,
)
from spawner.ledger.transactions import _count, _info
from spawner.policy import timelimits
from spawner.policy.records import ACTIVE_STATES, AllocationInfo, GpuConflict

_A, _AG = Allocation.__table__, AllocationGpu.__table__
# a release's one read: the allocation's state, its reclaim's reason, its standing preemption's
RELEASE_READ = (
    select(
        _A.c.state,
        _A.c.started,
        _A.c.created,
        _A.c.time_limit_seconds,
        Reclaim.__table__.c.reason.label("reclaimed"),
        Preemption.__table__.c.reason.label("preempted"),
        Preemption.__table__.c.due,
        Preemption.__table__.c.entry_id,
        QueueEntry.__table__.c.state.label("for_state"),  # the request it was for: still waiting?
    )
    .select_from(_A)
    .outerjoin(Reclaim.__table__, Reclaim.__table__.c.allocation_id == _A.c.id)
    .outerjoin(
        Preemption.__table__,
        (Preemption.__table__.c.allocation_id == _A.c.id) & Preemption.__table__.c.withdrawn.is_(None),
    )
    .outerjoin(QueueEntry.__table__, QueueEntry.__table__.c.id == Preemption.__table__.c.entry_id)
    .where(_A.c.id == bindparam("id"))
)


class AllocationRecords:
    """Start, renew and release; the reads of allocations.

    Uses ``_tx``/``_write``/``_read``/``_end``/``_end_row``/``_active``/``_live_infos``
    (``LedgerBase``, ``CombinedWrites``), ``reclaim_reason_in``/``undo_if_used_in``
    (``ReclaimRecords``), ``preempt_reason_in`` (``BorrowingRecords``), ``withdraw_unwanted_in``
    (``TakeBackRecords``), ``end_stale_in`` and ``_leave`` (``QueueRecords``). Every other part
    calls ``expire_in``."""

    def mark_running(self, allocation_id: int, backend_job_id: str | None = None) -> AllocationInfo:
        with self._tx() as s:
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                raise LookupError(f"allocation {allocation_id} is not active")
            a.state = "running"
            a.started = a.started or self.clock()
            if backend_job_id is not None:
                a.backend_job_id = str(backend_job_id)
            return _info(a)

    def attach_job(self, allocation_id: int, backend_job_id: str) -> AllocationInfo:
        """Record the backend's job id of a live allocation. Once only: another id, or an id
        another live allocation already has, raises ``ValueError``."""
        job = str(backend_job_id)
        with self._tx() as s:
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                raise LookupError(f"allocation {allocation_id} is not active")
            if a.backend_job_id not in (None, job):
                raise ValueError(f"allocation {a.id} already runs as job {a.backend_job_id}")
            taken = s.scalars(
                select(Allocation.id).where(
                    Allocation.backend == a.backend,
                    Allocation.backend_job_id == job,
                    is_live(),
                    Allocation.id != a.id,
                )
            ).first()
            if taken is not None:
                raise ValueError(f"job {job} is already allocation {taken}'s")
            a.backend_job_id = job
            return _info(a)

    def record_gpus(
        self,
        allocation_id: int,
        gpus: Iterable[tuple[str, int]],
        backend_job_id: str | None = None,
        live_jobs: Iterable[str] | None = None,
    ) -> tuple[AllocationInfo, list[int]]:
        """Write the GPUs a scheduler gave a deferred allocation, and mark it running; a slice
        (``slice_parts``) gets the lowest part of its GPU that no one holds.

        The scheduler is the authority on its own GPUs: if another live allocation of the
        same backend still holds one of them, that allocation's job has ended and its end
        was not seen yet, so it is released here (its id is returned) rather than the
        GPU being double-booked. Slices of one GPU share it and are kept.

        ``live_jobs``: the backend's jobs that still run (the watcher's listing). A holder of
        the other kind (a whole GPU given where a slice is held, or a slice where the GPU is
        held whole) is released only when its job is known to be gone (not in ``live_jobs``):
        otherwise the scheduler gave one GPU twice (Slurm 22.05, docs/known-issues.md) and
        :class:`GpuConflict` is raised, nothing written. So is a slice given where every
        part is held by a live job.

        Unknown GPUs raise ``LookupError`` (sync the inventory); more GPUs than were admitted
        raise ``ValueError`` (the job is over the user's limit).
        """
        wanted = sorted(set(gpus))
        live = None if live_jobs is None else {str(j) for j in live_jobs}
        with self._tx() as s:
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                raise LookupError(f"allocation {allocation_id} is not active")
            if len(wanted) > _count(a) or (a.slice_parts and len(wanted) != 1):
                raise ValueError(
                    f"allocation {a.id} was admitted for {_count(a)} GPUs; the job shows {len(wanted)}"
                )
            rows = s.scalars(select(GpuRow).options(selectinload(GpuRow.node)))
            by_key = {(g.node.name, g.index): g for g in rows}
            missing = [f"{n}:{i}" for n, i in wanted if (n, i) not in by_key]
            if missing:
                raise LookupError(f"GPUs {', '.join(missing)} are not in the ledger's inventory")
            ids = {by_key[k].id for k in wanted}
            shown = ", ".join(f"{n}:{i}" for n, i in wanted)
            stale, kept_parts = [], set()
            for other in self._active(s):
                mine = [ag for ag in other.gpus if ag.held and ag.gpu_id in ids]
                if other.id == a.id or not mine:
                    continue
                if other.backend != a.backend:
                    raise RuntimeError(
                        f"GPUs {shown} are held by allocation {other.id} of backend "
                        f"{other.backend!r}: two backends share these GPUs"
                    )
                gone = live is not None and str(other.backend_job_id or "") not in live
                if bool(a.slice_parts) == bool(other.slice_parts) and (not a.slice_parts or gone):
                    stale.append(other)  # one kind: Slurm never gives a GPU (or a part) twice
                elif a.slice_parts and other.slice_parts:
                    kept_parts.update(ag.part for ag in mine)  # slices of one GPU share it
                elif gone:
                    stale.append(other)
                else:
                    what = "a slice of it" if other.slice_parts else "it whole"
                    raise GpuConflict(
                        f"GPU {shown} went to job {backend_job_id}; job {other.backend_job_id} of "
                        f"{other.user} holds {what}"
                    )
            part = 0
            if a.slice_parts:
                free = sorted(set(range(1, a.slice_parts + 1)) - kept_parts)
                if not free:
                    raise GpuConflict(
                        f"a 1/{a.slice_parts} slice of GPU {shown} went to job {backend_job_id}; all "
                        f"{a.slice_parts} of its parts are held by live jobs"
                    )
                part = free[0]
            released = []
            for other in stale:
                self._end(other, f"its {other.backend} job ended (GPUs given to job {backend_job_id})")
                released.append(other.id)
            s.flush()
            current = {ag.gpu_id for ag in a.gpus if ag.held}
            if current and current != ids:
                raise RuntimeError(f"allocation {a.id} already holds other GPUs")
            if not current:
                parts = a.slice_parts or 0
                a.gpus = [AllocationGpu(gpu=by_key[k], held=True, part=part, parts=parts) for k in wanted]
            a.state = "running"
            a.started = a.started or self.clock()
            if backend_job_id is not None:
                a.backend_job_id = str(backend_job_id)
            s.flush()
            return _info(a), released

    def release(self, allocation_id: int, reason: str = "released") -> bool:
        """Give the GPUs back. Idempotent: False when it was already released or unknown."""
        return self._write(lambda s: self._release_in(s, allocation_id, reason))

    def release_server(self, user: str, server_name: str, allocation_id: int, reason: str) -> list[int]:
        """A server stopped or died: give back its own allocation (``allocation_id``; 0: none)
        and every burst its kernels asked for (``of_server``), and end the queue entries its
        kernels wait in. Returns the ids released by this call (idempotent)."""

        bursts = select(Allocation.id).where(
            is_live(),
            Allocation.user == user,
            Allocation.server_name == server_name,
            Allocation.of_server.is_(True),
        )
        waits = select(QueueEntry).where(
            QueueEntry.state == "waiting",
            QueueEntry.user == user,
            QueueEntry.server_name == server_name,
            QueueEntry.of_server.is_(True),
        )
        if not allocation_id:  # most stops of a server without GPUs: nothing to write
            with self._read() as s:
                if s.scalar(bursts.limit(1)) is None and s.scalar(waits.limit(1)) is None:
                    return []

        def write(s: Session) -> list[int]:
            ids = ([allocation_id] if allocation_id else []) + sorted(
                set(s.scalars(bursts)) - {allocation_id}
            )
            released = [i for i in ids if self._release_in(s, i, reason)]
            for e in s.scalars(waits).all():
                self._leave(e, reason)
            return released

        return self._write(write)

    def _release_in(self, s: Session, allocation_id: int, reason: str) -> bool:
        found = connection(s).execute(RELEASE_READ, {"id": allocation_id}).first()
        if found is None or found.state not in ACTIVE_STATES:
            return False
        taken = None if found.reclaimed is None else f"reclaimed: {found.reclaimed}"
        # a notice for a request that no longer waits (not yet withdrawn) took nothing back
        stands = found.preempted is not None and (found.entry_id is None or found.for_state == "waiting")
        if taken is None and stands:  # due: taken back; else given back
            taken = (  # after its notice
                found.preempted
                if self.clock() >= found.due
                else f"{found.preempted}; given back before it was due ({reason})"
            )
        now = self.clock()
        if taken is None and timelimits.is_up(found.started, found.created, found.time_limit_seconds, now):
            ends = timelimits.ends_at(found.started, found.created, found.time_limit_seconds)
            taken = timelimits.time_up_text(found.time_limit_seconds, ends)  # the stop it asked for
        self._end_row(s, allocation_id, taken or reason)
        return True

    def renew(
        self, allocation_id: int, lease_seconds: float, active_at: datetime | None = None
    ) -> AllocationInfo:
        """Push a leased allocation's expiry to now + ``lease_seconds``.

        A reclaimed allocation is not renewed (its kernel must stop the engines and release
        it), unless ``active_at``, when its owner's code was last active, falls in the time
        the reclaim counted as idle: the reclaim was then decided on old news and is undone."""
        with self._tx() as s:
            self.expire_in(s)
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                raise LookupError(f"allocation {allocation_id} is not active")
            if a.lease_expires is None:
                raise ValueError(f"allocation {allocation_id} has no lease to renew")
            reclaimed = self.reclaim_reason_in(s, a.id)
            if reclaimed and not self.undo_if_used_in(s, a.id, active_at):
                raise LookupError(f"allocation {allocation_id} was {reclaimed}")
            now = self.clock()
            preempted = self.preempt_reason_in(s, a.id, now)
            if preempted:  # due, but only for a request that still waits
                self.end_stale_in(s, now)
                self.withdraw_unwanted_in(s, now)
                preempted = self.preempt_reason_in(s, a.id, now)
            if preempted:  # due: its kernel must stop the engines and release it
                raise LookupError(f"allocation {allocation_id} was {preempted}")
            a.lease_expires = self.clock() + timedelta(seconds=lease_seconds)
            return _info(a)

    def expire_in(self, s: Session) -> list[int]:
        now = self.clock()
        if not s.info.pop("leases_due", True):  # none was due when the transaction began
            return []  # (read with the lock row): the usual answer, without loading anything
        expired = list(s.scalars(select(Allocation).where(is_live(), Allocation.lease_expires <= now)))
        for a in expired:
            # usage counts up to the end of the lease, not up to when someone noticed
            taken = self.reclaim_reason_in(s, a.id) or self.preempt_reason_in(s, a.id, now)
            self._end(a, taken or "lease expired", when=a.lease_expires)
        return [a.id for a in expired]

    def expire_leases(self) -> list[int]:
        """Release every allocation whose lease ran out; returns their ids."""
        with self._tx() as s:
            return self.expire_in(s)

    def get(self, allocation_id: int) -> AllocationInfo | None:
        with self._read() as s:
            a = s.get(Allocation, allocation_id)
            return None if a is None else _info(a)

    def active(self, **where) -> list[AllocationInfo]:
        """Live allocations, filtered by column values, e.g. ``user="alice"``."""
        with self._read() as s:
            return self._live_infos(s, **where)

    def released_with_jobs(self, backend: str, job_ids: Iterable[str]) -> list[AllocationInfo]:
        """Released allocations of ``backend`` whose job id is one of ``job_ids``."""
        ids = [str(j) for j in job_ids]
        if not ids:
            return []
        with self._read() as s:
            q = select(Allocation).where(
                Allocation.backend == backend,
                Allocation.state == "released",
                Allocation.backend_job_id.in_(ids),
            )
            return [_info(a) for a in s.scalars(q.options(selectinload(Allocation.gpus)))]
