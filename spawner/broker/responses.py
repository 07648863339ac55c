"""JSON shapes of the broker's API (documented in openapi.yaml): pure functions."""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from typing import Any

from spawner.broker import energy_views
from spawner.broker.utilization import Reading, Utilization, epoch
from spawner.policy.idle import Verdict
from spawner.policy.limits import Limit
from spawner.policy.records import (
    AllocationInfo,
    Allowance,
    ExtensionInfo,
    GpuStatus,
    LimitEntry,
    PreemptionNotice,
    ReclaimInfo,
)


def iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat(timespec="seconds") + "Z"


def preemption_of(a: AllocationInfo) -> dict[str, Any] | None:
    return None if a.preempt_due is None else {"due": iso(a.preempt_due), "reason": a.preempt_reason}


def withdrawn_of(a: AllocationInfo) -> dict[str, Any] | None:
    """The notice it had, withdrawn (the ledger's row says when and why); None: none was."""
    if a.withdrawn is None or a.preempt_due is not None:
        return None
    return {"at": iso(a.withdrawn), "reason": a.withdrawn_reason}


def allocation_json(
    a: AllocationInfo, notice_seconds: float | None = None, warnings: tuple[float, ...] = ()
) -> dict[str, Any]:
    """An allocation; ``notice_seconds`` (the hub's ``c.GpuHub.preempt_grace_seconds``) is
    given for one that may be taken back with notice (borrowed or backfilled), else null;
    ``warnings`` (``c.GpuHub.time_warning_minutes``) with its time limit."""
    return {
        "id": a.id,
        "user": a.user,
        "purpose": a.purpose,
        "server_name": a.server_name,
        "of_server": a.of_server,
        "state": a.state,
        "created": iso(a.created),
        "started": iso(a.started),
        "ended": iso(a.ended),
        "end_reason": a.end_reason,
        "lease_expires": iso(a.lease_expires),
        "backend": a.backend,
        "backend_job_id": a.backend_job_id,
        "nodes": list(a.nodes),
        "gpus": [gpu_json(g) for g in a.gpus],
        "gpu_count": a.gpu_count,
        # one slice of a GPU split in this many parts (null: whole GPUs), and what it counts as
        "slice_parts": a.slice_parts,
        "units": amount(a.units),
        "borrowed": a.borrowed,
        "backfill": a.backfill,
        "notice_seconds": notice_seconds if (a.borrowed or a.backfill) else None,
        "preemption": preemption_of(a),
        "preemption_withdrawn": withdrawn_of(a),
        "time_limit": time_limit_of(a, warnings),
    }


def warned(a: AllocationInfo, warnings: tuple[float, ...], now: datetime | None) -> dict[str, Any]:
    """``{"time_limit": {..., "warned": bool}}`` for a limited allocation once ``now`` is given."""
    limit = time_limit_of(a, warnings)
    if limit is None or now is None:
        return {}
    first = max(warnings, default=None)
    return {
        "time_limit": limit | {"warned": first is not None and now >= a.time_ends - timedelta(minutes=first)}
    }


def time_limit_of(a: AllocationInfo, warnings: tuple[float, ...] = ()) -> dict[str, Any] | None:
    """How long it may run (``seconds``), when it ends (``ends``, firm) and the minutes before
    then its user is warned (``warnings``), or null: no limit."""
    if a.time_limit_seconds is None:
        return None
    return {"seconds": a.time_limit_seconds, "ends": iso(a.time_ends), "warnings": list(warnings)}


def amount(x) -> int | float:
    """A number of GPUs for JSON: whole ones as an integer, a part of one (slices) as a float."""
    return int(x) if x == int(x) else float(x)


def gpu_json(g) -> dict[str, Any]:
    """A GPU an allocation holds; a slice names its part (1 to ``parts``) and its memory."""
    out = {"node": g.node, "index": g.index, "model": g.model}
    if g.part:
        out |= {"part": g.part, "parts": g.parts, "memory_mib": g.memory_mib, "label": g.label}
    return out


