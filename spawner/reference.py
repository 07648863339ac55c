"""Render the configuration reference (docs/configuration.md) from the traits themselves.

    python -m spawner.reference > docs/configuration.md

``tests/test_docs.py`` fails when the committed file and the code disagree.
"""

from __future__ import annotations

import inspect

from spawner.broker.settings import GpuBroker, GpuReclaim
from spawner.settings import GpuHub
from spawner.slurm.accounting import SlurmAccounting
from spawner.slurm.spawner import GpuSlurmSpawner
from spawner.slurm.watcher import SlurmWatcher
from spawner.spawners.base import GpuSpawnerMixin

SECTIONS = (
    (GpuHub, "GpuHub", "Ledger, inventory and limits. Read by the hub, its spawners and the `gpuhub` CLI."),
    (GpuSpawnerMixin, "Spawner", "Added to every gpuhub spawner (`gpu-local`, `gpu-local-simple`)."),
    (
        GpuBroker,
        "GpuBroker",
        "The broker service (enabled by `enable_broker(c)`, which passes these to the service).",
    ),
    (
        GpuReclaim,
        "GpuReclaim",
        "Idle GPU reclaim, judged by the broker from what servers and engines report "
        "(see docs/reclaim.md; passed to the service by `enable_broker(c)`).",
    ),
    (
        GpuSlurmSpawner,
        "GpuSlurmSpawner",
        "The Slurm spawner (`gpu-slurm`), beside batchspawner's own `req_*` settings "
        "(`req_memory`, `req_runtime`, `req_account`, `req_prologue`, `exec_prefix`). See docs/slurm.md.",
    ),
    (SlurmWatcher, "SlurmWatcher", "The hub's one poller of gpuhub's Slurm jobs."),
    (
        SlurmAccounting,
        "SlurmAccounting",
        "Limits written into Slurm's accounting (slurmdbd), read by the hub, the broker and the CLI.",
    ),
)


def render_reference() -> str:
    out = [
        "# Configuration reference",
        "",
        "Every gpuhub setting is a traitlets trait, set in `jupyterhub_config.py`.",
        "Generated from the code by `python -m spawner.reference`; do not edit by hand.",
        "",
    ]
    for cls, section, blurb in SECTIONS:
        out += [f"## `c.{section}`", "", blurb, ""]
        own = cls.class_own_traits(config=True)
        for part in getattr(cls, "trait_parts", ()):  # its settings kept in modules of their own
            own |= part.class_own_traits(config=True)
        for name, trait in sorted(own.items()):
            default = trait.default_value_repr()
            if len(default) > 100:  # a template: shown in its module, not here
                default = "(the template in spawner/slurm/script.py)"
            out += [
                f"### `c.{section}.{name}`",
                "",
                f"{type(trait).__name__}, default `{default}`.",
                "",
                inspect.cleandoc(trait.help),
                "",
            ]
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    print(render_reference(), end="")
