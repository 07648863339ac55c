"""gpuhub limits written into Slurm's accounting, so a plain ``sbatch`` is bounded too.

Each known user's effective ``max_gpus`` becomes their association's
``GrpTRES=gres/gpu=N`` (``-1``: no limit) in ``c.SlurmAccounting.account``, and their
effective fair share (:func:`spawner.fairshare.effective_share` of ``c.GpuHub.default_share``,
``group_shares``, ``user_shares`` with their last known groups) its ``Fairshare=S``, which
Slurm's ``priority/multifactor`` weighs their recent use against; a user Slurm
does not know yet is added first (``sacctmgr add user``). Needs slurmdbd with
``AccountingStorageEnforce=associations,limits`` and ``AccountingStorageTRES=gres/gpu``.

Who writes: the spawner before each submission (for its user, whose groups it knows),
``gpuhub limits set/unset`` and the broker's limit API (for every user the change touches).
GPU-hours quotas stay gpuhub's own (Slurm's ``GrpTRESMins`` counts differently).

Names reach ``sacctmgr`` as arguments (no shell), where ``,`` separates a list, ``=`` sets a
field and a leading ``-`` reads as an option: a user or account name with such a character
(or a space, a quote, a control character; :func:`spawner.values.parse_name`) is refused
with :class:`~.jobs.SlurmError` naming it, and never reaches ``sacctmgr``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from traitlets import Bool, Float, Unicode
from traitlets.config import LoggingConfigurable

from ..fairshare import Shares, effective_share
from ..policy import EffectiveLimit
from ..values import BadValue, parse_name
from .jobs import SlurmError

UNLIMITED = -1


@dataclass(frozen=True)
class Association:
    user: str
    account: str
    gpus: int  # GrpTRES gres/gpu, -1 when unset
    fairshare: int | None = None  # the association's Fairshare (None: not read, or "parent")


ASSOC_FORMAT = "format=user,account,grptres,fairshare"


def parse_associations(text: str) -> dict[str, Association]:
    """``sacctmgr -n -P show assoc format=user,account,grptres[,fairshare]`` to user ->
    association. A Fairshare that is not a whole number (``parent``) reads as None."""
    out = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) not in (3, 4) or not fields[0]:
            continue
        user, account, tres = fields[:3]
        gpus = UNLIMITED
        for item in tres.split(","):
            key, _, value = item.partition("=")
            if key == "gres/gpu" and value.lstrip("-").isdigit():
                gpus = int(value)
        share = fields[3].strip() if len(fields) == 4 else ""
        out[user] = Association(user, account, gpus, int(share) if share.isdigit() else None)
    return out


def wanted_shares(groups: Mapping[str, Iterable[str]], shares: Shares) -> dict[str, int]:
    """Each user's ``Fairshare``: their effective gpuhub share with their known groups."""
    return {user: effective_share(user, list(g), shares)[0] for user, g in groups.items()}


def sacctmgr_name(name, what: str = "user") -> str:
    """``name`` when ``sacctmgr`` reads it as one name; else :class:`SlurmError` saying why."""
    try:
        parse_name(name, f"Slurm {what} name")
    except BadValue as e:
        raise SlurmError(f"not written to Slurm's accounting: {e}") from None
    if name.startswith("-"):
        raise SlurmError(f"not written to Slurm's accounting: Slurm {what} name {name!r} starts with '-'")
    return name


def wanted_gpus(eff: EffectiveLimit) -> int:
    return UNLIMITED if eff.limit.max_gpus is None else eff.limit.max_gpus


def plan(
    limits: Mapping[str, EffectiveLimit],
    current: Mapping[str, Association],
    account: str,
    shares: Mapping[str, int] | None = None,
) -> list[list[str]]:
    """The ``sacctmgr`` commands that make Slurm match ``limits`` and ``shares`` (user ->
    Fairshare; a user missing there keeps the Fairshare Slurm has) (pure). A user or account
    name that ``sacctmgr`` would misread is a :class:`SlurmError` (no command is planned)."""
    shares = shares or {}
    sacctmgr_name(account, "account")
    for user in limits:
        sacctmgr_name(user)
    commands = []
    for user, eff in sorted(limits.items()):
        want = wanted_gpus(eff)
        have = current.get(user)
        if have is None:
            commands.append(["sacctmgr", "-i", "add", "user", user, f"Account={account}"])
        changes = []
        if have is None or have.gpus != want:
            changes.append(f"GrpTRES=gres/gpu={want}")
        share = shares.get(user)
        if share is not None and (have is None or have.fairshare != share):
            changes.append(f"Fairshare={int(share)}")
        if changes:
            commands.append(
                [
                    "sacctmgr",
                    "-i",
                    "modify",
                    "user",
                    "where",
                    f"name={user}",
                    f"account={account}",
                    "set",
                    *changes,
                ]
            )
    return commands