def queue_json(q, now) -> dict[str, Any]:
    """A queue entry (``spawner.policy.records.QueueInfo``) with its place and the line its user sees."""
    f = q.factors
    return {
        "id": q.id,
        "user": q.user,
        "purpose": q.purpose,
        "server_name": q.server_name,
        "gpus": q.gpu_count,
        "slice_parts": q.slice_parts,
        "gpu_model": q.model,
        "state": q.state,
        "created": iso(q.created),
        "waited_seconds": round(((q.ended or now) - q.created).total_seconds(), 1),
        "position": q.position,
        "waiting": q.waiting,
        "expected_start": None if q.sure == "default" else iso(q.expected),  # no hours invented
        "expected_sure": q.sure,
        "moved_to_front": iso(q.front),
        "ended": iso(q.ended),
        "end_reason": q.end_reason,
        "allocation_id": q.allocation_id,
        "line": q.line(now) if q.state == "waiting" else q.end_reason,
        "factors": None
        if f is None
        else {
            "priority": round(f.priority, 3),
            "fairshare": round(f.fairshare, 4),
            "age": round(f.age, 4),
            "share": f.share,
            "recent_gpu_hours": round(f.usage, 3),
            "front": f.front,
        },
    }


def limit_json(limit: Limit) -> dict[str, Any]:
    return {"max_gpus": limit.max_gpus, "gpu_hours": limit.gpu_hours, "window_hours": limit.window_hours}


def me_json(
    user: str,
    groups: list[str],
    allowance: Allowance,
    allocations: list[AllocationInfo],
    idle: dict[int, dict] | None = None,
    notices: list[ReclaimInfo] = (),
    preempted: list[PreemptionNotice] = (),
    warnings: tuple[float, ...] = (),
    now: datetime | None = None,
) -> dict:
    """What ``GET me`` answers (and My GPUs shows); ``now``: each time limit says whether its
    first warning time has come (``warned``)."""
    idle = idle or {}
    return {
        "user": user,
        "groups": sorted(groups),
        "limit": {**limit_json(allowance.effective.limit), "source": allowance.effective.source},
        "held": amount(allowance.held),  # in GPUs: a slice is its share
        "may_take": allowance.may_take,
        "fits": allowance.fits,
        "gpu_hours_used": round(allowance.gpu_hours, 4),
        "free": allowance.free,
        "total": allowance.total,
        "allocations": [
            {**allocation_json(a, warnings=warnings), "idle": idle.get(a.id)} | warned(a, warnings, now)
            for a in allocations
        ],
        "reclaimed": [reclaim_json(r) for r in notices],
        "borrow": {
            "allowance": allowance.borrow_allowance,
            "borrowed": allowance.borrowed,
            "may_borrow_now": allowance.may_borrow_now,
            "waiting": allowance.waiting,
        },
        "preempted": [preemption_json(n) for n in preempted],
    }


def preemption_json(n: PreemptionNotice, admin: bool = False) -> dict[str, Any]:
    """A preemption, with when its allocation ended (null while it lives: the notice runs) and
    whether the notice was withdrawn. Whose request it was (``for_user``) is for admins only:
    a user is not told who else waits (docs/borrowing.md)."""
    p = n.preemption
    extra = {"for_user": p.for_user} if admin else {}
    return {
        "id": p.id,
        "allocation_id": p.allocation_id,
        "user": p.user,
        "purpose": p.purpose,
        "server_name": p.server_name,
        "gpus": p.gpus,
        "borrowed": p.borrowed,
        **extra,
        "reason": p.reason,
        "created": iso(p.created),
        "due": iso(p.due),
        "ended": iso(n.ended),
        "withdrawn": iso(p.withdrawn),
        "withdrawn_reason": p.withdrawn_reason,
    }


def limit_entry_json(e: LimitEntry) -> dict[str, Any]:
    return {"scope": e.scope, "name": e.name, "origin": e.origin, **limit_json(e.limit)}


