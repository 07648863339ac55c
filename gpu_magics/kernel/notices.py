"""What a cell says about where its GPUs come from and when borrowed ones are taken back
(pure): :func:`engines_up` (the "N engines up" line, each rank's GPU with its source: the
server's own, or a burst allocation, borrowed or started ahead of the queue, which the hub may
take back with notice), :func:`taken_back` (a preemption notice, said once: what is taken back,
at what time, and why, the hub's reason without its own repeat of what), :func:`parse_due`.

Times are clock times in UTC (``gpu_magics.common.words.clock``), never a relative "in 54 s":
a cell's output stays on the page, and a countdown written once would go stale.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

from gpu_magics.common.words import clock, count, stamp

# the hub's reason repeats what is taken back before why: "preempted: 1 borrowed GPU(s) taken
# back for another user's request ..." (spawner.policy.borrowing.notice_reason)
_HEAD = re.compile(
    r"^(?:preempted:\s*)?\d+ (?:borrowed )?GPUs?(?:\(s\))?(?: that started ahead of .*?)? taken back\s*"
)


def parse_due(text: str | None) -> float:
    """The broker's ISO time (UTC) as Unix time; now when there is none."""
    if not text:
        return time.time()
    when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def when(iso: str | None) -> str | None:
    """The broker's ISO time as people read it, ``2026-12-03 07:36:41 UTC`` (None: none)."""
    return stamp(parse_due(iso)) if iso else None


def why(reason: str | None) -> str:
    """The hub's reason as the end of a sentence that already says what is taken back:
    ``"for another user's request within its limit (2 GPUs, waiting since 07:45 UTC)"``."""
    text = (reason or "").strip().rstrip(".")
    rest = _HEAD.sub("", text, count=1)
    if rest != text:
        rest = rest.replace("at its turn", "at the turn of the request they started ahead of", 1)
        return re.sub(r"(\d+) GPU\(s\)", lambda m: count(int(m[1]), "GPU"), rest)
    text = text.removeprefix("preempted").lstrip(":").strip()
    if not text:
        return ""
    return text if text.startswith(("for ", "at ", "because ")) else "because " + text


def taken(borrowed: int, size: int) -> str:
    """What of an allocation may be taken back: its borrowed GPUs, or all of one that started
    ahead of the queue (backfill)."""
    if borrowed:
        return f"{count(borrowed, 'borrowed GPU')}"
    return f"{count(size, 'GPU')} that started ahead of the queue"


def taken_back(what: str, n: int, allocation_id: int, due: float, reason: str | None, whose: str = "") -> str:
    """One sentence: ``1 borrowed GPU of this pool (allocation #5) is taken back at 07:46:38 UTC
    for another user's request within its limit (2 GPUs, waiting since 07:45 UTC).``"""
    verb = "is" if n == 1 else "are"
    noun, _, that = what.partition(" that ")
    text = " ".join(filter(None, [noun, whose, that and f"that {that}"]))
    return f"{text} (allocation #{allocation_id}) {verb} taken back at {clock(due)}" + (
        f" {why(reason)}." if why(reason) else "."
    )


def burst_note(allocation: Mapping) -> str:
    """A burst allocation as the engines-up line names it: whether it is borrowed (beyond the
    user's limit) or started ahead of the queue, and so may be taken back with notice."""
    size = allocation.get("gpu_count") or len(allocation.get("gpus") or ()) or 0
    borrowed = int(allocation.get("borrowed") or 0)
    notice = allocation.get("notice_seconds")
    with_notice = f"with {notice:g} s notice" if isinstance(notice, int | float) else "with notice"
    head = f"burst allocation #{allocation['id']}"
    if borrowed and borrowed >= size:
        return f"{head}, borrowed beyond your limit: may be taken back {with_notice}"
    if borrowed:
        return f"{head}, {borrowed} of its {size} borrowed beyond your limit: may be taken back {with_notice}"
    if allocation.get("backfill"):
        return f"{head}, started ahead of the queue: may be taken back {with_notice} at its turn"
    return head


def engines_up(labels: Sequence[str], own: Sequence[str], bursts: Sequence[Mapping]) -> str:
    """``3 engines up: rank 0 on vm:0, rank 1 on vm:1 (this server's own); rank 2 on vm:2
    (burst allocation #5, borrowed beyond your limit: may be taken back with notice)``.

    ``labels``: each rank's GPU; ``own``: the server's own GPUs among them; ``bursts``: the
    broker's allocations (JSON) of the rest. Without a burst the ranks are listed plainly. A
    rank on no listed GPU (a Slurm burst names its GPUs only once its job runs) belongs to the
    only burst, if there is one."""
    n = len(labels)
    head = f"{count(n, 'engine')} up: "
    ranks = [f"rank {r} on {label}" for r, label in enumerate(labels)]
    if not bursts:
        return head + ", ".join(ranks)
    where: dict[str, Mapping] = {}
    for a in bursts:
        for g in a.get("gpus") or ():
            where[f"{g['node']}:{g['index']}"] = a
    owned = set(own)

    def source(label: str) -> str:
        if label in owned:
            return "this server's own"
        a = where.get(label) or (bursts[0] if len(bursts) == 1 else None)
        return burst_note(a) if a is not None else ""

    groups: list[tuple[str, list[str]]] = []
    for label, text in zip(labels, ranks, strict=True):
        s = source(label)
        if groups and groups[-1][0] == s:
            groups[-1][1].append(text)
        else:
            groups.append((s, [text]))
    return head + "; ".join(", ".join(t) + (f" ({s})" if s else "") for s, t in groups)
