"""gpuhub's decisions, as pure functions over frozen values: nothing here opens a database,
reads a clock or starts a process (``tests/test_layers.py`` holds it to that). The ledger
gathers the facts, asks these functions, and records the answer.

- :mod:`~spawner.policy.values`: parsing and showing what people type (counts, hours, sizes).
- :mod:`~spawner.policy.records`: the frozen records the ledger answers with.
- :mod:`~spawner.policy.scoped`: settings given by default, per group and per user, and how
  a user's value is found (limits, fair-share weights, borrowing allowances).
- :mod:`~spawner.policy.limits`: what a user may hold; whether a request fits.
- :mod:`~spawner.policy.placement`: which GPUs a request takes.
- :mod:`~spawner.policy.borrowing`: lending idle GPUs beyond a limit, and taking them back.
- :mod:`~spawner.policy.fairshare`: who goes first when every GPU is taken.
- :mod:`~spawner.policy.schedule`: the queue's plan (reservations, backfill).
- :mod:`~spawner.policy.idle`: when a GPU counts as idle, and what happens then.
- :mod:`~spawner.policy.waitline`: the lines a waiting user reads.

The names of ``limits`` and ``placement`` are also this package's (``policy.Gpu``,
``policy.check_request``): the two together are the allocation policy most callers ask.
"""

from spawner.policy.limits import (
    DEFAULT_WINDOW_HOURS,
    MAX_COUNT,
    MAX_GPU_HOURS,
    MAX_LIMIT_GPUS,
    MAX_WINDOW_HOURS,
    MIN_WINDOW_HOURS,
    EffectiveLimit,
    Holdings,
    Limit,
    LimitRules,
    Refusal,
    check_request,
    describe_limit,
    effective_limit,
    gpu_hours_used,
    limit_problem,
    parse_limit_field,
    remaining,
)
from spawner.policy.placement import (
    KEPT,
    FitIndex,
    Gpu,
    GpuSet,
    GroupedGpus,
    Request,
    best_node,
    largest_placeable,
    make_fit_index,
    place,
    refit,
)

__all__ = [
    "DEFAULT_WINDOW_HOURS",
    "KEPT",
    "MAX_COUNT",
    "MAX_GPU_HOURS",
    "MAX_LIMIT_GPUS",
    "MAX_WINDOW_HOURS",
    "MIN_WINDOW_HOURS",
    "EffectiveLimit",
    "FitIndex",
    "Gpu",
    "GpuSet",
    "GroupedGpus",
    "Holdings",
    "Limit",
    "LimitRules",
    "Refusal",
    "Request",
    "best_node",
    "check_request",
    "describe_limit",
    "effective_limit",
    "gpu_hours_used",
    "largest_placeable",
    "limit_problem",
    "make_fit_index",
    "parse_limit_field",
    "place",
    "refit",
    "remaining",
]
