"""Where ``%%distributed``'s GPUs come from, and when a pool may be replaced.

The rules, pure functions:

- :func:`plan_gpus`: ``--gpus N`` uses the server's own GPUs first; beyond them only the
  difference is a burst, on the same node (engines run on this machine, local backend).
- :func:`kept_settings`: a cell that types no pool setting runs on the warm pool as it is.
- :func:`why_new_engines`: whether the next cell can run on the warm pool, and if not why.
- :func:`refuse_discard`: a change that needs new engines never throws away a pool that holds
  the user's variables unless ``--restart`` or autosave says so.
- :func:`may_retry_after_release`: a refused burst that the pool's own burst stands in the way
  of (its GPUs count against the limit until released).

The asking, which talks to the broker (:class:`Terms` say how): :func:`acquire` (a local pool's
own GPUs and burst), :func:`new_gpus` (a new pool's, local or Slurm), :func:`request_burst`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from IPython.core.error import UsageError

from gpu_magics.common.ranks import Slot
from gpu_magics.common.session import server_gpus
from gpu_magics.common.words import count
from gpu_magics.kernel.broker import BrokerClient
from gpu_magics.kernel.burst import Burst, Part

OTHER_SETTINGS = "the pool had other settings"
LOST_BURST = "the pool lost its burst allocation"


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


POOL_SETTINGS = ("gpus", "nodes", "gpus_per_node", "backend", "timeout")


def kept_settings(typed: dict, key) -> dict | None:
    """A cell that types none of the pool's settings runs on the warm pool as it is: the
    pool's settings for it (None where the cell types one, or there is no pool). Without this a
    bare ``%%distributed`` after ``--timeout 60`` asked for the default timeout, new engines."""
    if key is None or any(typed.get(name) is not None for name in POOL_SETTINGS):
        return None
    (gpus, nodes, per_node), backend_name, timeout = key
    return {
        "gpus": gpus,
        "nodes": nodes,
        "gpus_per_node": per_node,
        "backend": backend_name,
        "timeout": timeout,
    }


def why_new_engines(
    *, has_pool: bool, same_settings: bool, broken: bool, lease_lost: bool, restart: bool
) -> str | None:
    """None: the warm pool runs the cell. Else why new engines start (shown to the user)."""
    if not has_pool:
        return None
    if lease_lost:
        return LOST_BURST
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


def describe_settings(
    gpus: int, backend: str | None, timeout: float | None, nodes=None, per_node=None, default=None
) -> str:
    """The pool's settings as the user writes them: only the options given (``timeout``
    None: not typed). ``default``: the magic's default timeout, named in words where
    ``timeout`` is it (``--gpus 2 with the default timeout of 300 s``), never quoted as an option
    the user did not type."""
    text = f"--gpus {gpus}"
    if nodes:
        text += f" --nodes {nodes}"
    if per_node:
        text += f" --gpus-per-node {per_node}"
    if backend:
        text += f" --backend {backend}"
    if timeout is None:
        return text
    if default is not None and timeout == default:
        return text + f" with the default timeout of {timeout:g} s"
    return text + f" --timeout {timeout:g}"


# the asking ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Terms:
    """How ``%%distributed`` asks for a burst: its lease, how often a borrowed one looks for a
    preemption notice and whom it tells, and how long the user's code has been idle."""

    lease_seconds: float
    check_seconds: float
    activity: Callable[[], float | None]
    on_notice: Callable[[Part, dict], None]


def request_burst(
    terms: Terms, n: int, held: int, wanted: int, wait: bool = True, beside: str = "this server's", **where
) -> Burst:
    """``wait``: join the queue when the GPUs are all taken (never while the pool still
    holds a burst: waiting for GPUs behind its own would never end)."""
    return Burst.request(
        "%%distributed",
        n,
        wait=wait,
        lease_seconds=terms.lease_seconds,
        held=held,
        wanted=wanted,
        activity=terms.activity,
        check_seconds=terms.check_seconds,
        on_notice=terms.on_notice,
        beside=beside,
        **where,
    )


