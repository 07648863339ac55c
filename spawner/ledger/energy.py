"""Energy per allocation and day (a part of :class:`spawner.ledger.Ledger`): written by the
broker from gpuhub's own readings (:mod:`spawner.policy.energy`), read by the pages, the API,
the CLI, the metrics and the budgets."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import date, datetime, timedelta

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from spawner.ledger.db import connection
from spawner.ledger.models import Allocation, EnergyUse, is_live
from spawner.policy import budgets
from spawner.policy.energy import Energy, Share

_E = EnergyUse.__table__
_SUMS = (
    func.sum(_E.c.joules),
    func.sum(_E.c.idle_joules),
    func.sum(_E.c.measured_seconds),
    func.sum(_E.c.unknown_seconds),
    func.sum(_E.c.idle_seconds),
)


def _energy(row) -> Energy:
    return Energy(*(float(v or 0.0) for v in row))


def days(since: datetime, until: datetime) -> tuple[date, date]:
    """The UTC days a period touches, first and last (energy is kept per day)."""
    return since.date(), (until - timedelta(microseconds=1)).date()


class EnergyRecords:
    """Uses ``_tx``/``_read``, ``clock``, ``costing`` and ``budgets`` (``LedgerBase``)."""

    def add_energy(self, shares: Iterable[Share]) -> int:
        """Add ``shares`` to their allocation's days; returns how many rows changed. Shares of
        allocations the ledger does not know are dropped."""
        shares = list(shares)
        if not shares:
            return 0
        with self._tx() as s:
            ids = {sh.allocation_id for sh in shares}
            owners = {
                i: (u, p)
                for i, u, p in s.execute(
                    select(Allocation.id, Allocation.user, Allocation.purpose).where(Allocation.id.in_(ids))
                )
            }
            rows = {
                (r.allocation_id, r.day): r
                for r in s.scalars(
                    select(EnergyUse).where(
                        EnergyUse.allocation_id.in_(ids), EnergyUse.day.in_({sh.day for sh in shares})
                    )
                )
            }
            changed = 0
            for sh in shares:
                if sh.allocation_id not in owners:
                    continue
                row = rows.get((sh.allocation_id, sh.day))
                if row is None:
                    user, purpose = owners[sh.allocation_id]
                    row = EnergyUse(
                        allocation_id=sh.allocation_id,
                        user=user,
                        purpose=purpose,
                        day=sh.day,
                        joules=0.0,
                        idle_joules=0.0,
                        measured_seconds=0.0,
                        unknown_seconds=0.0,
                        idle_seconds=0.0,
                    )
                    s.add(row)
                    rows[(sh.allocation_id, sh.day)] = row
                row.joules += sh.joules
                row.idle_joules += sh.idle_joules
                row.measured_seconds += sh.measured_seconds
                row.unknown_seconds += sh.unknown_seconds
                row.idle_seconds += sh.idle_seconds
                changed += 1
        return changed

    def energy_in(self, s: Session, user: str, since: datetime, until: datetime) -> Energy:
        """``user``'s energy on the days from ``since`` to ``until`` (inside a transaction)."""
        first, last = days(since, until)
        q = select(*_SUMS).where(_E.c.user == user, _E.c.day >= first, _E.c.day <= last)
        return _energy(connection(s).execute(q).one())

    def budget_refusal_in(self, s: Session, user: str, groups) -> str | None:
        """Why ``user``'s energy budget refuses a request for GPUs now (None: it does not)."""
        budget, source = budgets.effective_budget(user, groups, self.budgets, self.costing)
        if budget is None:
            return None
        now = self.clock()
        used = self.energy_in(s, user, now - timedelta(hours=budget.window_hours), now)
        return budgets.spent_message(budget, source, used, self.costing)

    def energy_totals(self, since: datetime, until: datetime, user: str | None = None) -> dict[str, Energy]:
        """Energy per user on the days from ``since`` to ``until``."""
        first, last = days(since, until)
        q = select(_E.c.user, *_SUMS).where(_E.c.day >= first, _E.c.day <= last).group_by(_E.c.user)
        if user is not None:
            q = q.where(_E.c.user == user)
        with self._read() as s:
            return {u: _energy(rest) for u, *rest in connection(s).execute(q)}

    def energy_by_purpose(self, user: str | None = None) -> dict[tuple[str, str], Energy]:
        """Energy per user and purpose over all history (the metrics' counters)."""
        q = select(_E.c.user, _E.c.purpose, *_SUMS).group_by(_E.c.user, _E.c.purpose)
        if user is not None:
            q = q.where(_E.c.user == user)
        with self._read() as s:
            return {(u, p): _energy(rest) for u, p, *rest in connection(s).execute(q)}

    def energy_days(
        self, since: datetime, until: datetime, user: str | None = None
    ) -> dict[str, dict[date, Energy]]:
        """Energy per user per UTC day from ``since`` to ``until`` (the admin page's bars): its
        joules and idle joules only."""
        first, last = days(since, until)
        # what the chart draws: energy and its idle part (the other sums are the totals')
        q = (
            select(_E.c.user, _E.c.day, func.sum(_E.c.joules), func.sum(_E.c.idle_joules))
            .where(_E.c.day >= first, _E.c.day <= last)
            .group_by(_E.c.user, _E.c.day)
        )
        if user is not None:
            q = q.where(_E.c.user == user)
        out: dict[str, dict[date, Energy]] = {}
        seen: dict[object, date] = {}
        with self._read() as s:
            for u, d, joules, idle in connection(s).execute(q):
                day = seen.get(d)
                if day is None:
                    day = seen[d] = d if isinstance(d, date) else date.fromisoformat(str(d))
                out.setdefault(u, {})[day] = Energy(joules or 0.0, idle or 0.0)
        return out

    def energy_of(self, allocation_ids: Iterable[int]) -> Energy:
        """The energy of some allocations, all their days (a session so far)."""
        ids = list(allocation_ids)
        if not ids:
            return Energy()
        with self._read() as s:
            return _energy(connection(s).execute(select(*_SUMS).where(_E.c.allocation_id.in_(ids))).one())

    def energy_per_allocation(self, allocation_ids: Iterable[int]) -> dict[int, Energy]:
        """Each of some allocations' energy, all their days (those with none measured are left out)."""
        ids = list(allocation_ids)
        if not ids:
            return {}
        q = select(_E.c.allocation_id, *_SUMS).where(_E.c.allocation_id.in_(ids)).group_by(_E.c.allocation_id)
        with self._read() as s:
            return {i: _energy(rest) for i, *rest in connection(s).execute(q)}

    def session_energy(self, user: str, server_name: str, since: datetime) -> Energy:
        """The energy of every allocation ``user`` made for server ``server_name`` since
        ``since`` (its kernels' bursts, ended ones too), and of the server's own live allocation
        (booked before its process started): a session so far."""
        ids = select(Allocation.id).where(
            Allocation.user == user,
            Allocation.server_name == server_name,
            or_(Allocation.created >= since, and_(Allocation.purpose == "server", is_live())),
        )
        with self._read() as s:
            return _energy(connection(s).execute(select(*_SUMS).where(_E.c.allocation_id.in_(ids))).one())

    def ended_times(self, allocation_ids: Iterable[int]) -> dict[int, datetime | None]:
        """When each of some allocations ended (None: still live): where an interval's
        energy stops being theirs."""
        ids = list(allocation_ids)
        if not ids:
            return {}
        with self._read() as s:
            q = select(Allocation.id, Allocation.ended).where(Allocation.id.in_(ids))
            return dict(s.execute(q).all())
