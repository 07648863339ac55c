"""The broker service's own settings: ``c.GpuBroker.*`` (it also reads ``c.GpuHub.*``)."""

from traitlets import Float, Int
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