class SlurmAccounting(LoggingConfigurable):
    """``c.SlurmAccounting.*``: gpuhub limits written to Slurm associations."""

    enabled = Bool(
        False,
        help="""Write each user's GPU limit to their Slurm association (``GrpTRES=gres/gpu=N``)
        and add users to Slurm's accounting database when first seen. Needs slurmdbd.
        Without it, gpuhub's own admission still bounds everything gpuhub launches, but not
        a user's own ``sbatch``. ``c.SlurmAccounting.enabled = True``""",
    ).tag(config=True)

    account = Unicode(
        "gpuhub",
        help="""Slurm account new users join and whose associations carry the limits
        (create it once: ``sacctmgr add account gpuhub``). ``c.SlurmAccounting.account = "gpuhub"``""",
    ).tag(config=True)

    timeout = Float(
        30.0,
        help="""Seconds one ``sacctmgr`` call may take. ``c.SlurmAccounting.timeout = 30``""",
    ).tag(config=True)

    @property
    def account_for_jobs(self) -> str:
        """The account gpuhub's jobs are submitted under: the one carrying the limits (a user
        who already has another default account would otherwise escape them)."""
        return self.account if self.enabled else ""

    def _run(self, argv: list[str]) -> str:
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=self.timeout)
        except FileNotFoundError:
            raise SlurmError("sacctmgr is not installed (Slurm accounting needs slurmdbd)") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(argv[:3])} took longer than {self.timeout:g} s") from None
        if r.returncode != 0 and "Nothing new added" not in r.stdout + r.stderr:
            raise SlurmError(f"{' '.join(argv[:4])} failed: {(r.stderr or r.stdout).strip()[-300:]}")
        return r.stdout

    def associations(self) -> dict[str, Association]:
        out = self._run(
            [
                "sacctmgr",
                "-n",
                "-P",
                "show",
                "assoc",
                f"account={self.account}",
                ASSOC_FORMAT,
            ]
        )
        return parse_associations(out)

    def shares(self) -> Shares:
        """``c.GpuHub``'s fair-share weights, checked: a bad one is a ``ValueError`` naming its
        trait (before anything reaches Slurm)."""
        from ..settings import GpuHub

        return GpuHub(config=self.config).shares()

    def sync(self, ledger, users=None, groups: Mapping[str, Iterable[str]] | None = None) -> list[list[str]]:
        """Make Slurm's associations match the ledger for ``users`` (default: every known user):
        limits and fair shares. ``groups``: user -> groups where the caller knows them better
        than the ledger's last record (a spawn). Returns the commands run."""
        if not self.enabled:
            return []
        share_weights = self.shares()  # a bad share is refused before anything is written
        sacctmgr_name(self.account, "account")
        limits = ledger.effective_limits(users)
        known = {**known_groups(ledger, limits), **(groups or {})}
        fairshares = wanted_shares({u: known.get(u, ()) for u in limits}, share_weights)
        refused = {}
        for user in list(limits):
            try:
                sacctmgr_name(user)
            except SlurmError as e:
                refused[user] = str(e)
                del limits[user]
        commands = plan(limits, self.associations(), self.account, fairshares) if limits else []
        for argv in commands:
            self.log.info("gpuhub: %s", " ".join(argv))
            self._run(argv)
        if refused:  # the others' limits are written; these names never reach sacctmgr
            raise SlurmError("; ".join(refused[u] for u in sorted(refused)))
        return commands


def known_groups(ledger, users: Iterable[str]) -> dict[str, list[str]]:
    """The groups the ledger remembers for ``users`` (from each one's last spawn)."""
    from sqlalchemy import select

    from ..models import KnownUser

    wanted = set(users)
    reader = getattr(ledger, "known_groups", None)
    if reader is not None:
        return {u: list(g) for u, g in reader(sorted(wanted)).items()}
    # a ledger without a reader of its known users' groups: read its table
    with ledger._read() as s:
        rows = {r.name: r.groups for r in s.scalars(select(KnownUser)) if r.name in wanted}
    return {u: [g for g in rows.get(u, "").split(",") if g] for u in wanted}
