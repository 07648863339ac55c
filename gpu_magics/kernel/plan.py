"""Where ``%%distributed``'s GPUs come from, and when a pool may be replaced: pure functions.

- :func:`plan_gpus`: ``--gpus N`` uses the server's own GPUs first; beyond them only the
  difference is a burst, on the same node (engines run on this machine, local backend).
- :func:`why_new_engines`: whether the next cell can run on the warm pool, and if not why.
- :func:`refuse_discard`: a change that needs new engines never throws away a pool that holds
  the user's variables unless ``--restart`` or autosave says so.
- :func:`may_retry_after_release`: a refused burst that the pool's own burst stands in the way
  of (its GPUs count against the limit until released).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpu_magics.common.ranks import Slot

OTHER_SETTINGS = "the pool had other settings"


@dataclass(frozen=True)
class GpuPlan:
    own: tuple[Slot, ...]  # the server's GPUs the ranks use
    burst: int  # GPUs to take from the broker (0: none)
    node: str | None  # where the burst must be (the own GPUs' node); None: any one node

    @property
    def total(self) -> int:
        return len(self.own) + self.burst


def plan_gpus(server_gpus: Sequence[str], wanted: int) -> GpuPlan:
    """The server's own GPUs (lowest first) and a burst for the rest, all on one node.

    The server's GPUs of one node are used (where a server spans several, the node holding
    most of them); a burst adds only what they lack, on that node.
    """
    slots = sorted(Slot.parse(g) for g in server_gpus if g)
    by_node: dict[str, list[Slot]] = {}
    for s in slots:
        by_node.setdefault(s.node, []).append(s)
    if not by_node:
        return GpuPlan((), wanted, None)
    node = min(by_node, key=lambda n: (-len(by_node[n]), n))
    mine = by_node[node][:wanted]
    return GpuPlan(tuple(mine), wanted - len(mine), node if wanted > len(mine) else None)


def why_new_engines(
    *, has_pool: bool, same_settings: bool, broken: bool, lease_lost: bool, restart: bool
) -> str | None:
    """None: the warm pool runs the cell. Else why new engines start (shown to the user)."""
    if not has_pool:
        return None
    if lease_lost:
        return "the pool lost its burst allocation"
    if broken:
        return "the pool was left broken by the last cell"
    if restart:
        return "the cell asked for --restart"
    if not same_settings:
        return OTHER_SETTINGS
    return None


def refuse_discard(
    why: str | None,
    user_names: Sequence[str] | None,
    *,
    restart: bool,
    autosave: bool,
    current: str,
    asked: str,
) -> str | None:
    """The refusal's message when new engines would throw away the user's variables, else None.

    Only a change of settings is guarded: a pool that lost its GPUs or its process group cannot
    run the next cell anyway. ``user_names`` None means the engines could not be asked.
    """
    if why != OTHER_SETTINGS or restart or autosave:
        return None
    if user_names is not None and not user_names:
        return None
    if user_names is None:
        held = "the pool may hold your variables (its engines did not say which)"
    else:
        more = len(user_names) - 8
        shown = ", ".join(user_names[:8]) + (f", and {more} more" if more > 0 else "")
        held = f"the pool holds your variables ({shown})"
    return (
        f"%%distributed {asked} needs new engines (the pool runs {current}), and {held}; nothing "
        "was changed. Run the cell with --restart to discard them, or --autosave NAME... to carry "
        "them over, or keep the pool's settings."
    )


def may_retry_after_release(reason: str, fits: int | None, old: int, need: int) -> bool:
    """A burst of ``need`` was refused while the pool holds one of ``old``: True where the
    refusal is only that old burst's count (over the limit, or its GPUs not free), so that
    releasing it first would let the request in. Never for what could never fit."""
    if not old or reason not in ("over_limit", "no_capacity") or fits is None:
        return False
    return fits + old >= need


def describe_settings(gpus: int, backend: str | None, timeout: float, nodes=None, per_node=None) -> str:
    """The pool's settings as the user writes them."""
    text = f"--gpus {gpus}"
    if nodes:
        text += f" --nodes {nodes}"
    if per_node:
        text += f" --gpus-per-node {per_node}"
    if backend:
        text += f" --backend {backend}"
    return text + f" --timeout {timeout:g}"
