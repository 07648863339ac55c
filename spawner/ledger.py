"""The GPU ledger: the single source of truth for who holds which GPU.

Every method is one short transaction. Admission (``allocate``) reads what exists, what is
free and what the user holds, asks :mod:`spawner.policy`, and writes the answer, all under
the database's write lock (``BEGIN IMMEDIATE`` on SQLite, the ``ledger_lock`` row
elsewhere), so several processes can allocate against one database without exceeding a
limit; the partial unique index on held GPUs makes double-booking impossible even if
that lock were bypassed.

Limits come from two places: the ``c.GpuHub.*_limit(s)`` traits and the rows an admin
writes with ``gpuhub limits set``. A row in the database wins over the trait for the same
key (default, one group, one user); ``gpuhub limits unset`` returns that key to the trait.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from . import policy
from .db import ensure_schema, make_engine, make_session_factory
from .models import (
    ACTIVE_STATES,
    PURPOSES,
    SCOPES,
    Allocation,
    AllocationGpu,
    Gpu,
    KnownUser,
    LedgerLock,
    LimitRow,
    Node,
)
from .reclaims import ReclaimRecords

log = logging.getLogger("gpuhub.ledger")


def utcnow() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


@dataclass(frozen=True)
class AllocationInfo:
    id: int
    user: str
    purpose: str
    server_name: str
    state: str
    created: datetime
    started: datetime | None
    ended: datetime | None
    backend: str
    backend_job_id: str | None
    end_reason: str | None
    gpus: tuple[policy.Gpu, ...]
    lease_expires: datetime | None = None
    gpu_count: int = 0  # GPUs asked for (a queued Slurm job holds its count, not yet GPUs)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({g.node for g in self.gpus}))

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g.index) for g in self.gpus)


@dataclass(frozen=True)
class Allowance:
    """What a user holds, may take, and what is free: the facts behind the spawn form."""

    effective: policy.EffectiveLimit
    held: int
    gpu_hours: float
    may_take: int | None  # more GPUs the limit allows; None = unlimited
    total: int
    free: int
    free_by_model: dict[str, int] = field(default_factory=dict)
    fits: int = 0  # what one request on one server could get now


@dataclass(frozen=True)
class GpuStatus:
    gpu: policy.Gpu
    present: bool
    holder: AllocationInfo | None


@dataclass(frozen=True)
class LimitEntry:
    scope: str
    name: str
    limit: policy.Limit
    origin: str  # "config" or "ledger"


def _info(a: Allocation) -> AllocationInfo:
    gpus = tuple(sorted(_gpu(ag.gpu) for ag in a.gpus))
    return AllocationInfo(
        id=a.id,
        user=a.user,
        purpose=a.purpose,
        server_name=a.server_name,
        state=a.state,
        created=a.created,
        started=a.started,
        ended=a.ended,
        backend=a.backend,
        backend_job_id=a.backend_job_id,
        end_reason=a.end_reason,
        gpus=gpus,
        lease_expires=a.lease_expires,
        gpu_count=_count(a),
    )


def _count(a: Allocation) -> int:
    return max(a.gpu_count or 0, len(a.gpus))


def _gpu(g: Gpu) -> policy.Gpu:
    return policy.Gpu(g.node.name, g.index, g.model, g.memory_mib, g.uuid)


def _row_limit(row: LimitRow) -> policy.Limit:
    return policy.Limit(
        max_gpus=row.max_gpus,
        gpu_hours=row.gpu_hours,
        window_hours=row.window_hours or policy.DEFAULT_WINDOW_HOURS,
    )


_WARNED: set[tuple] = set()


def _usable(row: LimitRow, limit: policy.Limit) -> bool:
    """Whether the policy can use a stored limit; a row it cannot (from an older version or a
    direct write: infinite, negative, NaN) is ignored for its key, with a warning once."""
    problem = policy.limit_problem(limit)
    if problem is None:
        return True
    key = (row.scope, row.name, problem)  # not the limit: NaN != NaN would warn on every read
    if key not in _WARNED:
        _WARNED.add(key)
        who = "the default" if row.scope == "default" else f"{row.scope} {row.name!r}"
        log.warning(
            "Ignoring the ledger's limit for %s: %s. Set it again with gpuhub limits set, "
            "or remove it with gpuhub limits unset.",
            who,
            problem,
        )
    return False


class Ledger(ReclaimRecords):
    """One ledger database. Safe to use from several processes at once."""

    def __init__(
        self,
        url: str,
        *,
        config_rules: policy.LimitRules | None = None,
        clock: Callable[[], datetime] = utcnow,
    ):
        self.url = url
        self.config_rules = config_rules or policy.LimitRules()
        self.clock = clock
        self.engine = make_engine(url)
        ensure_schema(self.engine, url)
        self._sessions = make_session_factory(self.engine)
        self._reader = make_engine(url, writer=False)
        self._read_sessions = make_session_factory(self._reader)
        with self._sessions.begin() as s:
            if s.get(LedgerLock, 1) is None:
                s.add(LedgerLock(id=1, generation=0))

    def close(self) -> None:
        self.engine.dispose()
        self._reader.dispose()

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """A writing transaction, holding the ledger's write lock."""
        with self._sessions.begin() as s:
            lock = s.execute(select(LedgerLock).where(LedgerLock.id == 1).with_for_update())
            lock.scalar_one()
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """A reading transaction: a consistent snapshot that blocks no writer."""
        with self._read_sessions.begin() as s:
            yield s

    # inventory ----------------------------------------------------------------------

    def sync_inventory(self, gpus: Iterable[policy.Gpu], nodes: Iterable[str] | None = None) -> None:
        """Make the ledger's GPUs of ``nodes`` match the inventory, keeping every allocation.

        ``nodes`` are the nodes this inventory speaks for (default: those it lists); GPUs of
        other nodes are left alone, so a process with a partial view cannot hide them. New
        GPUs are added, known ones updated, missing ones marked absent (never deleted: a
        live allocation or the usage history may still name them).
        """
        wanted = {(g.node, g.index): g for g in gpus}
        covered = set(nodes) if nodes is not None else {node for node, _ in wanted}
        with self._tx() as s:
            nodes = {n.name: n for n in s.scalars(select(Node))}
            seen = set()
            for row in s.scalars(select(Gpu).options(selectinload(Gpu.node))):
                key = (row.node.name, row.index)
                seen.add(key)
                if row.node.name not in covered:
                    continue
                g = wanted.get(key)
                row.present = g is not None
                if g is not None:
                    row.model, row.memory_mib, row.uuid = g.model, g.memory_mib, g.uuid
            for key, g in sorted(wanted.items()):
                if key in seen:
                    continue
                node = nodes.get(g.node)
                if node is None:
                    node = nodes[g.node] = Node(name=g.node)
                    s.add(node)
                s.add(
                    Gpu(
                        node=node,
                        index=g.index,
                        model=g.model,
                        memory_mib=g.memory_mib,
                        uuid=g.uuid,
                        present=True,
                    )
                )

    def _inventory(self, s: Session) -> list[policy.Gpu]:
        rows = s.scalars(select(Gpu).where(Gpu.present).options(selectinload(Gpu.node)))
        return sorted(_gpu(g) for g in rows)

    def _held_gpu_ids(self, s: Session) -> set[int]:
        return set(s.scalars(select(AllocationGpu.gpu_id).where(AllocationGpu.held)))

    def _free(self, s: Session) -> list[policy.Gpu]:
        held = self._held_gpu_ids(s)
        rows = s.scalars(select(Gpu).where(Gpu.present).options(selectinload(Gpu.node)))
        return sorted(_gpu(g) for g in rows if g.id not in held)

    # limits ---------------------------------------------------------------------------

    def _rules(self, s: Session) -> policy.LimitRules:
        base = self.config_rules
        default, groups, users = base.default, dict(base.groups), dict(base.users)
        for row in s.scalars(select(LimitRow)):
            limit = _row_limit(row)
            if not _usable(row, limit):
                continue  # the trait's (or no) rule for that key, rather than a 500
            if row.scope == "default":
                default = limit
            elif row.scope == "group":
                groups[row.name] = limit
            else:
                users[row.name] = limit
        return policy.LimitRules(default=default, groups=groups, users=users)

    def rules(self) -> policy.LimitRules:
        with self._read() as s:
            return self._rules(s)

    def note_user(self, user: str, groups: Iterable[str]) -> None:
        """Remember a user and their groups (spawners call this at each start)."""
        joined = ",".join(sorted(set(groups)))[:4000]
        with self._tx() as s:
            row = s.get(KnownUser, user)
            if row is None:
                s.add(KnownUser(name=user, groups=joined, updated=self.clock()))
            elif row.groups != joined:
                row.groups, row.updated = joined, self.clock()

    def effective_limits(self, users: Iterable[str] | None = None) -> dict[str, policy.EffectiveLimit]:
        """The effective limit of every known user (or of ``users``), with their last known groups."""
        with self._read() as s:
            rules = self._rules(s)
            rows = {r.name: r.groups for r in s.scalars(select(KnownUser))}
        names = sorted(rows) if users is None else sorted(set(users))
        return {
            u: policy.effective_limit(u, [g for g in rows.get(u, "").split(",") if g], rules) for u in names
        }

    def limit_entries(self) -> list[LimitEntry]:
        """Every limit in force with where it comes from (a ledger row hides the trait)."""
        with self._read() as s:
            rows = {(r.scope, r.name): r for r in s.scalars(select(LimitRow))}
        base = self.config_rules
        entries = {("default", ""): LimitEntry("default", "", base.default, "config")}
        entries |= {("group", k): LimitEntry("group", k, v, "config") for k, v in base.groups.items()}
        entries |= {("user", k): LimitEntry("user", k, v, "config") for k, v in base.users.items()}
        for key, row in rows.items():
            if _usable(row, _row_limit(row)):
                entries[key] = LimitEntry(row.scope, row.name, _row_limit(row), "ledger")
        order = {scope: i for i, scope in enumerate(SCOPES)}
        return sorted(entries.values(), key=lambda e: (order[e.scope], e.name))

    def ignored_limits(self) -> list[tuple[str, str, str]]:
        """Ledger rows the policy cannot use, as ``(scope, name, problem)``: ignored for their key."""
        with self._read() as s:
            rows = list(s.scalars(select(LimitRow)))
        found = [(r.scope, r.name, policy.limit_problem(_row_limit(r))) for r in rows]
        return sorted((scope, name, p) for scope, name, p in found if p)

    def set_limit(self, scope: str, name: str, limit: policy.Limit) -> None:
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {', '.join(SCOPES)}; got {scope!r}")
        if scope == "default":
            name = ""
        elif not name:
            raise ValueError(f"a {scope} limit needs the {scope}'s name")
        problem = policy.limit_problem(limit)
        if problem:
            raise ValueError(problem)
        with self._tx() as s:
            row = s.scalars(
                select(LimitRow).where(LimitRow.scope == scope, LimitRow.name == name)
            ).one_or_none()
            if row is None:
                row = LimitRow(scope=scope, name=name)
                s.add(row)
            row.max_gpus = limit.max_gpus
            row.gpu_hours = limit.gpu_hours
            row.window_hours = limit.window_hours
            row.updated = self.clock()

    def unset_limit(self, scope: str, name: str = "") -> bool:
        with self._tx() as s:
            row = s.scalars(
                select(LimitRow).where(
                    LimitRow.scope == scope, LimitRow.name == ("" if scope == "default" else name)
                )
            ).one_or_none()
            if row is None:
                return False
            s.delete(row)
            return True

    # holdings ------------------------------------------------------------------------

    def _active(self, s: Session, **where) -> list[Allocation]:
        q = (
            select(Allocation)
            .where(Allocation.state.in_(ACTIVE_STATES))
            .options(selectinload(Allocation.gpus).selectinload(AllocationGpu.gpu).selectinload(Gpu.node))
            .order_by(Allocation.id)
        )
        for key, value in where.items():
            q = q.where(getattr(Allocation, key) == value)
        return list(s.scalars(q))

    def _holdings(self, s: Session, user: str, limit: policy.Limit) -> policy.Holdings:
        held = sum(_count(a) for a in self._active(s, user=user))
        hours = 0.0
        if limit.gpu_hours is not None:
            hours = policy.gpu_hours_used(self._intervals(s, user=user), self.clock(), limit.window_hours)
        return policy.Holdings(held=held, gpu_hours=hours)

    def _intervals(self, s: Session, user: str | None = None):
        q = select(Allocation).options(selectinload(Allocation.gpus))
        if user is not None:
            q = q.where(Allocation.user == user)
        for a in s.scalars(q):
            start = a.started or a.created
            yield start, a.ended, len(a.gpus)

    def allowance(self, user: str, groups: Iterable[str] = (), model: str | None = None) -> Allowance:
        with self._read() as s:
            eff = policy.effective_limit(user, groups, self._rules(s))
            holdings = self._holdings(s, user, eff.limit)
            inventory, free = self._inventory(s), self._free(s)
        room = policy.remaining(eff, holdings)
        free_now = policy.largest_placeable(free, model, 1)
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
        )

    def models(self) -> list[str]:
        with self._read() as s:
            return sorted({g.model for g in self._inventory(s)})

    # allocations -----------------------------------------------------------------------

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
        """Admit and record a request, or raise :class:`policy.Refusal` leaving nothing behind.

        With ``lease_seconds`` the allocation is running at once and lives until its lease
        runs out unless renewed (a burst for ``%%distributed``); expired leases are released
        before any admission, so they never block one. ``on_nodes`` restricts the placement
        (a local server must land on this machine's GPUs).

        ``deferred``: the backend's scheduler picks the GPUs (Slurm). The request is checked
        against the user's limit and against what the nodes could ever hold, but not against
        what is free now (the job queues); it holds its count until :meth:`record_gpus`
        writes the GPUs the scheduler gave it.
        """
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}; got {purpose!r}")
        request = policy.Request(user, count, model, max_nodes, gpus_per_node)
        with self._tx() as s:
            self._expire(s)
            eff = policy.effective_limit(user, groups, self._rules(s))
            inventory, free = self._inventory(s), self._free(s)
            if on_nodes is not None:
                allowed = set(on_nodes)
                inventory = [g for g in inventory if g.node in allowed]
                free = [g for g in free if g.node in allowed]
            if deferred:
                free = inventory  # it may wait for GPUs, never beyond the limit
            policy.check_request(request, eff, self._holdings(s, user, eff.limit), inventory, free)
            if count == 0:
                raise policy.Refusal("An allocation needs at least 1 GPU.", reason="bad_request", fits=None)
            if deferred and policy.place(request, inventory, inventory) is None:
                raise policy.Refusal(
                    f"{count} GPUs cannot be split as asked ({gpus_per_node or 'any'} per node, at most "
                    f"{max_nodes or 'any'} nodes) on these nodes, even when all are free; "
                    "ask for another split.",
                    reason="too_large",
                )
            chosen = () if deferred else policy.place(request, free, inventory)
            if chosen is None:
                raise policy.Refusal(
                    f"{count} GPUs cannot be placed as asked right now "
                    f"({gpus_per_node or 'any'} per node, at most {max_nodes or 'any'} nodes); "
                    "try another split or try again later.",
                    reason="no_capacity",
                )
            by_key = {
                (g.node.name, g.index): g
                for g in s.scalars(select(Gpu).where(Gpu.present).options(selectinload(Gpu.node)))
            }
            now = self.clock()
            alloc = Allocation(
                user=user,
                purpose=purpose,
                server_name=server_name,
                state="starting" if lease_seconds is None else "running",
                created=now,
                started=None if lease_seconds is None else now,
                backend=backend,
                lease_expires=None if lease_seconds is None else now + timedelta(seconds=lease_seconds),
                gpu_count=count,
            )
            if deferred:
                alloc.state, alloc.started = "starting", None
            alloc.gpus = [AllocationGpu(gpu=by_key[(g.node, g.index)], held=True) for g in chosen]
            s.add(alloc)
            s.flush()
            return _info(alloc)

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
                    Allocation.state.in_(ACTIVE_STATES),
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
        with self._tx() as s:
            a = s.get(Allocation, allocation_id)
            if a is None or a.state not in ACTIVE_STATES:
                return False
            self._end(a, self._reclaim_reason(s, a.id) or reason)
            return True

    def _end(self, a: Allocation, reason: str, when: datetime | None = None) -> None:
        a.state = "released"
        a.ended = when or self.clock()
        a.end_reason = reason[:255]
        for ag in a.gpus:
            ag.held = False

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
            a.lease_expires = self.clock() + timedelta(seconds=lease_seconds)
            return _info(a)

    def _expire(self, s: Session) -> list[int]:
        now = self.clock()
        expired = list(
            s.scalars(
                select(Allocation).where(Allocation.state.in_(ACTIVE_STATES), Allocation.lease_expires <= now)
            )
        )
        for a in expired:
            # usage counts up to the end of the lease, not up to when someone noticed
            self._end(a, self._reclaim_reason(s, a.id) or "lease expired", when=a.lease_expires)
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
            return [_info(a) for a in self._active(s, **where)]

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

    def gpu_table(self) -> list[GpuStatus]:
        with self._read() as s:
            holders: dict[int, AllocationInfo] = {}
            for a in self._active(s):
                info = _info(a)
                for ag in a.gpus:
                    holders[ag.gpu_id] = info
            rows = s.scalars(select(Gpu).options(selectinload(Gpu.node)))
            return sorted(
                (GpuStatus(_gpu(g), g.present, holders.get(g.id)) for g in rows),
                key=lambda st: st.gpu,
            )

    def usage_series(
        self, since: datetime, until: datetime, bucket_hours: float = 24.0, user: str | None = None
    ) -> tuple[list[datetime], dict[str, list[float]]]:
        """GPU-hours per user in consecutive buckets from ``since`` to ``until`` (for plots)."""
        step = timedelta(hours=bucket_hours)
        starts = []
        t = since
        while t < until:
            starts.append(t)
            t += step
        out: dict[str, list[float]] = {}
        with self._read() as s:
            users = sorted(set(s.scalars(select(Allocation.user).distinct())))
            for name in users if user is None else [user]:
                intervals = list(self._intervals(s, user=name))
                out[name] = [  # the last bucket may be partial: count only up to ``until``
                    policy.gpu_hours_used(
                        intervals, min(b + step, until), (min(b + step, until) - b).total_seconds() / 3600.0
                    )
                    for b in starts
                ]
        return starts, out

    def usage(
        self, since: datetime, until: datetime | None = None, user: str | None = None
    ) -> dict[str, float]:
        """GPU-hours per user between ``since`` and ``until`` (default: now)."""
        until = until or self.clock()
        window_hours = (until - since).total_seconds() / 3600.0
        out: dict[str, float] = {}
        with self._read() as s:
            users = sorted(set(s.scalars(select(Allocation.user).distinct())))
            for name in users if user is None else [user]:
                out[name] = policy.gpu_hours_used(self._intervals(s, user=name), until, window_hours)
        return out
