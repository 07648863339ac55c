"""Limits: the traits' rules with the ledger's rows over them (a part of :class:`spawner.ledger.Ledger`)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from spawner import policy
from spawner.ledger.db import connection
from spawner.ledger.models import SCOPES, KnownUser, LimitRow
from spawner.ledger.transactions import log
from spawner.policy.records import LimitEntry


def _row_limit(row: LimitRow) -> policy.Limit:
    return policy.Limit(
        max_gpus=row.max_gpus,
        gpu_hours=row.gpu_hours,
        window_hours=row.window_hours or policy.DEFAULT_WINDOW_HOURS,
    )


_WARNED: set[tuple] = set()
ALL_LIMITS = select(LimitRow.__table__)


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


class LimitRecords:
    """Limits and the users they apply to."""

    def _rules(self, s: Session) -> policy.LimitRules:
        """The limits as this transaction sees them: read once per writing transaction (a
        combined turn's writes share it; only ``set_limit``/``unset_limit`` change them, in a
        transaction of their own), at every call of a reading one."""
        if "generation" not in s.info:
            return self._read_rules(s)
        rules = s.info.get("rules")
        if rules is None:
            rules = s.info["rules"] = self._read_rules(s)
        return rules

    def _read_rules(self, s: Session) -> policy.LimitRules:
        base = self.config_rules
        default, groups, users = base.default, dict(base.groups), dict(base.users)
        for row in connection(s).execute(ALL_LIMITS):  # plain rows: read at every admission
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

    def known_groups(self, users: Iterable[str] | None = None) -> dict[str, list[str]]:
        """The groups remembered for each known user (or for ``users``), from their last spawn."""
        with self._read() as s:
            q = select(KnownUser)
            if users is not None:
                q = q.where(KnownUser.name.in_(sorted(set(users))))
            return {r.name: [g for g in r.groups.split(",") if g] for r in s.scalars(q)}

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
