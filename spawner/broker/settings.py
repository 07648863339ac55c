"""The broker service's own settings: ``c.GpuBroker.*`` (it also reads ``c.GpuHub.*``)."""

from traitlets import Bool, CaselessStrEnum, Float, Int, Set, Unicode
from traitlets.config import Configurable


class GpuBroker(Configurable):
    """The gpuhub broker service: REST API, pages and metrics over the ledger."""

    lease_seconds = Float(
        300.0,
        help="""How long a burst allocation lives without renewal, in seconds, when the request
        names no ``lease_seconds``. A kernel that dies stops renewing, and its GPUs come back
        within this time. ``c.GpuBroker.lease_seconds = 600``
        """,
    ).tag(config=True)

    max_lease_seconds = Float(
        3600.0,
        help="""The longest lease a request may ask for, in seconds.
        ``c.GpuBroker.max_lease_seconds = 7200``
        """,
    ).tag(config=True)

    sweep_seconds = Float(
        10.0,
        help="""How often the service releases expired leases, in seconds (admission also
        releases them first, so an expired lease never blocks a request).
        ``c.GpuBroker.sweep_seconds = 5``
        """,
    ).tag(config=True)

    group_cache_seconds = Float(
        30.0,
        help="""How long a user's JupyterHub groups are cached, in seconds (group limits
        depend on them). ``c.GpuBroker.group_cache_seconds = 60``
        """,
    ).tag(config=True)

    max_body_bytes = Int(
        16 * 1024,
        help="""Largest request body accepted, in bytes. ``c.GpuBroker.max_body_bytes = 16384``""",
    ).tag(config=True)

    usage_days = Int(
        14,
        help="""Days of history the usage plot and table show by default.
        ``c.GpuBroker.usage_days = 30``
        """,
    ).tag(config=True)


class GpuReclaim(Configurable):
    """Idle GPU reclaim: the broker warns the owner of an allocation whose GPUs sit idle,
    then takes it back (``spawner/policy/idle.py`` states the rule exactly)."""

    enabled = Bool(
        True,
        help="""Warn about and reclaim idle GPU allocations. ``c.GpuReclaim.enabled = False``""",
    ).tag(config=True)

    utilization_threshold = Float(
        5.0,
        help="""A GPU below this utilization (percent of time a kernel ran, as NVML and
        nvidia-smi report it) counts as idle. ``c.GpuReclaim.utilization_threshold = 10``
        """,
    ).tag(config=True)

    warn_after_seconds = Float(
        900.0,
        help="""Idle seconds after which the owner is warned (their page, ``%gpus``, the
        server's log). ``c.GpuReclaim.warn_after_seconds = 15 * 60``
        """,
    ).tag(config=True)

    reclaim_after_seconds = Float(
        3600.0,
        help="""Idle seconds after which the allocation is reclaimed: a burst's engines are
        stopped and its GPUs released; a server is stopped (see ``servers``). The owner always
        gets at least ``reclaim_after_seconds - warn_after_seconds`` of notice.
        ``c.GpuReclaim.reclaim_after_seconds = 60 * 60``
        """,
    ).tag(config=True)

    servers = CaselessStrEnum(
        ["stop", "warn"],
        "stop",
        help="""What happens to a notebook server whose GPUs stay idle: ``stop`` it (its
        notebooks stay on disk; the hub's home page tells the user why), or only ``warn``.
        ``c.GpuReclaim.servers = "warn"``
        """,
    ).tag(config=True)

    exempt_users = Set(
        Unicode(),
        help="""Users whose allocations are never reclaimed. ``c.GpuReclaim.exempt_users = {"alice"}``""",
    ).tag(config=True)

    exempt_groups = Set(
        Unicode(),
        help="""JupyterHub groups whose members' allocations are never reclaimed.
        ``c.GpuReclaim.exempt_groups = {"benchmarks"}``
        """,
    ).tag(config=True)

    readings = CaselessStrEnum(
        ["sampler", "owners"],
        "sampler",
        help="""Whose GPU readings decide a reclaim. ``sampler``: gpuhub's own, where no user can
        write: the broker samples the GPUs of its own machine (the local backend, a simulated
        inventory) every ``c.GpuHub.report_seconds``, and on a Slurm cluster ``gpuhub sampler``
        runs on each node as root or the hub's account with a token of the ``gpuhub-sampler``
        role (``docs/reclaim.md``); a GPU nobody samples has unknown use and is never reclaimed.
        The owners' own reports (their servers and engines) are still kept and shown to them.
        ``owners``: the owners' reports decide, so a user can keep an idle GPU by reporting it
        busy. A kernel's activity is always its owner's own word. ``c.GpuReclaim.readings = "sampler"``
        """,
    ).tag(config=True)

    stale_seconds = Float(
        180.0,
        help="""An allocation whose GPUs have not reported for this long has unknown use
        and is never reclaimed; its idle time starts again when reports come back. Keep it a
        few times ``c.GpuHub.report_seconds``. ``c.GpuReclaim.stale_seconds = 300``
        """,
    ).tag(config=True)

    check_seconds = Float(
        30.0,
        help="""How often the broker judges every allocation. ``c.GpuReclaim.check_seconds = 60``""",
    ).tag(config=True)

    history_seconds = Float(
        3600.0,
        help="""How much per-GPU utilization history the broker keeps in memory for its
        pages, in seconds. ``c.GpuReclaim.history_seconds = 7200``
        """,
    ).tag(config=True)

    sample_seconds = Float(
        1.0,
        min=0.01,
        help="""The finest grain of the per-GPU history: readings of one GPU that come faster
        than this replace each other, so the history of a GPU never holds more than
        ``history_seconds / sample_seconds`` readings whatever its reporters send.
        ``c.GpuReclaim.sample_seconds = 5``
        """,
    ).tag(config=True)

    reports_per_gpu_minute = Int(
        600,
        min=1,
        help="""At most this many use reports per minute per GPU of an allocation (its server
        and its engines together); more are answered 429 with ``Retry-After`` and not stored.
        Reporters send one per ``c.GpuHub.report_seconds``. ``c.GpuReclaim.reports_per_gpu_minute = 120``
        """,
    ).tag(config=True)

    def rules(self):
        from spawner.policy.idle import IdleRules

        try:
            return IdleRules(
                enabled=self.enabled,
                threshold=self.utilization_threshold,
                warn_after=self.warn_after_seconds,
                reclaim_after=self.reclaim_after_seconds,
                stale_after=self.stale_seconds,
                servers=self.servers.lower(),
                exempt_users=frozenset(self.exempt_users),
                exempt_groups=frozenset(self.exempt_groups),
            )
        except ValueError as e:
            raise ValueError(f"c.GpuReclaim: {e}") from None
