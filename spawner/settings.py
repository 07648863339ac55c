"""Admin settings shared by the hub, the spawners and the ``gpuhub`` CLI: ``c.GpuHub.*``.

Every setting is a traitlets trait, so it lives in ``jupyterhub_config.py`` beside the
rest of the hub's configuration, and ``gpuhub --config jupyterhub_config.py`` reads the
same file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from traitlets import Bool, CaselessStrEnum, Dict, Float, Int, List, Unicode, Union

from spawner.ledger import BorrowSettings, Ledger, QueueSettings
from spawner.policy import budgets, currencies, extensions, timelimits, values
from spawner.policy.borrowing import BorrowRules, allowance_problem
from spawner.policy.budgets import BudgetRules
from spawner.policy.energy import Costing
from spawner.policy.extensions import ExtendSettings
from spawner.policy.fairshare import Shares, Weights, share_problem
from spawner.policy.limits import DEFAULT_WINDOW_HOURS, Limit, LimitRules, parse_limit_field
from spawner.policy.scoped import Scoped, checked
from spawner.policy.timelimits import TimeRules, read_hours
from spawner.settings_slices import SliceSettings
from spawner.spawners import inventory

LIMIT_KEYS = {"max_gpus", "gpu_hours", "window_hours"}

S = TypeVar("S", bound=Scoped)


def parse_limit(value: Any, where: str) -> Limit:
    """A limit from config: ``2`` (max GPUs), ``None`` (unlimited), or a dict of
    ``max_gpus``, ``gpu_hours``, ``window_hours``. Refused with the trait named."""
    if value is None:
        return Limit(max_gpus=None)
    try:
        if isinstance(value, Mapping):
            unknown = set(value) - LIMIT_KEYS
            if unknown:
                raise ValueError(
                    f"unknown keys {sorted(map(str, unknown))}; use {sorted(LIMIT_KEYS)}, "
                    'e.g. {"max_gpus": 4, "gpu_hours": 200, "window_hours": 168}'
                )
            read = {k: parse_limit_field(k, v, text=False) for k, v in value.items() if v is not None}
            lim = Limit(
                max_gpus=read.get("max_gpus"),
                gpu_hours=read.get("gpu_hours"),
                window_hours=read.get("window_hours", DEFAULT_WINDOW_HOURS),
            )
        elif isinstance(value, int) and not isinstance(value, bool):
            lim = Limit(max_gpus=parse_limit_field("max_gpus", value, field="a limit", text=False))
        else:
            raise ValueError(f"a limit is an int, None or a dict; got {values.show(value)}")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return lim


_LEDGERS: dict[str, Ledger] = {}
_SYNCED: set[str] = set()


class GpuHub(SliceSettings):
    """Where the ledger lives, which GPUs exist, and how many each user may hold (and, from
    :class:`~spawner.settings_slices.SliceSettings`, how GPUs may be split)."""

    trait_parts = (SliceSettings,)  # documented with this class (spawner/reference.py)

    db_url = Unicode(
        "sqlite:///gpuhub.sqlite",
        help="""SQLAlchemy URL of the GPU ledger, a database of its own (never the hub's).

        Default: a SQLite file ``gpuhub.sqlite`` in the hub's working directory, beside
        ``jupyterhub.sqlite`` (the hub and its broker service share it). Any SQLAlchemy URL
        works, e.g. PostgreSQL for a larger install:
        ``c.GpuHub.db_url = "postgresql://gpuhub:secret@db/gpuhub"``
        """,
    ).tag(config=True)

    sqlite_synchronous = CaselessStrEnum(
        ["normal", "full"],
        default_value="normal",
        help="""How a SQLite ledger (``db_url``) makes its commits durable (SQLite's
        ``synchronous`` in WAL mode). ``"normal"``: each commit reaches the operating system
        and the disk is synced at checkpoints; a crash of the hub or any process loses
        nothing and never corrupts the ledger, a power cut or kernel crash may undo the last
        commits (the servers of this machine are gone then too). ``"full"``: the disk is
        synced at every commit, which costs milliseconds on many disks and so bounds the
        admissions per second. No effect on PostgreSQL (set its ``synchronous_commit``).
        ``c.GpuHub.sqlite_synchronous = "full"``
        """,
    ).tag(config=True)

    inventory = CaselessStrEnum(
        ["nvml", "simulated", "slurm"],
        default_value="nvml",
        help="""Where the list of GPUs comes from: ``"nvml"`` (the NVIDIA driver on this
        machine), ``"simulated"`` (``simulated_gpus``, for machines without GPUs) or
        ``"slurm"`` (every node's GPUs as ``sinfo`` reports them; GPU types become models).
        ``c.GpuHub.inventory = "slurm"``
        """,
    ).tag(config=True)

    node_name = Unicode(
        help="""Name of this machine in the ledger for the NVML inventory. Default: the host name.
        ``c.GpuHub.node_name = "gpu-server-1"``
        """,
    ).tag(config=True)

    simulated_gpus = List(
        Dict(),
        default_value=[{"count": 4, "model": "Simulated GPU", "memory_mib": 16384}],
        help="""The simulated inventory: one entry per node with ``count`` GPUs of ``model``
        (``node`` defaults to the host name; ``memory_mib`` and ``first_index`` optional).
        Default: 4 GPUs on this machine.
        ``c.GpuHub.simulated_gpus = [{"node": "sim1", "count": 8, "model": "A100", "memory_mib": 40960}]``
        """,
    ).tag(config=True)

    default_limit = Union(
        [Int(), Dict()],
        allow_none=True,
        default_value=1,
        help="""GPUs any user may hold at once unless a group or user limit says otherwise.
        An int (max GPUs), None (unlimited) or a dict with ``max_gpus``, ``gpu_hours`` and
        ``window_hours`` (GPU-hours over a rolling window, default 168 h). Default: 1.
        A limit of 0 (here or in any group or user entry) means no GPUs at all, not even
        borrowed ones, whatever the borrowing allowance (docs/borrowing.md).
        ``gpuhub limits set --default N`` overrides it from the ledger.
        ``c.GpuHub.default_limit = {"max_gpus": 2, "gpu_hours": 100}``
        """,
    ).tag(config=True)

    group_limits = Dict(
        help="""Limits per JupyterHub group, same values as ``default_limit``. A user in several
        groups gets the most generous value of each field. A ledger row written by
        ``gpuhub limits set --group NAME N`` wins over the entry here.
        ``c.GpuHub.group_limits = {"students": 2, "staff": {"max_gpus": 8}}``
        """,
    ).tag(config=True)

    user_limits = Dict(
        help="""Limits per user, winning over their groups and the default. A ledger row
        written by ``gpuhub limits set --user NAME N`` wins over the entry here.
        ``c.GpuHub.user_limits = {"alice": 4}``
        """,
    ).tag(config=True)

    default_max_hours = Float(
        None,
        allow_none=True,
        help="""The longest a server or a burst of GPUs may run, in hours, unless a group or user
        entry says otherwise: it ends then (a server is stopped, a burst's engines stop; on
        Slurm it is the job's time limit, ``--time``). A request may ask for less (the spawn
        form's hours, a burst's ``hours``, ``%%distributed --hours``), never more: that is
        refused at once with the maximum. None: no limit. From a minute (1/60) to a year.
        ``c.GpuHub.default_max_hours = 8``
        """,
    ).tag(config=True)

    time_warning_minutes = List(
        Float(),
        default_value=[30.0, 5.0],
        help="""When a user is warned before a time limit (``default_max_hours``) ends, in
        minutes before the end: in a running ``%%distributed`` cell (or the next one), and on
        My GPUs; a pool with ``--autosave`` saves its names before the end, as before a
        preemption. Each a number of minutes from 0.1 to a week; [] warns nobody.
        ``c.GpuHub.time_warning_minutes = [60, 10]``
        """,
    ).tag(config=True)

    extension_max_hours = Union(
        [Float(), Int()],
        default_value=0.0,
        allow_none=True,
        help="""How many hours a user may extend one session's time limit by, in all ("Extend"
        on My GPUs, ``%gpus --extend 2h``, ``POST allocations/{id}/extend``). 0 (the default):
        sessions are not extended, their time limit is firm; None: no cap. An extension is also
        refused when it would make anyone waiting in the queue start later than expected
        (``extension_delays_waiters``). An admin of the hub may extend any session past both;
        every extension is recorded (who, when, how much) and shown on GPU admin.
        ``c.GpuHub.extension_max_hours = 4``
        """,
    ).tag(config=True)

    extension_delays_waiters = Bool(
        False,
        help="""Grant a user's extension even when someone waiting in the queue would then
        start later than expected. False (the default): such an extension is refused, saying
        how many requests wait.
        """,
    ).tag(config=True)

    group_max_hours = Dict(
        help="""The longest session per JupyterHub group, in hours (None: no limit), like
        ``default_max_hours``. A user in several groups gets the most generous (no limit beats
        any number). ``c.GpuHub.group_max_hours = {"students": 8, "staff": None}``
        """,
    ).tag(config=True)

    user_max_hours = Dict(
        help="""The longest session per user, in hours (None: no limit), winning over their
        groups and the default. ``c.GpuHub.user_max_hours = {"alice": 48}``
        """,
    ).tag(config=True)

    report_seconds = Float(
        30.0,
        help="""How often each GPU server (and each burst's engines) reports its GPUs'
        utilization and memory, and its kernels' activity, to the broker, in seconds. The
        idle reclaim (``c.GpuReclaim``) and the admin page's live grid are built from these
        reports. ``c.GpuHub.report_seconds = 15``
        """,
    ).tag(config=True)

    pue = Float(
        1.0,
        help="""The facility's power usage effectiveness: the energy the building draws per unit
        the GPUs draw (cooling, power delivery). kWh at the meter = kWh at the GPUs times this.
        1.0 (the default) counts the GPUs alone; a typical machine room is 1.2 to 1.6. From 1
        to 5. ``c.GpuHub.pue = 1.3``
        """,
    ).tag(config=True)

    energy_price = Float(
        0.0,
        help="""What a kWh at the meter costs, in ``energy_currency``: the pages, ``GET usage``
        and ``gpuhub usage --energy`` show money only when a currency is set. 0 or more.
        ``c.GpuHub.energy_price = 0.25``
        """,
    ).tag(config=True)

    energy_currency = Unicode(
        "",
        help="""The ISO 4217 code of ``energy_price``'s currency (``"EUR"``, ``"USD"``, ``"CHF"``).
        "" (the default): no money is shown, and no money budget may be set.
        ``c.GpuHub.energy_currency = "EUR"``
        """,
    ).tag(config=True)

    carbon_intensity = Float(
        None,
        allow_none=True,
        help="""The grid's carbon intensity, in grams CO2e per kWh at the meter; None (the
        default): no CO2e is shown. From 0 to 2000. ``c.GpuHub.carbon_intensity = 350``
        """,
    ).tag(config=True)

    default_energy_budget = Dict(
        None,
        allow_none=True,
        help="""An energy budget for everyone without a group or user entry: ``{"kwh": 50}`` (kWh at
        the meter: the GPUs' energy times ``pue``) or ``{"cost": 20}`` (in ``energy_currency``),
        with an optional ``"window_hours"`` (default 168). Once a user's window holds as much, a
        start or a burst that asks for GPUs is refused with the reason, as a spent GPU-hours
        budget is; a server without GPUs still starts. The window counts whole UTC days. None
        or {} (the default): no budget. ``c.GpuHub.default_energy_budget = {"kwh": 100}``
        """,
    ).tag(config=True)

    group_energy_budgets = Dict(
        help="""Energy budgets per JupyterHub group (None: no budget), as ``default_energy_budget``. A
        user in several groups gets the most generous. ``c.GpuHub.group_energy_budgets =
        {"students": {"cost": 5, "window_hours": 720}}``
        """,
    ).tag(config=True)

    user_energy_budgets = Dict(
        help="""Energy budgets per user, winning over their groups and the default.
        ``c.GpuHub.user_energy_budgets = {"alice": {"kwh": 500}}``
        """,
    ).tag(config=True)

    utilization_source = CaselessStrEnum(
        ["auto", "nvml", "simulated"],
        "auto",
        help="""Where servers and engines read their GPUs' use: ``nvml`` (nvidia-ml-py, on
        the machine that holds the GPU), or ``simulated`` (the file
        ``simulated_utilization_file``, for machines without GPUs). ``auto``: simulated when
        the inventory is simulated, else NVML. ``c.GpuHub.utilization_source = "nvml"``
        """,
    ).tag(config=True)

    simulated_utilization_file = Unicode(
        "gpuhub-simulated-utilization.json",
        help="""With simulated utilization: a JSON file, relative to the hub's directory,
        that maps ``"node:index"`` to ``{"utilization": 80, "memory_used_mib": 1024}``; a GPU
        not in it reads as idle. Write it to play with the idle reclaim on the demo.
        ``c.GpuHub.simulated_utilization_file = "/srv/gpuhub/sim-util.json"``
        """,
    ).tag(config=True)

    simulated_load = CaselessStrEnum(
        ["file", "processes"],
        "file",
        help="""With simulated utilization, what a GPU the file does not name reads:
        ``file``: idle; ``processes``: the use of the processes bound to it (its server's
        kernels, a ``%%distributed`` rank): their CPU time as utilization (one CPU-second per
        second is 100 %), their resident memory as its memory, so the demo's charts and idle
        reclaim move with what runs (``gpu_magics.report.simload``). Only processes the
        sampler may read count: all for the local broker running as root.
        ``c.GpuHub.simulated_load = "processes"``
        """,
    ).tag(config=True)

    default_share = Int(
        1,
        help="""Every user's weight in the fair share of a full machine, unless a group or
        user share says otherwise: a whole number of 1 or more. When GPUs are all taken,
        waiting requests go in order of recent use relative to share (docs/queue.md); on
        Slurm this is each user association's ``Fairshare``. ``c.GpuHub.default_share = 1``
        """,
    ).tag(config=True)

    group_shares = Dict(
        help="""Fair-share weights per JupyterHub group (a user in several gets the largest).
        ``c.GpuHub.group_shares = {"staff": 4, "students": 1}``
        """,
    ).tag(config=True)

    user_shares = Dict(
        help="""Fair-share weights per user, winning over their groups and the default.
        ``c.GpuHub.user_shares = {"alice": 2}``
        """,
    ).tag(config=True)

    fairshare_half_life_hours = Float(
        168.0,
        help="""How fast past use is forgiven in the fair share: an hour of GPU use counts
        half after this many hours, a quarter after twice as many (Slurm's
        ``PriorityDecayHalfLife``). ``c.GpuHub.fairshare_half_life_hours = 72``
        """,
    ).tag(config=True)

    priority_weight_fairshare = Int(
        1000,
        help="""Weight of the fair-share factor (0 to 1) in a waiting request's priority
        (Slurm's ``PriorityWeightFairshare``). ``c.GpuHub.priority_weight_fairshare = 1000``
        """,
    ).tag(config=True)

    priority_weight_age = Int(
        1000,
        help="""Weight of the age factor (0 to 1 over ``priority_max_age_hours`` of waiting)
        in a waiting request's priority. At least ``priority_weight_fairshare`` means that
        nobody waits behind newcomers for ever. ``c.GpuHub.priority_weight_age = 1000``
        """,
    ).tag(config=True)

    priority_max_age_hours = Float(
        24.0,
        help="""Waiting time after which the age factor is 1 (Slurm's ``PriorityMaxAge``): a
        request that has waited this long outranks every newer one. Shorter makes a full queue
        first come, first served sooner (the fair share then only orders requests of the same
        age); longer lets recent use decide for longer. ``c.GpuHub.priority_max_age_hours = 8``
        """,
    ).tag(config=True)

    queue_max_wait_hours = Float(
        12.0,
        help="""The longest a spawn or a burst waits in the queue for GPUs (gpuhub's, or
        Slurm's for a Slurm server); then it leaves the queue, saying so. JupyterHub's
        ``c.Spawner.start_timeout`` counts from the end of the wait (the server's own start),
        not from the click. ``c.GpuHub.queue_max_wait_hours = 4``
        """,
    ).tag(config=True)

    queue_keepalive_seconds = Float(
        30.0,
        help="""A waiting entry whose waiter (the hub's spawn, a notebook's magic) has not
        asked about it for this long leaves the queue: its spawn was lost (a hub restart)
        or its kernel died. A hub restarted within this time keeps every waiting burst in
        its place, and a spawn keeps its place if it is started again within it.
        ``c.GpuHub.queue_keepalive_seconds = 60``
        """,
    ).tag(config=True)

    queue_default_run_hours = Float(
        2.0,
        help="""How long a server or burst is assumed to run when its user has no finished
        ones yet: the basis of expected start times (shown as a guess, never a promise).
        ``c.GpuHub.queue_default_run_hours = 4``
        """,
    ).tag(config=True)

    queue_min_run_seconds = Float(
        300.0,
        help="""Runs shorter than this, in seconds, do not count toward a user's typical run
        length (the median of their last 20, which the queue's expected starts and backfill
        go by); nor do runs that gpuhub ended (an idle reclaim, a preemption). So GPUs taken
        and given back at once, or never used, cannot make a user's runs look short.
        ``c.GpuHub.queue_min_run_seconds = 600``
        """,
    ).tag(config=True)

    default_borrow = Int(
        0,
        help="""GPUs any user may borrow beyond their limit, unless a group or user entry says
        otherwise: only GPUs free at that moment, only while nobody waits in the queue, and
        taken back (after a notice and ``preempt_grace_seconds``) when a request within its
        limit needs them (docs/borrowing.md). 0: no borrowing. A user whose limit is 0 borrows
        nothing (0 means no GPUs at all). ``c.GpuHub.default_borrow = 2``
        """,
    ).tag(config=True)

    group_borrow = Dict(
        help="""Borrowing allowances per JupyterHub group (a user in several gets the largest).
        ``c.GpuHub.group_borrow = {"staff": 4}``
        """,
    ).tag(config=True)

    user_borrow = Dict(
        help="""Borrowing allowances per user, winning over their groups and the default.
        ``c.GpuHub.user_borrow = {"alice": 8}``
        """,
    ).tag(config=True)

    preempt_grace_seconds = Float(
        300.0,
        help="""Notice a borrower gets before borrowed GPUs are taken back: a pool with
        ``--autosave`` saves in it, then its engines stop (a server is stopped). On Slurm,
        the preemptible QOS's ``GraceTime``. ``c.GpuHub.preempt_grace_seconds = 120``
        """,
    ).tag(config=True)

    borrowed_hours_count = Bool(
        True,
        help="""Whether borrowed GPU-hours count against a ``gpu_hours`` budget (a limit's
        GPU-hours over its window). ``c.GpuHub.borrowed_hours_count = False``
        """,
    ).tag(config=True)

    queue_reservations = Int(
        1,
        help="""How many waiting requests at the front of the queue hold a reservation that
        backfill may not delay: 1 (EASY backfill) protects the head only, so a smaller request
        may start ahead of the others where it does not delay the head's expected start; a
        large number (conservative backfill) protects everyone ahead, at the cost of GPUs left
        idle. ``c.GpuHub.queue_reservations = 3``
        """,
    ).tag(config=True)

    queue_poll_seconds = Float(
        1.0,
        help="""How often a waiting spawn or burst asks the ledger whether its turn has
        come: a freed GPU reaches the head of the queue within this time.
        ``c.GpuHub.queue_poll_seconds = 2``
        """,
    ).tag(config=True)

    def report_env(self) -> dict[str, str]:
        """What a server needs to report its GPUs' use (``gpu_magics.report.gpustats``)."""
        source = self.utilization_source.lower()
        if source == "auto":
            source = "simulated" if self.inventory == "simulated" else "nvml"
        env = {
            "GPUHUB_GPU_SOURCE": source,
            "GPUHUB_REPORT_SECONDS": f"{self.report_seconds:g}",
            "GPUHUB_QUEUE_POLL_SECONDS": f"{self.queue_poll_seconds:g}",
        }
        if source == "simulated":
            env["GPUHUB_SIMULATED_GPU_STATS"] = os.path.abspath(self.simulated_utilization_file)
            env["GPUHUB_SIMULATED_GPU_LOAD"] = self.simulated_load.lower()
        return env

    def _scoped(self, kind: type[S], traits: tuple[str, str, str], value: Callable[[Any, str], Any]) -> S:
        """The ``default_X``, ``group_X`` and ``user_X`` traits read into ``kind``, checked (a bad
        value raises ``ValueError`` naming its trait)."""
        return kind.read(
            *(getattr(self, t) for t in traits), names=tuple(f"c.GpuHub.{t}" for t in traits), value=value
        )

    def limit_rules(self) -> LimitRules:
        return self._scoped(LimitRules, ("default_limit", "group_limits", "user_limits"), parse_limit)

    def time_rules(self) -> TimeRules:
        """The longest sessions, checked (a bad one raises ``ValueError`` naming its trait)."""
        return self._scoped(TimeRules, ("default_max_hours", "group_max_hours", "user_max_hours"), read_hours)

    def extend_settings(self) -> ExtendSettings:
        """The extension rules, checked (a bad cap is refused naming its trait)."""
        cap = extensions.read_max_hours(self.extension_max_hours, "c.GpuHub.extension_max_hours")
        return ExtendSettings(cap, bool(self.extension_delays_waiters))

    def time_warnings(self) -> tuple[float, ...]:
        """The warning times, checked (refused naming the trait), latest first, once each."""
        return timelimits.read_warnings(self.time_warning_minutes, "c.GpuHub.time_warning_minutes")

    def shares(self) -> Shares:
        """The fair-share weights, checked (a bad one raises ``ValueError`` naming its trait)."""
        return self._scoped(Shares, ("default_share", "group_shares", "user_shares"), checked(share_problem))

    def queue_settings(self) -> QueueSettings:
        return QueueSettings(
            shares=self.shares(),
            weights=self.queue_weights(),
            keepalive_seconds=self.queue_keepalive_seconds,
            max_wait_hours=self.queue_max_wait_hours,
            default_run_hours=self.queue_default_run_hours,
            reservations=self.queue_reservations,
            min_run_seconds=self.queue_min_run_seconds,
        )

    def borrow_settings(self) -> BorrowSettings:
        """The borrowing settings, checked (a bad one raises ``ValueError`` naming its trait)."""
        rules = self._scoped(
            BorrowRules, ("default_borrow", "group_borrow", "user_borrow"), checked(allowance_problem)
        )
        grace = self.preempt_grace_seconds
        if not grace >= 0 or grace == float("inf"):
            raise ValueError(f"c.GpuHub.preempt_grace_seconds must be 0 or more seconds; got {grace!r}")
        return BorrowSettings(
            rules=rules,
            grace_seconds=grace,
            count_borrowed_hours=self.borrowed_hours_count,
        )

    def queue_weights(self) -> Weights:
        """The priority weights, checked like the shares."""
        if self.queue_reservations < 1:
            raise ValueError(
                f"c.GpuHub.queue_reservations must be 1 or more; got {self.queue_reservations!r}"
            )
        for name in ("priority_weight_fairshare", "priority_weight_age"):
            if getattr(self, name) < 0:
                raise ValueError(f"c.GpuHub.{name} must be 0 or more; got {getattr(self, name)!r}")
        for name in (
            "fairshare_half_life_hours",
            "priority_max_age_hours",
            "queue_max_wait_hours",
            "queue_keepalive_seconds",
            "queue_default_run_hours",
            "queue_poll_seconds",
        ):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ValueError(f"c.GpuHub.{name} must be a positive number; got {value!r}")
        value = self.queue_min_run_seconds
        if not value >= 0 or value == float("inf"):
            raise ValueError(f"c.GpuHub.queue_min_run_seconds must be 0 or more seconds; got {value!r}")
        return Weights(
            fairshare=self.priority_weight_fairshare,
            age=self.priority_weight_age,
            max_age_hours=self.priority_max_age_hours,
            half_life_hours=self.fairshare_half_life_hours,
        )

    def costing(self) -> Costing:
        """The facility's energy numbers, checked (a bad one raises ``ValueError`` naming its
        trait and range)."""
        pue, price, currency = self.pue, self.energy_price, self.energy_currency
        carbon = self.carbon_intensity
        if not 1.0 <= pue <= 5.0:
            raise ValueError(f"c.GpuHub.pue must be from 1 to 5 (1: the GPUs alone); got {pue!r}")
        if not 0.0 <= price < float("inf"):
            raise ValueError(f"c.GpuHub.energy_price must be 0 or more per kWh; got {price!r}")
        if currency and currency not in currencies.ISO_4217:
            raise ValueError(
                f"c.GpuHub.energy_currency must be an ISO 4217 code such as EUR, USD or GBP; got {currency!r}"
            )
        if price and not currency:
            raise ValueError(f"c.GpuHub.energy_price is {price:g}: set c.GpuHub.energy_currency too")
        if carbon is not None and not 0.0 <= carbon <= 2000.0:
            raise ValueError(
                f"c.GpuHub.carbon_intensity must be from 0 to 2000 g CO2e per kWh, or None; got {carbon!r}"
            )
        return Costing(pue=pue, price_per_kwh=price, currency=currency, carbon_g_per_kwh=carbon)

    def budget_rules(self) -> BudgetRules:
        """The energy budgets, checked against the facility's numbers (a bad one raises
        ``ValueError`` naming its trait)."""
        costing = self.costing()
        return self._scoped(
            BudgetRules,
            ("default_energy_budget", "group_energy_budgets", "user_energy_budgets"),
            lambda raw, where: budgets.parse_budget(raw, where, costing),
        )

    def sync_inventory(self) -> None:
        """Read the inventory again and write it to the ledger (a node joined the cluster)."""
        inventory.sync(self.open_ledger(sync=False), self)

    def open_ledger(self, sync: bool = True) -> Ledger:
        """The process's ledger for ``db_url``, opened (and synced) once per process.

        The sync covers only this machine's nodes: GPUs other machines reported stay.
        """
        ledger = _LEDGERS.get(self.db_url)
        if ledger is None:
            ledger = Ledger(
                self.db_url,
                config_rules=self.limit_rules(),
                queue=self.queue_settings(),
                borrow=self.borrow_settings(),
                time_rules=self.time_rules(),
                time_warnings=self.time_warnings(),
                extend=self.extend_settings(),
                costing=self.costing(),
                budgets=self.budget_rules(),
                sqlite_sync=self.sqlite_synchronous,
                slice_groups=self.slice_groups,
            )
            _LEDGERS[self.db_url] = ledger
        if sync and self.db_url not in _SYNCED:  # opened unsynced first (a page): sync now
            inventory.sync(ledger, self)
            _SYNCED.add(self.db_url)
            # checked against the GPUs just synced: a bad setting stops the hub's spawner and
            # the broker with the setting named (read-only users, the CLI, need no offers)
            ledger.slice_offers = self.slice_offers(ledger.present_gpus())
        return ledger
