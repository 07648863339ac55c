"""JSON shapes of the broker's API (documented in openapi.yaml): pure functions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ..ledger import AllocationInfo, Allowance, GpuStatus, LimitEntry
from ..policy import Limit


def iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat(timespec="seconds") + "Z"


def allocation_json(a: AllocationInfo) -> dict[str, Any]:
    return {
        "id": a.id,
        "user": a.user,
        "purpose": a.purpose,
        "server_name": a.server_name,
        "state": a.state,
        "created": iso(a.created),
        "started": iso(a.started),
        "ended": iso(a.ended),
        "end_reason": a.end_reason,
        "lease_expires": iso(a.lease_expires),
        "backend": a.backend,
        "backend_job_id": a.backend_job_id,
        "nodes": list(a.nodes),
        "gpus": [{"node": g.node, "index": g.index, "model": g.model} for g in a.gpus],
        "gpu_count": a.gpu_count,
    }


def limit_json(limit: Limit) -> dict[str, Any]:
    return {"max_gpus": limit.max_gpus, "gpu_hours": limit.gpu_hours, "window_hours": limit.window_hours}


def me_json(user: str, groups: list[str], allowance: Allowance, allocations: list[AllocationInfo]) -> dict:
    return {
        "user": user,
        "groups": sorted(groups),
        "limit": {**limit_json(allowance.effective.limit), "source": allowance.effective.source},
        "held": allowance.held,
        "may_take": allowance.may_take,
        "fits": allowance.fits,
        "gpu_hours_used": round(allowance.gpu_hours, 4),
        "free": allowance.free,
        "total": allowance.total,
        "allocations": [allocation_json(a) for a in allocations],
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
    since: datetime, until: datetime, totals: dict[str, float], starts: list[datetime], series: dict
) -> dict[str, Any]:
    return {
        "since": iso(since),
        "until": iso(until),
        "total": {u: round(h, 4) for u, h in sorted(totals.items())},
        "buckets": [iso(t) for t in starts],
        "series": {u: [round(h, 4) for h in hs] for u, hs in sorted(series.items())},
    }
