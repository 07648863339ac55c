"""gpuhub limits written into Slurm's accounting, so a plain ``sbatch`` is bounded too.

Each known user's effective ``max_gpus`` becomes their association's
``GrpTRES=gres/gpu=N`` (``-1``: no limit) in ``c.SlurmAccounting.account``, and their
effective fair share (:func:`spawner.policy.fairshare.effective_share` of ``c.GpuHub.default_share``,
``group_shares``, ``user_shares`` with their last known groups) its ``Fairshare=S``, which
Slurm's ``priority/multifactor`` weighs their recent use against; a user Slurm
does not know yet is added first (``sacctmgr add user``). Needs slurmdbd with
``AccountingStorageEnforce=associations,limits`` and ``AccountingStorageTRES=gres/gpu``.

Who writes: the spawner before each submission (for its user, whose groups it knows),
``gpuhub limits set/unset`` and the broker's limit API (for every user the change touches).
GPU-hours quotas stay gpuhub's own (Slurm's ``GrpTRESMins`` counts differently).

Borrowing (``c.GpuHub.*_borrow``): a job whose GPUs go beyond its user's limit runs under the
preemptible QOS ``c.SlurmAccounting.borrow_qos`` (:func:`borrow_qos_plan`): ``PreemptMode=cancel``,
``GraceTime`` = ``c.GpuHub.preempt_grace_seconds``, ``GrpTRES=gres/gpu=<every GPU>`` (a QOS's
``GrpTRES`` takes precedence over the association's, so the over-limit job is not refused
as ``AssocGrpGRES``; measured, Slurm 22.05.8: its ``MaxTRESPerUser`` alone does not), and
``MaxTRESPerUser=gres/gpu=<the largest limit + allowance>``; the QOS in ``c.SlurmAccounting.qos``
(``normal``) gets ``Preempt=<borrow QOS>``, and the account may use the borrow QOS.

Names reach ``sacctmgr`` as arguments (no shell), where ``,`` separates a list, ``=`` sets a
field and a leading ``-`` reads as an option: a user or account name with such a character
(or a space, a quote, a control character; :func:`spawner.policy.values.parse_name`) is refused
with :class:`~spawner.slurm.SlurmError` naming it, and never reaches ``sacctmgr``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from traitlets import Bool, Float, Unicode
from traitlets.config import LoggingConfigurable

from spawner.policy.fairshare import Shares, effective_share
from spawner.policy.limits import EffectiveLimit
from spawner.policy.values import BadValue, parse_name
from spawner.slurm import SlurmError

UNLIMITED = -1


@dataclass(frozen=True)
class Association:
    user: str
    account: str
    gpus: int  # GrpTRES gres/gpu, -1 when unset
    fairshare: int | None = None  # the association's Fairshare (None: not read, or "parent")
    shards: int = UNLIMITED  # GrpTRES gres/shard (GPU slices), -1 when unset


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
        got = {"gres/gpu": UNLIMITED, "gres/shard": UNLIMITED}
        for item in tres.split(","):
            key, _, value = item.partition("=")
            if key in got and value.lstrip("-").isdigit():
                got[key] = int(value)
        share = fields[3].strip() if len(fields) == 4 else ""
        out[user] = Association(
            user, account, got["gres/gpu"], int(share) if share.isdigit() else None, got["gres/shard"]
        )
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


def wanted_shards(eff: EffectiveLimit, shards_per_gpu: int | None) -> int | None:
    """The association's ``gres/shard`` for a limit of GPUs, where GPUs are split in shards
    (GPU slices: the limit times each GPU's shards); None where nothing is split."""
    if not shards_per_gpu:
        return None
    gpus = wanted_gpus(eff)
    return UNLIMITED if gpus == UNLIMITED else gpus * shards_per_gpu


def plan(
    limits: Mapping[str, EffectiveLimit],
    current: Mapping[str, Association],
    account: str,
    shares: Mapping[str, int] | None = None,
    shards_per_gpu: int | None = None,
) -> list[list[str]]:
    """The ``sacctmgr`` commands that make Slurm match ``limits`` and ``shares`` (user ->
    Fairshare; a user missing there keeps the Fairshare Slurm has) (pure). ``shards_per_gpu``:
    where GPUs are split in shards (``c.GpuHub.gpu_slices``), the limit in shards too. A user or
    account name that ``sacctmgr`` would misread is a :class:`SlurmError` (no command is
    planned)."""
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
        changes, tres = [], []
        if have is None or have.gpus != want:
            tres.append(f"gres/gpu={want}")
        shards = wanted_shards(eff, shards_per_gpu)
        if shards is not None and (have is None or have.shards != shards):
            tres.append(f"gres/shard={shards}")
        if tres:
            changes.append(f"GrpTRES={','.join(tres)}")
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


@dataclass(frozen=True)
class Qos:
    name: str
    preempt: tuple[str, ...] = ()  # the QOS it may preempt
    preempt_mode: str = ""  # lower case: "cancel", "requeue", "cluster" (Slurm's global), ""
    grace_seconds: int | None = None
    gpus_per_user: int = UNLIMITED  # MaxTRESPerUser gres/gpu
    gpus_total: int = UNLIMITED  # GrpTRES gres/gpu
    flags: tuple[str, ...] = ()


QOS_FORMAT = "format=name,preempt,preemptmode,gracetime,maxtrespu,grptres,flags"


def _gpu_tres(text: str) -> int:
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key == "gres/gpu" and value.lstrip("-").isdigit():
            return int(value)
    return UNLIMITED


def slurm_seconds(text: str) -> int | None:
    """Slurm's ``[days-]hh:mm:ss`` (``00:05:00``, ``1-00:00:00``) as seconds; None if it is not one."""
    days, _, clock = text.strip().rpartition("-")
    parts = clock.split(":")
    if (not days.isdigit() and days) or not all(p.isdigit() for p in parts) or not 1 <= len(parts) <= 3:
        return None
    seconds = 0
    for p in parts:
        seconds = seconds * 60 + int(p)
    return seconds + int(days or 0) * 86400


def parse_qos(text: str) -> dict[str, Qos]:
    """``sacctmgr -n -P show qos`` with :data:`QOS_FORMAT` to name -> :class:`Qos`."""
    out = {}
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 7 or not fields[0]:
            continue
        name, preempt, mode, grace, per_user, total, flags = fields
        out[name] = Qos(
            name,
            tuple(sorted(p for p in preempt.split(",") if p)),
            mode.strip().lower(),
            slurm_seconds(grace) if grace else None,
            _gpu_tres(per_user),
            _gpu_tres(total),
            tuple(sorted(f for f in flags.split(",") if f)),
        )
    return out


def borrow_ceiling(limits: Mapping[str, EffectiveLimit], allowances: Mapping[str, int]) -> int:
    """The borrow QOS's ``MaxTRESPerUser``: the largest limit + allowance of a user who may
    borrow (one QOS serves everyone; gpuhub's own admission holds each user to theirs). 0:
    nobody may borrow. A user whose limit is 0 borrows nothing, whatever their allowance."""
    from spawner.policy.borrowing import usable_allowance

    most = 0
    for user, eff in limits.items():
        allowance = usable_allowance(eff.limit.max_gpus, allowances.get(user, 0))
        if allowance > 0:
            most = max(most, eff.limit.max_gpus + allowance)
    return most


def borrow_qos_plan(
    qos: Mapping[str, Qos],
    *,
    name: str,
    preemptor: str,
    account: str,
    grace_seconds: float,
    per_user: int,
    total_gpus: int,
    account_qos: Iterable[str] | None,
) -> list[list[str]]:
    """The ``sacctmgr`` commands that make the borrow QOS ``name`` and its preemptor match
    (pure): ``name`` preemptible (``PreemptMode=cancel``: a notebook server or an engines job
    started again from its script has lost its state anyway), ``GraceTime`` the grace period
    (whole seconds, rounded up), ``MaxTRESPerUser=gres/gpu=per_user``,
    ``GrpTRES=gres/gpu=total_gpus`` (which takes precedence over each user's association
    limit), ``DenyOnLimit``; ``preemptor`` may preempt it; ``account`` may use it
    (``account_qos``: the account's QOS list now, None when unknown)."""
    sacctmgr_name(name, "QOS")
    sacctmgr_name(preemptor, "QOS")
    sacctmgr_name(account, "account")
    if name == preemptor:
        raise SlurmError(f"the borrow QOS {name!r} cannot be the QOS that preempts it")
    if not grace_seconds >= 0 or grace_seconds == float("inf"):
        raise SlurmError(f"GraceTime must be 0 or more seconds; got {grace_seconds!r}")
    grace = int(-(-grace_seconds // 1))
    per_user, total = max(0, int(per_user)), max(1, int(total_gpus))
    commands = []
    have = qos.get(name)
    if have is None:
        commands.append(["sacctmgr", "-i", "add", "qos", name])
    want = {
        "PreemptMode": ("cancel", have.preempt_mode if have else None),
        "GraceTime": (grace, have.grace_seconds if have else None),
        "MaxTRESPerUser": (per_user, have.gpus_per_user if have else None),
        "GrpTRES": (total, have.gpus_total if have else None),
        "Flags": (("DenyOnLimit",), have.flags if have else None),
    }
    changes = []
    for key, (value, current) in want.items():
        if value == current:
            continue
        if key in ("MaxTRESPerUser", "GrpTRES"):
            changes.append(f"{key}=gres/gpu={value}")
        elif key == "Flags":
            changes.append("Flags=DenyOnLimit")
        else:
            changes.append(f"{key}={value}")
    if changes:
        commands.append(["sacctmgr", "-i", "modify", "qos", "where", f"name={name}", "set", *changes])
    boss = qos.get(preemptor)
    if boss is None or name not in boss.preempt:
        commands.append(
            ["sacctmgr", "-i", "modify", "qos", "where", f"name={preemptor}", "set", f"Preempt+={name}"]
        )
    if account_qos is None or name not in set(account_qos):
        commands.append(
            [
                "sacctmgr", "-i", "modify", "account", "where", f"name={account}",
                "set", f"QOS+={name}",
            ]
        )  # fmt: skip
    return commands


class SlurmAccounting(LoggingConfigurable):
    """``c.SlurmAccounting.*``: gpuhub limits written to Slurm associations."""

    enabled = Bool(
        False,
        help="""Write each user's GPU limit to their Slurm association (``GrpTRES=gres/gpu=N``;
        where ``c.GpuHub.gpu_slices`` splits GPUs, also ``gres/shard=N`` times a GPU's shards)
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

    borrow_qos = Unicode(
        "gpuhub-borrow",
        help="""The preemptible QOS gpuhub writes (with accounting on) and submits jobs with GPUs
        beyond their user's limit under (``c.GpuHub.*_borrow``): ``PreemptMode=cancel``,
        ``GraceTime`` = ``c.GpuHub.preempt_grace_seconds``. Needs ``PreemptType=preempt/qos``
        in slurm.conf. "": never written nor used (borrowed jobs then run unpreemptible, under
        the association's limit). ``c.SlurmAccounting.borrow_qos = "gpuhub-borrow"``""",
    ).tag(config=True)

    qos = Unicode(
        "normal",
        help="""The QOS in-limit jobs run under (the association's default), given
        ``Preempt=<borrow_qos>``. ``c.SlurmAccounting.qos = "normal"``""",
    ).tag(config=True)

    verified_seconds = Float(
        300.0,
        help="""How long what gpuhub last found (or wrote) in Slurm's accounting for a user, their
        limit and fair share, and for the borrow QOS, is trusted before their next job without
        asking ``sacctmgr`` again (each ``show`` costs a round trip to slurmdbd before every
        ``sbatch``). Anything gpuhub wants different (a new limit, share or allowance) is
        written at once whatever this says; what it bounds is how long a change made outside
        gpuhub (an operator's ``sacctmgr``) goes unseen, and a job Slurm refuses makes gpuhub
        read and write the user's association again and submit once more. 0: read before
        every job. ``c.SlurmAccounting.verified_seconds = 300``""",
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

    def shards_per_gpu(self) -> int | None:
        """Each split GPU's shards, where ``c.GpuHub.gpu_slices`` splits any (the most of any
        sliced model's, as ``sinfo`` says), so that a limit of N GPUs lets N GPUs' worth of
        shards run; None where no GPU is split."""
        from spawner.policy.slices import Offer
        from spawner.settings import GpuHub
        from spawner.slurm import shards
        from spawner.slurm.cluster import read_cluster

        split = GpuHub(config=self.config).gpu_slices
        if not split:
            return None
        per_slice = shards.check_shards({m: Offer(m, int(n)) for m, n in split.items()}, read_cluster())
        return max(k * int(split[m]) for m, k in per_slice.items())

    def shares(self) -> Shares:
        """``c.GpuHub``'s fair-share weights, checked: a bad one is a ``ValueError`` naming its
        trait (before anything reaches Slurm)."""
        from spawner.settings import GpuHub

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
        per_gpu = self.shards_per_gpu()
        wanted = {
            ("user", self.account, u): (wanted_gpus(lim), fairshares.get(u), wanted_shards(lim, per_gpu))
            for u, lim in limits.items()
        }
        todo = {u: lim for u, lim in limits.items() if not self._verified(("user", self.account, u), wanted)}
        commands = plan(todo, self.associations(), self.account, fairshares, per_gpu) if todo else []
        checked = [("user", self.account, u) for u in todo]
        if self.borrow_qos:
            wanted[("borrow", self.account)] = borrow = _borrow_qos_inputs(self, ledger)
            if borrow is not None and not self._verified(("borrow", self.account), wanted):
                commands += _borrow_qos_commands(self, borrow)
                checked.append(("borrow", self.account))
        for argv in commands:
            self.log.info("gpuhub: %s", " ".join(argv))
            self._run(argv)
        now = time.monotonic()  # what was read (and written where it differed) matches Slurm now
        _VERIFIED.update({slot: (wanted[slot], now) for slot in checked})
        if refused:  # the others' limits are written; these names never reach sacctmgr
            raise SlurmError("; ".join(refused[u] for u in sorted(refused)))
        return commands

    def _verified(self, slot: tuple, wanted: dict) -> bool:
        """Whether Slurm was found (or made) to say what ``wanted[slot]`` says, within
        ``verified_seconds``."""
        value, when = _VERIFIED.get(slot, (None, None))
        return when is not None and value == wanted[slot] and time.monotonic() - when < self.verified_seconds

    @staticmethod
    def forget(user: str | None = None) -> None:
        """Trust nothing remembered about ``user`` and the borrow QOS (everything: ``None``):
        the next sync reads Slurm's accounting again."""
        for slot in list(_VERIFIED):
            if user is None or slot[0] == "borrow" or slot[2] == user:
                _VERIFIED.pop(slot, None)


# ("user", account, name) or ("borrow", account) -> (what Slurm was found or made to say, when:
# time.monotonic()); one per hub process, shared by its spawners (SlurmAccounting.sync, .forget)
_VERIFIED: dict[tuple, tuple] = {}


def _account_qos(text: str, account: str) -> list[str] | None:
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) == 3 and fields[0] == account and not fields[1]:
            return [q for q in fields[2].split(",") if q]
    return None


def _borrow_qos_inputs(self: SlurmAccounting, ledger) -> tuple | None:
    """What the borrow QOS must say, from the ledger and the hub's settings alone: ("borrow",
    name, preemptor, account, grace, per-user ceiling, GPUs); None when nobody may borrow
    (gpuhub then submits nothing under the QOS, and writes none)."""
    from spawner.settings import GpuHub

    hub = GpuHub(config=self.config)
    settings = hub.borrow_settings()  # a bad allowance or grace is refused, trait named
    everyone = ledger.effective_limits(None)
    known = known_groups(ledger, everyone)
    allowances = {u: _allowance(u, known.get(u, ()), settings) for u in everyone}
    ceiling = borrow_ceiling(everyone, allowances)
    if ceiling == 0:
        return None
    total = max(1, sum(1 for st in ledger.gpu_table() if st.present))
    return ("borrow", self.borrow_qos, self.qos, self.account, settings.grace_seconds, ceiling, total)


def _borrow_qos_commands(self: SlurmAccounting, inputs: tuple) -> list[list[str]]:
    """The commands that bring the borrow QOS in line with ``inputs`` (not run here)."""
    _, name, preemptor, account, grace_seconds, ceiling, total = inputs
    qos = parse_qos(self._run(["sacctmgr", "-n", "-P", "show", "qos", QOS_FORMAT]))
    assoc = self._run(
        ["sacctmgr", "-n", "-P", "show", "assoc", f"account={account}", "format=account,user,qos"]
    )
    return borrow_qos_plan(
        qos,
        name=name,
        preemptor=preemptor,
        account=account,
        grace_seconds=grace_seconds,
        per_user=ceiling,
        total_gpus=total,
        account_qos=_account_qos(assoc, account),
    )


def _allowance(user, groups, settings) -> int:
    from spawner.policy.borrowing import effective_borrow

    return effective_borrow(user, list(groups), settings.rules)[0]


def known_groups(ledger, users: Iterable[str]) -> dict[str, list[str]]:
    """The groups the ledger remembers for ``users`` (from each one's last spawn)."""
    from sqlalchemy import select

    from spawner.ledger.models import KnownUser

    wanted = set(users)
    reader = getattr(ledger, "known_groups", None)
    if reader is not None:
        return {u: list(g) for u, g in reader(sorted(wanted)).items()}
    # a ledger without a reader of its known users' groups: read its table
    with ledger._read() as s:
        rows = {r.name: r.groups for r in s.scalars(select(KnownUser)) if r.name in wanted}
    return {u: [g for g in rows.get(u, "").split(",") if g] for u in wanted}