def room() -> int | None:
    """GPUs the user may still take within their limit, when they could borrow beyond it
    (None: no limit, nothing to borrow, or unknown: one allocation, refused as such)."""
    client = BrokerClient.from_env()
    if client is None:
        return None
    try:
        me = client.me()
    except Exception:  # unknown: asked for as one allocation, as before
        return None
    may_take, borrow = me.get("may_take"), me.get("borrow") or {}
    left = (borrow.get("allowance") or 0) - (borrow.get("borrowed") or 0)
    return may_take if isinstance(may_take, int) and left > 0 else None


def request_local_burst(
    terms: Terms, n: int, held: int, wanted: int, wait: bool, node: str | None, beside: str = "this server's"
) -> Burst:
    """A local burst of ``n`` GPUs on one node. Where only part of it fits the user's limit
    it is asked for as two parts, the part within the limit and the borrowed rest
    (:meth:`Burst.join`): a preemption then takes back only the borrowed GPUs."""
    within = room()
    if within is None or within <= 0 or within >= n:
        return request_burst(terms, n, held, wanted, wait=wait, beside=beside, nodes=1, node=node)
    first = request_burst(terms, within, held, wanted, wait=wait, beside=beside, nodes=1, node=node)
    try:
        node = node or (first.slots[0].node if first.slots else None)
        second = request_burst(
            terms, n - within, held + within, wanted, wait=False, beside=beside, nodes=1, node=node
        )
    except UsageError as e:
        first.release()
        text = str(e).split(": ", 1)[-1]
        err = UsageError(
            f"gpuhub refused the {count(n - within, 'GPU')} beyond your limit for %%distributed --gpus "
            f"{wanted} ({within} within it were granted and are given back): {text}"
        )
        err.refusal = getattr(e, "refusal", None)
        raise err from None
    except BaseException:
        first.release()
        raise
    return first.join(second)


def acquire(terms: Terms, gpus: int, old: Burst | None = None) -> tuple[tuple[Slot, ...], Burst | None]:
    """The GPUs of a local pool of ``gpus`` ranks: the server's own, and a burst of only
    what they lack, on their node. ``old`` (the pool's burst) is kept where it is the size
    needed; else a new burst is asked for while ``old`` is still held (the caller decides
    what a refusal means). Raises UsageError with the broker's reason; nothing is taken."""
    plan = plan_gpus(server_gpus().pool_gpus, gpus)
    if not plan.burst:
        return plan.own, None
    if (
        old is not None
        and not old.lost
        and old.size == plan.burst
        and (plan.node is None or {s.node for s in old.slots} == {plan.node})
    ):
        return plan.own, old
    # engines run on this machine: the burst on one node, the server's own when it has GPUs
    burst = request_local_burst(terms, plan.burst, len(plan.own), gpus, old is None, plan.node)
    return plan.own, burst


def slurm_launcher(args):
    """(launcher, GPUs of a burst job or 0) on the Slurm backend
    (:func:`gpu_magics.launch.slurm.server_launcher`). Checked before anything is stopped."""
    from gpu_magics.launch.slurm import server_launcher

    try:
        return server_launcher(args.gpus, args.nodes, args.gpus_per_node)
    except ValueError as e:
        raise UsageError(str(e)) from None


def new_gpus(terms: Terms, args, on_slurm: bool, old: Burst | None):
    """(own slots, burst or None, Slurm launcher or None) for a new pool, asked for while
    the current pool still runs: a refusal leaves it as it is."""
    if not on_slurm:
        own, burst = acquire(terms, args.gpus, old)
        return own, burst, None
    launcher, own = slurm_launcher(args)
    if launcher.mode != "job":
        return (), None, launcher
    # a Slurm burst's job ends with its engines: a new pool asks anew
    burst = request_burst(
        terms, args.gpus, own, args.gpus, nodes=launcher.nodes, gpus_per_node=launcher.per_node
    )
    return (), burst, launcher