def cluster_json(table: list[GpuStatus]) -> dict[str, Any]:
    nodes: dict[str, list] = {}
    for st in table:
        h = st.holder
        nodes.setdefault(st.gpu.node, []).append(
            {
                "index": st.gpu.index,
                "model": st.gpu.model,
                "memory_mib": st.gpu.memory_mib,
                "uuid": st.gpu.uuid,
                "present": st.present,
                "holder": None
                if h is None
                else {
                    "user": h.user,
                    "allocation_id": h.id,
                    "purpose": h.purpose,
                    "server_name": h.server_name,
                    "since": iso(h.started or h.created),
                    "gpu_count": h.gpu_count,
                    "borrowed": h.borrowed,
                    "preemption": preemption_of(h),
                },
            }
        )
    present = [st for st in table if st.present]
    return {
        "total": len(present),
        "free": sum(1 for st in present if st.holder is None),
        "nodes": [{"name": n, "gpus": gpus} for n, gpus in sorted(nodes.items())],
    }


def usage_json(
    since: datetime,
    until: datetime,
    totals: dict[str, float],
    starts: list[datetime],
    series: dict,
    borrowing: dict[str, dict[str, float]] | None = None,
) -> dict[str, Any]:
    """``borrowing``: ``Ledger.borrowing_totals`` of the period (per user: borrowed GPU-hours,
    preemptions); its users appear in both maps, with 0 where they had none."""
    borrowing = borrowing or {}
    return {
        "since": iso(since),
        "until": iso(until),
        "total": {u: round(h, 4) for u, h in sorted(totals.items())},
        "buckets": [iso(t) for t in starts],
        "series": {u: [round(h, 4) for h in hs] for u, hs in sorted(series.items())},
        "borrowed_gpu_hours": {u: t["borrowed_gpu_hours"] for u, t in sorted(borrowing.items())},
        "preemptions": {u: int(t["preemptions"]) for u, t in sorted(borrowing.items())},
    }


def usage_csv(usage: dict[str, Any]) -> str:
    """``usage_json``'s buckets as CSV, one row per bucket and user: what the chart draws, with
    the bucket's energy where ``usage`` has it (``energy_views.csv_columns``)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    energy = "energy" in usage
    writer.writerow(["bucket_start", "user", "gpu_hours", *(energy_views.CSV_HEADER if energy else [])])
    users = sorted(set(usage["series"]) | set(usage.get("energy", {}).get("series", {})))
    for user in users:
        hours = usage["series"].get(user) or [0.0] * len(usage["buckets"])
        for i, (start, h) in enumerate(zip(usage["buckets"], hours, strict=True)):
            # a name starting with = + - @ would be a formula to a spreadsheet
            shown = "'" + user if user[:1] in ("=", "+", "-", "@") else user
            writer.writerow([start, shown, f"{h:.4f}", *energy_views.csv_columns(usage, user, i)])
    return out.getvalue()


def idle_json(verdict: Verdict | None, now: float) -> dict[str, Any]:
    """An allocation's idle state: ``unknown`` until the broker has judged it."""
    if verdict is None:
        return {
            "state": "unknown",
            "idle_seconds": 0,
            "since": None,
            "reclaim_in_seconds": None,
            "reason": "",
        }
    since = None if verdict.since is None else datetime.fromtimestamp(verdict.since, UTC).replace(tzinfo=None)
    return {
        "state": verdict.state,
        "idle_seconds": round(verdict.idle_seconds, 1),
        # the spell's start, fixed while it lasts (idle_seconds is as of the broker's last look)
        "since": iso(since),
        "reclaim_in_seconds": None
        if verdict.reclaim_at is None
        else round(max(0.0, verdict.reclaim_at - now), 1),
        "reason": verdict.reason,
    }


def reading_json(r: Reading | None) -> dict[str, Any]:
    if r is None:
        return {"utilization": None, "memory_used_mib": None, "memory_total_mib": None, "sampled": None}
    return {
        "utilization": round(r.utilization, 1),
        "memory_used_mib": r.memory_used_mib,
        "memory_total_mib": r.memory_total_mib,
        "sampled": iso(datetime.fromtimestamp(r.t, UTC).replace(tzinfo=None)),
    }


