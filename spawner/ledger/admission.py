"""Admission: the one path by which a request becomes an allocation or a place in the queue
(a part of :class:`spawner.ledger.Ledger`).

:meth:`~AdmissionRecords.allocate` and :meth:`~AdmissionRecords.request` build one
:class:`~spawner.policy.records.AllocationRequest` and hand it down: ``_admit`` checks its
form, ``_admit_in`` decides in the writing transaction (the limit, what could ever fit, a
deferred booking, borrowing beyond the limit: ``BorrowingRecords.borrow_now_in``), and
``_admit_or_queue`` books it where the queue's plan starts it now, or queues it, or refuses it
with the queue named. :meth:`~AdmissionRecords.grant_in` books a queue entry whose turn has come
(``QueueAsking.wait_turn``); :meth:`~AdmissionRecords.book_in` writes every allocation made.
The decisions are :mod:`spawner.policy`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime, timedelta
from fractions import Fraction

from sqlalchemy import bindparam, insert, or_, select
from sqlalchemy.orm import Session

from gpu_magics.common import words
from spawner import policy
from spawner.ledger.db import connection
from spawner.ledger.freeset import CHANGES
from spawner.ledger.models import PURPOSES, Allocation, AllocationGpu, QueueEntry, is_live
from spawner.ledger.queue import NEW
from spawner.ledger.queue import entry_info as _entry_info
from spawner.ledger.transactions import gpus_of
from spawner.ledger.usage import INTERVAL_COLUMNS, usage_interval
from spawner.policy import borrowing, fairshare, slices, timelimits
from spawner.policy import schedule as queueplan
from spawner.policy.records import ACTIVE_STATES, Admission, AllocationInfo, AllocationRequest, Allowance

_A, _AG = Allocation.__table__, AllocationGpu.__table__
NEW_ALLOCATION = insert(_A).returning(_A.c.id)
NEW_LINKS = insert(_AG)
LIVE_COUNTS = select(_A.c.gpu_count, gpus_of(_A.c.id), _A.c.borrowed, _A.c.slice_parts).where(
    _A.c.user == bindparam("user"), is_live(_A.c.state)
)
WINDOW_ROWS = select(_A.c.state, _A.c.gpu_count, *INTERVAL_COLUMNS).where(
    _A.c.user == bindparam("user"), or_(_A.c.ended.is_(None), _A.c.ended >= bindparam("since"))
)


def request_of(arguments: dict, **more) -> AllocationRequest:
    """The request that ``allocate``'s or ``request``'s arguments (their ``locals()``) and
    ``more`` make: built once, at the door."""
    fields = {k: v for k, v in arguments.items() if k != "self"} | more
    fields["groups"] = tuple(fields["groups"])
    if fields["on_nodes"] is not None:
        fields["on_nodes"] = frozenset(fields["on_nodes"])
    return AllocationRequest(**fields)


def placement_request(req: AllocationRequest) -> policy.Request:
    """What the placement and the limit checks see of a request: whose, how many, what shape."""
    return policy.Request(req.user, req.count, req.model, req.max_nodes, req.gpus_per_node)


def entry_request(e: QueueEntry) -> AllocationRequest:
    """The request a queue entry was made for (what its grant books)."""
    return AllocationRequest(
        user=e.user,
        groups=(),
        count=e.gpu_count,
        model=e.model,
        slice_parts=e.slice_parts,
        purpose=e.purpose,
        server_name=e.server_name,
        backend=e.backend,
        lease_seconds=e.lease_seconds,
        of_server=bool(e.of_server),
        time_limit_seconds=e.time_limit_seconds,
    )


def check_limit_with_waiting(asked: Fraction, eff, held: Fraction, waiting: Fraction) -> None:
    """Refuse a request for ``asked`` GPUs (a slice: its share) that, with the GPUs its user
    already waits for, passes the limit."""
    room = policy.remaining(eff, policy.Holdings(held=held + waiting))
    if waiting and room is not None and asked > room:
        raise policy.Refusal(
            f"You asked for {slices.units_text(asked)}, but you hold {slices.plain(held)} and already "
            f"wait for {slices.plain(waiting)} of {policy.describe_limit(eff)}. Leave the other wait, "
            f"or ask for {slices.plain(room)} or fewer.",
            reason="over_limit",
            fits=int(room),
        )


class AdmissionRecords:
    """What a user holds and may take; allocate, request, and the bookings of both.

    Uses ``_read``/``_write`` (``LedgerBase``, ``CombinedWrites``), ``_rules`` (``LimitRecords``),
    ``_inventory``/``_free``/``_present`` (``GpuRecords``), ``_active`` (``LedgerBase``),
    ``expire_in`` (``AllocationRecords``), ``borrow_allowance``/``borrowed_part_in``/``borrow_now_in``
    (``BorrowingRecords``), ``live_waiting_in``/``scene_in`` (``QueueRecords``)."""

    def holdings_in(self, s: Session, user: str, limit: policy.Limit) -> policy.Holdings:
        """What counts against the limit: GPUs held, less those borrowed beyond it (they have an
        allowance of their own: ``borrowed_part_in``), and the GPU-hours of the window."""
        conn = connection(s)
        if limit.gpu_hours is None:
            held = sum(
                Fraction(max(count or 0, n) - (borrowed or 0), parts or 1)
                for count, n, borrowed, parts in conn.execute(LIVE_COUNTS, {"user": user})
            )
            return policy.Holdings(held=slices.plain(held), gpu_hours=0.0)
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
                *_, borrowed, n, parts = row
                held += Fraction(max(count or 0, n) - (borrowed or 0), parts or 1)
            intervals.append(interval)
        hours = policy.gpu_hours_used(intervals, now, limit.window_hours)
        return policy.Holdings(held=slices.plain(held), gpu_hours=hours)

    def allowance(self, user: str, groups: Iterable[str] = (), model: str | None = None) -> Allowance:
        groups = list(groups)
        with self._read() as s:
            eff = policy.effective_limit(user, groups, self._rules(s))
            holdings = self.holdings_in(s, user, eff.limit)
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
        if room is not None:  # whole GPUs: a part of one left by slices held is no room for one
            room = int(room)
        free_now = policy.largest_placeable(free, model, 1)
        allowance = borrowing.usable_allowance(eff.limit.max_gpus, self.borrow_allowance(user, groups)[0])
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
        of_server: bool = False,
        hours: float | None = None,
        slice_parts: int | None = None,
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

        ``slice_parts``: one slice of a ``model`` GPU split in that many parts, as
        ``c.GpuHub.gpu_slices`` offers (``spawner/ledger/slices.py``); ``count`` is then 1.
        """
        got = self._admit(request_of(locals(), wait=False))
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
        of_server: bool = False,
        hours: float | None = None,
        slice_parts: int | None = None,
    ) -> Admission:
        """Like :meth:`allocate`, but a request that fits the limit and not the free GPUs
        joins the queue (``Admission.entry``; its waiter then calls :meth:`wait_turn`).
        Only what can never fit is refused."""
        return self._admit(request_of(locals(), deferred=False, wait=True))

    def _admit(self, req: AllocationRequest) -> Admission:
        """Check the request's form, then decide and write it in a writing transaction
        (``_admit_in``)."""
        if req.purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}; got {req.purpose!r}")
        return self._write(lambda s: self._admit_in(s, req))

    def _admit_in(self, s: Session, req: AllocationRequest) -> Admission:
        """``_admit``'s decision and write, in the writing transaction ``s``."""
        self.expire_in(s)
        # how long it may run: its own ask, never beyond the user's longest session (refused at once)
        longest, source = timelimits.max_hours(req.user, req.groups, self.time_rules)
        req = replace(req, time_limit_seconds=timelimits.session_seconds(req.hours, longest, source))
        asked = placement_request(req)
        if not req.slice_parts and req.count:
            self.check_whole_in(req)
        eff = policy.effective_limit(req.user, req.groups, self._rules(s))
        inventory, free = self._inventory(s), self._free(s)
        if req.on_nodes is not None:
            inventory = policy.GpuSet.ordered(g for g in inventory if g.node in req.on_nodes)
            free = policy.GpuSet.ordered(g for g in free if g.node in req.on_nodes)
        holdings = self.holdings_in(s, req.user, eff.limit)
        if req.slice_parts:  # one slice: never borrowed beyond the limit, never split over nodes
            if req.purpose != "server" or req.lease_seconds is not None:
                raise policy.Refusal(
                    "A slice of a GPU is for a notebook server; %%distributed pools run on whole GPUs "
                    "(NCCL needs them).",
                    reason="bad_request",
                )
            self.check_slice_in(s, req, eff, holdings)
            if req.deferred:  # Slurm's gres/shard: record_gpus writes the part its job gets
                return Admission(allocation=self.book_in(s, req, ()))
            return self._admit_or_queue(s, req, asked, eff, holdings.held, inventory, free)
        borrowed = self.borrowed_part_in(s, req.user, req.groups, eff, holdings, req.count)
        # what the limit leaves of whole GPUs (a part of one held in slices is no room for one)
        within = int(max(0, (eff.limit.max_gpus or 0) - holdings.held))
        if borrowed:  # beyond the limit, within the allowance: the limit check counts it
            limit = replace(eff.limit, max_gpus=eff.limit.max_gpus + borrowed)
            eff = policy.EffectiveLimit(limit, eff.source)
        # the limit and what could ever fit; capacity is the queue's (or the scheduler's)
        policy.check_request(asked, eff, holdings, inventory, inventory)
        if req.count == 0:
            raise policy.Refusal("An allocation needs at least 1 GPU.", reason="bad_request", fits=None)
        spent = self.budget_refusal_in(s, req.user, req.groups)
        if spent:
            raise policy.Refusal(spent, reason="energy_budget_spent", fits=0)
        if policy.place(asked, inventory, inventory) is None:
            raise policy.Refusal(
                f"{req.count} GPUs cannot be split as asked ({req.gpus_per_node or 'any'} per node, "
                f"at most {req.max_nodes or 'any'} nodes) on these nodes, even when all are free; "
                "ask for another split.",
                reason="too_large",
            )
        if req.deferred:
            return Admission(allocation=self.book_in(s, req, (), borrowed=borrowed))
        if borrowed:
            return self.borrow_now_in(s, req, asked, free, inventory, borrowed=borrowed, within=within)
        return self._admit_or_queue(s, req, asked, eff, holdings.held, inventory, free)

    def _admit_or_queue(
        self,
        s: Session,
        req: AllocationRequest,
        asked: policy.Request,
        eff: policy.EffectiveLimit,
        held: int,
        inventory: list[policy.Gpu],
        free: list[policy.Gpu],
    ) -> Admission:
        """After the limit and feasibility checks: book now if the queue's plan starts this
        request now, else queue it (``req.wait``) or refuse it with the queue named."""
        now = self.clock()
        live = self.live_waiting_in(s, now)[1]
        adopt = None
        if req.purpose == "server":  # this server's own entry (started again): it keeps its place
            mine = (req.user, "server", req.server_name, req.backend)
            adopt = next(
                (
                    e
                    for e in sorted(live, key=lambda e: e.id)
                    if (e.user, e.purpose, e.server_name, e.backend) == mine
                ),
                None,
            )
        mine = [e for e in live if e.user == req.user and e is not adopt]
        waiting = sum((Fraction(e.gpu_count, e.slice_parts or 1) for e in mine), Fraction(0))
        check_limit_with_waiting(req.units, eff, held, waiting)
        nodes = req.on_nodes
        if not live:
            # the plan of a queue holding only this request grants what fits the free GPUs now
            # (queueplan.plan: nothing waits to be protected); only the rest needs the scene
            gpus = self.place_now_in(s, req, asked, free, inventory)
            if gpus is not None:
                return Admission(allocation=self.book_in(s, req, gpus, now=now))
        created = adopt.created if adopt is not None else now
        front = adopt.front if adopt is not None else None
        if adopt is not None:  # it stands where the entry stood; the plan sees it as new
            adopt.state = "left"
        # the plan sees the new request as one more waiting entry (the scene fills in its run length,
        # never past its time limit)
        cand = fairshare.Candidate(NEW, req.user, created, front)
        new = queueplan.Waiting(NEW, asked, 0.0, nodes, req.slice_parts)
        scene = self.scene_in(s, now, (cand, new), req.groups, req.time_limit_seconds)
        if adopt is not None:
            adopt.state = "waiting"
        gpus = scene.plan.grants.get(NEW)
        if gpus is not None:
            ahead = scene.plan.ahead_of.get(NEW, ())
            booked = self.book_in(s, req, gpus, now=now, backfill_for=ahead)
            if adopt is not None:  # the start again that kept its place: granted, as any turn
                adopt.state, adopt.ended, adopt.allocation_id = "granted", now, booked.id
                adopt.end_reason = f"started after {(now - adopt.created).total_seconds():.0f} s"
            return Admission(allocation=booked)
        if not req.wait:
            ahead = scene.plan.position(scene.order, NEW)[0] - 1
            if not req.slice_parts:
                policy.check_request(asked, eff, policy.Holdings(held=held), inventory, free)
            if ahead == 0:
                raise policy.Refusal(
                    f"{req.count} GPUs cannot be placed as asked right now "
                    f"({req.gpus_per_node or 'any'} per node, at most {req.max_nodes or 'any'} "
                    "nodes); try another split or try again later.",
                    reason="no_capacity",
                )
            raise policy.Refusal(
                f"{words.count(ahead, 'request')} {'waits' if ahead == 1 else 'wait'} for GPUs ahead "
                "of yours (a fair-share queue); "
                "ask again with waiting allowed to take your place in it.",
                reason="no_capacity",
                fits=0,
            )
        e = adopt or QueueEntry(created=now, state="waiting")
        e.user, e.groups = req.user, ",".join(sorted(set(req.groups)))[:4000]
        e.purpose, e.server_name, e.backend = req.purpose, req.server_name, req.backend
        e.gpu_count, e.model = req.count, req.model
        e.max_nodes, e.gpus_per_node = req.max_nodes, req.gpus_per_node
        e.on_nodes = None if nodes is None else ",".join(sorted(nodes))[:4000]
        e.lease_seconds, e.seen, e.of_server = req.lease_seconds, now, req.of_server
        e.time_limit_seconds, e.slice_parts = req.time_limit_seconds, req.slice_parts
        if adopt is None:
            s.add(e)
            s.info["queued"] = True  # someone waits now (the next write of a combined turn reads it)
        s.flush()
        # the entry's id replaces NEW in the same scene: its place is the plan's
        scene.order = [e.id if i == NEW else i for i in scene.order]
        scene.plan.expected[e.id] = scene.plan.expected.pop(NEW)
        if NEW in scene.factors:
            scene.factors[e.id] = scene.factors.pop(NEW)
        return Admission(entry=scene.info(_entry_info(e)))

    def grant_in(self, s: Session, e: QueueEntry, gpus, now: datetime, ahead_of=()) -> AllocationInfo:
        """Book the GPUs of a queue entry whose turn has come, and mark it granted."""
        booked = self.book_in(s, entry_request(e), gpus, now=now, backfill_for=ahead_of)
        e.state, e.ended, e.allocation_id = "granted", now, booked.id
        e.end_reason = f"started after {(now - e.created).total_seconds():.0f} s"
        return booked

    def book_in(
        self,
        s: Session,
        req: AllocationRequest,
        chosen: Iterable[policy.Gpu],
        *,
        now: datetime | None = None,
        borrowed: int = 0,
        backfill_for: Iterable[int] = (),
    ) -> AllocationInfo:
        """Write an allocation of ``req`` holding ``chosen`` (checked by the caller, in this
        transaction) and return its record. ``now``: the moment the caller decided at (the
        queue's plan), recorded as its creation. Two statements (the row, its GPUs), not the
        ORM's flush."""
        if s.new or s.dirty or s.deleted:
            s.flush()  # the ORM's changes first: a GPU that an ended allocation gave back
        ids = self._present(s).id_of
        now = now or self.clock()
        leased = req.lease_seconds is not None
        running = leased and not req.deferred
        row = dict(
            user=req.user,
            purpose=req.purpose,
            server_name=req.server_name,
            state="running" if running else "starting",
            created=now,
            started=now if running else None,
            backend=req.backend,
            lease_expires=now + timedelta(seconds=req.lease_seconds) if leased else None,
            gpu_count=req.count,
            borrowed=borrowed,
            backfill_for=borrowing.backfill_text(backfill_for),
            of_server=req.of_server,
            time_limit_seconds=req.time_limit_seconds,
            slice_parts=req.slice_parts,
        )
        conn = connection(s)
        aid = conn.execute(NEW_ALLOCATION, row).scalar_one()
        gpus = tuple(sorted(chosen))
        if gpus:
            links = [
                dict(allocation_id=aid, gpu_id=ids[(g.node, g.index)], held=True, part=g.part, parts=g.parts)
                for g in gpus
            ]
            conn.execute(NEW_LINKS, links)
            s.info.setdefault(CHANGES, []).extend((x["gpu_id"], True, x["part"], x["parts"]) for x in links)
        return AllocationInfo(
            id=aid,
            user=req.user,
            purpose=req.purpose,
            server_name=req.server_name,
            state=row["state"],
            created=now,
            started=row["started"],
            ended=None,
            backend=req.backend,
            backend_job_id=None,
            end_reason=None,
            gpus=gpus,
            lease_expires=row["lease_expires"],
            gpu_count=max(req.count, len(gpus)),
            borrowed=borrowed,
            backfill=row["backfill_for"] is not None,
            of_server=req.of_server,
            time_limit_seconds=req.time_limit_seconds,
            slice_parts=req.slice_parts,
        )
