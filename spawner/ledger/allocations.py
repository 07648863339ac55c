"""Admission and the life of an allocation (a part of :class:`spawner.ledger.Ledger`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta

from sqlalchemy import bindparam, insert, or_, select
from sqlalchemy.orm import Session, selectinload

from spawner import policy
from spawner.ledger.db import connection
from spawner.ledger.freeset import CHANGES
from spawner.ledger.models import (
    PURPOSES,
    Allocation,
    AllocationGpu,
    Gpu,
    Preemption,
    QueueEntry,
    Reclaim,
    is_live,
)
from spawner.ledger.transactions import _count, _info, gpus_of
from spawner.ledger.usage import INTERVAL_COLUMNS, usage_interval
from spawner.policy import borrowing
from spawner.policy.records import ACTIVE_STATES, Admission, AllocationInfo, Allowance

_A, _AG = Allocation.__table__, AllocationGpu.__table__
NEW_ALLOCATION = insert(_A).returning(_A.c.id)
NEW_LINKS = insert(_AG)
LIVE_COUNTS = select(_A.c.gpu_count, gpus_of(_A.c.id), _A.c.borrowed).where(
    _A.c.user == bindparam("user"), is_live(_A.c.state)
)
WINDOW_ROWS = select(_A.c.state, _A.c.gpu_count, *INTERVAL_COLUMNS).where(
    _A.c.user == bindparam("user"), or_(_A.c.ended.is_(None), _A.c.ended >= bindparam("since"))
)
# a release's one read: the allocation's state, its reclaim's reason, its standing preemption's
RELEASE_READ = (
    select(
        _A.c.state,
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
    """Allocate, start, renew and release; what a user holds and may take."""

    def _holdings(self, s: Session, user: str, limit: policy.Limit) -> policy.Holdings:
        """What counts against the limit: GPUs held, less those borrowed beyond it (they have an
        allowance of their own: ``_borrowed_part``), and the GPU-hours of the window."""
        conn = connection(s)
        if limit.gpu_hours is None:
            held = sum(
                max(count or 0, n) - (borrowed or 0)
                for count, n, borrowed in conn.execute(LIVE_COUNTS, {"user": user})
            )
            return policy.Holdings(held=held, gpu_hours=0.0)
        # borrowed GPU-hours count against the budget unless c.GpuHub.borrowed_hours_count is off
        in_limit = not self.borrow_settings.count_borrowed_hours
        now = self.clock()
        since = now - timedelta(hours=limit.window_hours)
        # one query for both: a live allocation has no end yet (only ``_end`` and ``_end_row``
        # write one, with the state released), so the window's rows hold every live one
        held, intervals = 0, []
        for state, count, *row in conn.execute(WINDOW_ROWS, {"user": user, "since": since}):
            interval = usage_interval(*row, in_limit=in_limit)
            if state in ACTIVE_STATES:
                held += max(count or 0, row[-1]) - (row[-2] or 0)
            intervals.append(interval)
        hours = policy.gpu_hours_used(intervals, now, limit.window_hours)
        return policy.Holdings(held=held, gpu_hours=hours)

    def allowance(self, user: str, groups: Iterable[str] = (), model: str | None = None) -> Allowance:
        groups = list(groups)
        with self._read() as s:
            eff = policy.effective_limit(user, groups, self._rules(s))
            holdings = self._holdings(s, user, eff.limit)
            inventory, free = self._inventory(s), self._free(s)
            borrowed = sum(a.borrowed or 0 for a in self._active(s, user=user))
            now = self.clock()
            quiet = now - timedelta(seconds=self.queue_settings.keepalive_seconds)
            waiting = sum(
                1
                for seen in s.scalars(select(QueueEntry.seen).where(QueueEntry.state == "waiting"))
                if seen >= quiet
            )
        room = policy.remaining(eff, holdings)
        free_now = policy.largest_placeable(free, model, 1)
        allowance = self._allowance(user, groups)[0] if eff.limit.max_gpus is not None else 0
        beyond = max(0, free_now - (room or 0))  # free GPUs one request could take past the limit
        quota_left = room != 0 or eff.limit.gpu_hours is None or holdings.gpu_hours < eff.limit.gpu_hours
        may_borrow_now = 0 if waiting or not quota_left else min(max(0, allowance - borrowed), beyond)
        by_model: dict[str, int] = {}
        for g in free:
            by_model[g.model] = by_model.get(g.model, 0) + 1
        return Allowance(
            effective=eff,
            held=holdings.held,
            gpu_hours=holdings.gpu_hours,
            may_take=room,
            total=len(inventory),
            free=len(free),
            free_by_model=by_model,
            fits=free_now if room is None else min(room, free_now),
            borrow_allowance=allowance,
            borrowed=borrowed,
            waiting=waiting,
            may_borrow_now=may_borrow_now,
        )

    def allocate(
        self,
        user: str,
        groups: Iterable[str],
        count: int,
        *,
        purpose: str = "server",
        server_name: str = "",
        model: str | None = None,
        max_nodes: int | None = 1,
        gpus_per_node: int | None = None,
        backend: str = "local",
        lease_seconds: float | None = None,
        on_nodes: Iterable[str] | None = None,
        deferred: bool = False,
    ) -> AllocationInfo:
        """Admit and record a request now, or raise :class:`policy.Refusal` leaving nothing
        behind. (:meth:`request` waits in the queue instead of a refusal for capacity.)

        With ``lease_seconds`` the allocation is running at once and lives until its lease
        runs out unless renewed (a burst for ``%%distributed``); expired leases are released
        before any admission, so they never block one. ``on_nodes`` restricts the placement
        (a local server must land on this machine's GPUs).

        ``deferred``: the backend's scheduler picks the GPUs (Slurm). The request is checked
        against the user's limit and against what the nodes could ever hold, but not against
        what is free now (the job queues in the scheduler); it holds its count until
        :meth:`record_gpus` writes the GPUs the scheduler gave it.
        """
        got = self._admit(
            user,
            groups,
            count,
            purpose=purpose,
            server_name=server_name,
            model=model,
            max_nodes=max_nodes,
            gpus_per_node=gpus_per_node,
            backend=backend,
            lease_seconds=lease_seconds,
            on_nodes=on_nodes,
            deferred=deferred,
            wait=False,
        )
        assert got.allocation is not None
        return got.allocation

    def request(
        self,
        user: str,
        groups: Iterable[str],
        count: int,
        *,
        purpose: str = "server",
        server_name: str = "",
        model: str | None = None,
        max_nodes: int | None = 1,
        gpus_per_node: int | None = None,
        backend: str = "local",
        lease_seconds: float | None = None,
        on_nodes: Iterable[str] | None = None,
    ) -> Admission:
        """Like :meth:`allocate`, but a request that fits the limit and not the free GPUs
        joins the queue (``Admission.entry``; its waiter then calls :meth:`wait_turn`).
        Only what can never fit is refused."""
        return self._admit(
            user,
            groups,
            count,
            purpose=purpose,
            server_name=server_name,
            model=model,
            max_nodes=max_nodes,
            gpus_per_node=gpus_per_node,
            backend=backend,
            lease_seconds=lease_seconds,
            on_nodes=on_nodes,
            deferred=False,
            wait=True,
        )

    def _admit(self, user, groups, count, **options) -> Admission:
        """Check the request's form, then decide and write it in a writing transaction
        (``_admit_in``, which takes ``options``: ``allocate``'s and ``request``'s keywords)."""
        purpose = options["purpose"]
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}")
        groups = list(groups)
        shape = (options["model"], options["max_nodes"], options["gpus_per_node"])
        request = policy.Request(user, count, *shape)
        return self._write(lambda s: self._admit_in(s, user, groups, count, request, **options))

    def _admit_in(
        self,
        s: Session,
        user,
        groups,
        count,
        request,
        *,
        purpose,
        server_name,
        model,
        max_nodes,
        gpus_per_node,
        backend,
        lease_seconds,
        on_nodes,
        deferred,
        wait,
    ) -> Admission:
        """``_admit``'s decision and write, in the writing transaction ``s``."""
        self._expire(s)
        eff = policy.effective_limit(user, groups, self._rules(s))
        inventory, free = self._inventory(s), self._free(s)
        if on_nodes is not None:
            on_nodes = set(on_nodes)
            inventory = policy.GpuSet.ordered(g for g in inventory if g.node in on_nodes)
            free = policy.GpuSet.ordered(g for g in free if g.node in on_nodes)
        holdings = self._holdings(s, user, eff.limit)
        borrowed = self._borrowed_part(s, user, groups, eff, holdings, count)
        within = max(0, (eff.limit.max_gpus or 0) - holdings.held)  # what the limit leaves
        if borrowed:  # beyond the limit, within the allowance: the limit check counts it
            limit = replace(eff.limit, max_gpus=eff.limit.max_gpus + borrowed)
            eff = policy.EffectiveLimit(limit, eff.source)
        # the limit and what could ever fit; capacity is the queue's (or the scheduler's)
        policy.check_request(request, eff, holdings, inventory, inventory)
        if count == 0:
            raise policy.Refusal("An allocation needs at least 1 GPU.", reason="bad_request", fits=None)
        if policy.place(request, inventory, inventory) is None:
            raise policy.Refusal(
                f"{count} GPUs cannot be split as asked ({gpus_per_node or 'any'} per node, at most "
                f"{max_nodes or 'any'} nodes) on these nodes, even when all are free; "
                "ask for another split.",
                reason="too_large",
            )
        if deferred:
            booked = self._book(
                s,
                user=user,
                purpose=purpose,
                server_name=server_name,
                count=count,
                chosen=(),
                backend=backend,
                lease_seconds=lease_seconds,
                deferred=True,
                borrowed=borrowed,
            )
            return Admission(allocation=booked)
        if borrowed:
            return self._borrow_now(
                s,
                user=user,
                request=request,
                free=free,
                inventory=inventory,
                purpose=purpose,
                server_name=server_name,
                backend=backend,
                lease_seconds=lease_seconds,
                borrowed=borrowed,
                within=within,
            )
        return self._admit_or_queue(
            s,
            user=user,
            groups=groups,
            request=request,
            eff=eff,
            held=holdings.held,
            inventory=inventory,
            free=free,
            on_nodes=on_nodes,
            purpose=purpose,
            server_name=server_name,
            backend=backend,
            lease_seconds=lease_seconds,
            wait=wait,
        )

    def _book(
        self,
        s: Session,
        *,
        user,
        purpose,
        server_name,
        count,
        chosen,
        backend,
        lease_seconds,
        deferred: bool = False,
        now: datetime | None = None,
        borrowed: int = 0,
        backfill_for: Iterable[int] = (),
    ) -> AllocationInfo:
        """Write an allocation holding ``chosen`` (checked by the caller, in this transaction)
        and return its record. ``now``: the moment the caller decided at (the queue's plan),
        recorded as its creation. Two statements (the row, its GPUs), not the ORM's flush."""
        if s.new or s.dirty or s.deleted:
            s.flush()  # the ORM's changes first: a GPU that an ended allocation gave back
        ids = self._present(s).id_of
        now = now or self.clock()
        leased = lease_seconds is not None
        running = leased and not deferred
        row = dict(
            user=user,
            purpose=purpose,
            server_name=server_name,
            state="running" if running else "starting",
            created=now,
            started=now if running else None,
            backend=backend,
            lease_expires=now + timedelta(seconds=lease_seconds) if leased else None,
            gpu_count=count,
            borrowed=borrowed,
            backfill_for=borrowing.backfill_text(backfill_for),
        )
        conn = connection(s)
        aid = conn.execute(NEW_ALLOCATION, row).scalar_one()
        gpus = tuple(sorted(chosen))
        if gpus:
            links = [{"allocation_id": aid, "gpu_id": ids[(g.node, g.index)], "held": True} for g in gpus]
            conn.execute(NEW_LINKS, links)
            s.info.setdefault(CHANGES, []).extend((link["gpu_id"], True) for link in links)
        return AllocationInfo(
            id=aid,
            user=user,
            purpose=purpose,
            server_name=server_name,
            state=row["state"],
            created=now,
            started=row["started"],
            ended=None,
            backend=backend,
            backend_job_id=None,
            end_reason=None,
            gpus=gpus,
            lease_expires=row["lease_expires"],
            gpu_count=max(count, len(gpus)),
            borrowed=borrowed,
            backfill=row["backfill_for"] is not None,
        )

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
        self, allocation_id: int, gpus: Iterable[tuple[str, int]], backend_job_id: str | None = None
    ) -> tuple[AllocationInfo, list[int]]:
        """Write the GPUs a scheduler gave a deferred allocation, and mark it running.

        The scheduler is the authority on its own GPUs: if another live allocation of the
        same backend still holds one of them, that allocation's job has ended and its end
        was not seen yet, so it is released here (its id is returned) rather than the
        GPU being double-booked. Unknown GPUs raise ``LookupError`` (sync the inventory); more
        GPUs than were admitted raise ``ValueError`` (the job is over the user's limit).
        """
        wanted = sorted(set(gpus))
        with self._tx() as s:
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                raise LookupError(f"allocation {allocation_id} is not active")
            if len(wanted) > _count(a):
                raise ValueError(
                    f"allocation {a.id} was admitted for {_count(a)} GPUs; the job shows {len(wanted)}"
                )
            by_key = {
                (g.node.name, g.index): g for g in s.scalars(select(Gpu).options(selectinload(Gpu.node)))
            }
            missing = [f"{n}:{i}" for n, i in wanted if (n, i) not in by_key]
            if missing:
                raise LookupError(f"GPUs {', '.join(missing)} are not in the ledger's inventory")
            ids = {by_key[k].id for k in wanted}
            released = []
            for other in self._active(s):
                if other.id == a.id or not ids & {ag.gpu_id for ag in other.gpus if ag.held}:
                    continue
                if other.backend != a.backend:
                    raise RuntimeError(
                        f"GPUs {', '.join(f'{n}:{i}' for n, i in wanted)} are held by allocation "
                        f"{other.id} of backend {other.backend!r}: two backends share these GPUs"
                    )
                self._end(other, f"its {other.backend} job ended (GPUs given to job {backend_job_id})")
                released.append(other.id)
            s.flush()
            current = {ag.gpu_id for ag in a.gpus if ag.held}
            if current and current != ids:
                raise RuntimeError(f"allocation {a.id} already holds other GPUs")
            if not current:
                a.gpus = [AllocationGpu(gpu=by_key[k], held=True) for k in wanted]
            a.state = "running"
            a.started = a.started or self.clock()
            if backend_job_id is not None:
                a.backend_job_id = str(backend_job_id)
            s.flush()
            return _info(a), released

    def release(self, allocation_id: int, reason: str = "released") -> bool:
        """Give the GPUs back. Idempotent: False when it was already released or unknown."""
        return self._write(lambda s: self._release_in(s, allocation_id, reason))

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
            self._expire(s)
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                raise LookupError(f"allocation {allocation_id} is not active")
            if a.lease_expires is None:
                raise ValueError(f"allocation {allocation_id} has no lease to renew")
            reclaimed = self._reclaim_reason(s, a.id)
            if reclaimed and not self._undo_if_used(s, a.id, active_at):
                raise LookupError(f"allocation {allocation_id} was {reclaimed}")
            now = self.clock()
            preempted = self._preempt_reason(s, a.id, now)
            if preempted:  # due, but only for a request that still waits
                self._end_stale(s, now)
                self._withdraw_unwanted(s, now)
                preempted = self._preempt_reason(s, a.id, now)
            if preempted:  # due: its kernel must stop the engines and release it
                raise LookupError(f"allocation {allocation_id} was {preempted}")
            a.lease_expires = self.clock() + timedelta(seconds=lease_seconds)
            return _info(a)

    def _expire(self, s: Session) -> list[int]:
        now = self.clock()
        if not s.info.pop("leases_due", True):  # none was due when the transaction began
            return []  # (read with the lock row): the usual answer, without loading anything
        expired = list(s.scalars(select(Allocation).where(is_live(), Allocation.lease_expires <= now)))
        for a in expired:
            # usage counts up to the end of the lease, not up to when someone noticed
            taken = self._reclaim_reason(s, a.id) or self._preempt_reason(s, a.id, now)
            self._end(a, taken or "lease expired", when=a.lease_expires)
        return [a.id for a in expired]

    def expire_leases(self) -> list[int]:
        """Release every allocation whose lease ran out; returns their ids."""
        with self._tx() as s:
            return self._expire(s)

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