def utilization_json(table: list[GpuStatus], util: Utilization, fresh_for: float) -> dict[str, Any]:
    """The live grid: every GPU with its holder and latest reading; each live allocation
    with its mean utilization and idle state; each user with theirs."""
    now = util.clock()
    gpus, allocations = [], {}
    for st in table:
        h = st.holder
        since = epoch(h.started or h.created) if h else 0.0  # a holder sees only their own time
        latest = util.latest(st.gpu.node, st.gpu.index, fresh_for, since)
        reported = util.latest(st.gpu.node, st.gpu.index, fresh_for, since, reported=True)
        history = [
            [round(r.t - now, 1), round(r.utilization, 1)]
            for r in util.history(st.gpu.node, st.gpu.index, since)[-60:]
        ]
        gpus.append(
            {
                "node": st.gpu.node,
                "index": st.gpu.index,
                "model": st.gpu.model,
                "memory_mib": st.gpu.memory_mib,
                "present": st.present,
                "holder": None
                if h is None
                else {
                    "user": h.user,
                    "allocation_id": h.id,
                    "purpose": h.purpose,
                    "borrowed": h.borrowed,
                    "gpu_count": h.gpu_count,
                    "preemption": preemption_of(h),
                },
                # a GPU held in slices: each slice held and its holder (its readings are the
                # whole GPU's, shared by the slices)
                "slices": [
                    {
                        "part": g.part,
                        "parts": g.parts,
                        "label": g.label,
                        "holder": {"user": h.user, "allocation_id": h.id, "purpose": h.purpose},
                    }
                    for g, h in st.slices
                ],
                **reading_json(latest),
                # the holder's own report, where readings come from gpuhub's sampler instead:
                # shown, never deciding (c.GpuReclaim.readings)
                "reported": None if reported is None else reading_json(reported),
                "history": history,
            }
        )
        if h is not None:
            allocations.setdefault(h.id, h)
        for _g, sh in st.slices:
            allocations.setdefault(sh.id, sh)
    alloc_rows, users = [], {}
    for a in allocations.values():
        since = max(epoch(a.started or a.created), now - util.history_seconds)
        mean = util.mean([(g.node, g.index) for g in a.gpus], since)
        alloc_rows.append(
            {
                "id": a.id,
                "user": a.user,
                "purpose": a.purpose,
                "server_name": a.server_name,
                "gpus": [g.label for g in a.gpus],
                "mean_utilization": None if mean is None else round(mean, 1),
                "idle": idle_json(util.verdicts.get(a.id), now),
                "borrowed": a.borrowed,
                "preemption": preemption_of(a),
            }
        )
        u = users.setdefault(a.user, {"user": a.user, "gpus": 0, "_sum": 0.0, "_n": 0})
        held = a.units if a.slice_parts else len(a.gpus)  # a slice: its share of a GPU
        u["gpus"] += held
        if mean is not None:
            u["_sum"] += mean * held
            u["_n"] += held
    user_rows = [
        {
            "user": u["user"],
            "gpus": amount(u["gpus"]),
            "mean_utilization": round(u["_sum"] / u["_n"], 1) if u["_n"] else None,
        }
        for u in sorted(users.values(), key=lambda u: u["user"])
    ]
    return {
        "gpus": gpus,
        "allocations": sorted(alloc_rows, key=lambda r: r["id"]),
        "users": user_rows,
        "history_seconds": util.history_seconds,
    }


def reclaim_json(r: ReclaimInfo) -> dict[str, Any]:
    return {
        "id": r.id,
        "allocation_id": r.allocation_id,
        "user": r.user,
        "purpose": r.purpose,
        "server_name": r.server_name,
        "gpus": r.gpus,
        "idle_seconds": round(r.idle_seconds, 1),
        "gpu_hours": round(r.gpu_hours, 4),
        "reason": r.reason,
        "created": iso(r.created),
    }


def extension_json(e: ExtensionInfo) -> dict[str, Any]:
    """One extension of a time limit: whose allocation, who asked, when, how much."""
    return {
        "id": e.id,
        "allocation_id": e.allocation_id,
        "user": e.user,
        "by": e.by,
        "at": iso(e.at),
        "seconds": e.seconds,
        "before_seconds": e.before_seconds,
        "after_seconds": e.after_seconds,
    }
