"""What JupyterLab's GPU status bar, panel and notifications show: one document per poll,
made from the broker's answers to this server's own token (``GET me``, ``GET utilization``,
``GET queue``). Pure: no I/O, table-tested (tests/test_lab_status.py).

An *event* is something the researcher is told once, as a JupyterLab notification: a notice
with a deadline (borrowed GPUs taken back, an idle reclaim, a time limit), a reclaim or a
preemption that happened, a wait that ended (its turn came, or it can no longer be served).
Each has a ``key`` that stays the same while it is the same event and changes when it is a new
one (an extension's new end, a new idle spell), so the page can show each once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from gpu_magics.kernel.energy import energy_text
from gpu_magics.kernel.notices import parse_due

RECENT_SECONDS = 600  # what ended (a reclaim, a preemption, a wait) is told for this long


def _epoch(now: datetime) -> float:
    """A naive UTC time (the broker's) as Unix time, whatever the machine's own time zone."""
    return now.replace(tzinfo=UTC).timestamp()


def iso(t: datetime | None) -> str | None:
    return None if t is None else t.replace(microsecond=0).isoformat() + "Z"


def _recent(text: str | None, now: datetime) -> bool:
    return bool(text) and _epoch(now) - parse_due(text) <= RECENT_SECONDS


def _spell(idle: Mapping[str, Any], now: datetime) -> str:
    """One spell of idleness: its start as the broker says it. From an older broker that does
    not, ``idle_seconds`` before ``now`` to the minute (its ``idle_seconds`` are as of its last
    sweep, so a poll near a minute's edge can then tell the same spell twice)."""
    if idle.get("since"):
        return str(idle["since"])
    return str(int((_epoch(now) - float(idle["idle_seconds"])) // 60))


def _gpu_count(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def gpus_with_use(allocation: Mapping[str, Any], util: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The allocation's GPUs, each with its latest reading and recent history (``GET
    utilization``: ``null`` readings where nothing was sampled)."""
    readings = {(g["node"], g["index"]): g for g in util.get("gpus", ())}
    out = []
    for g in allocation.get("gpus", ()):
        r = readings.get((g["node"], g["index"]), {})
        out.append(
            {
                "label": f"{g['node']}:{g['index']}",
                "node": g["node"],
                "index": g["index"],
                "model": g.get("model"),
                "utilization": r.get("utilization"),
                "memory_used_mib": r.get("memory_used_mib"),
                "memory_total_mib": r.get("memory_total_mib") or r.get("memory_mib"),
                "history": r.get("history", []),
            }
        )
    return out


def allocation_view(
    a: Mapping[str, Any], util: Mapping[str, Any], costing: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One allocation of ``GET me`` as the panel shows it; ``energy``: the broker's figures as
    they are (null: nothing measured yet), ``energy_text``: them in words (``costing``: ``GET
    me``'s ``energy``, the facility's numbers)."""
    return {
        "id": a["id"],
        "purpose": a["purpose"],
        "state": a["state"],
        "gpu_count": a.get("gpu_count") or len(a.get("gpus", ())),
        "slice_parts": a.get("slice_parts"),  # a slice of a GPU split in this many parts
        "nodes": a.get("nodes", []),
        "borrowed": a.get("borrowed", 0),
        "started": a.get("started"),
        "lease_expires": a.get("lease_expires"),
        "idle": a.get("idle"),
        "preemption": a.get("preemption"),
        "time_limit": a.get("time_limit"),
        "gpus": gpus_with_use(a, util),
        "energy": a.get("energy"),
        "energy_text": energy_text(a.get("energy"), (costing or {}).get("pue")),
    }


def summary(
    server: dict | None, pools: list[dict], queue: list[dict], kernel_pools: list[dict] = ()
) -> dict[str, Any]:
    """The status bar's words: this server's GPUs (count and model), their mean use now, and
    markers for borrowed GPUs, a running ``%%distributed`` pool (its ranks and burst GPUs) and
    a waiting burst's place."""
    gpus = server["gpus"] if server else []
    models = sorted({g["model"] for g in gpus if g.get("model")})
    read = [g for g in gpus if g["utilization"] is not None]
    mean = round(sum(g["utilization"] for g in read) / len(read)) if read else None
    memory = sum(g["memory_used_mib"] or 0 for g in read) if read else None
    parts = (server or {}).get("slice_parts")
    amount = f"1/{parts} GPU" if parts else _gpu_count(len(gpus))  # a slice: its share of the GPU
    words = [amount + (f" {' + '.join(models)}" if models else "")]
    if gpus:
        words.append("no reading yet" if mean is None else f"{mean} %")
        if memory is not None:
            words.append(f"{memory / 1024:.1f} GiB" if memory >= 1024 else f"{memory} MiB")
    markers = []
    borrowed = sum(a["borrowed"] for a in ([server] if server else []) + pools)
    if borrowed:
        markers.append(f"{borrowed} borrowed")
    burst = sum(a["gpu_count"] for a in pools)
    ranks = sum(1 for p in kernel_pools for r in p.get("ranks", ()) if r.get("state") != "gone")
    if ranks:
        markers.append(
            f"pool: {ranks} rank{'s' if ranks != 1 else ''}" + (f", {burst} burst" if burst else "")
        )
    elif burst:
        markers.append(f"pool: {_gpu_count(burst)} more")
    for q in queue:
        markers.append(f"queue: {q['position']} of {q['waiting']}")
    return {
        "gpus": len(gpus),
        "models": models,
        "utilization": mean,
        "memory_used_mib": memory,
        "text": " · ".join(words + markers),
        "markers": markers,
    }


def _were(why: str) -> str:
    """``"2 borrowed GPUs taken back ..."`` as what happened: ``"... were taken back ..."``."""
    return why.replace(" taken back", " was taken back" if why.startswith("1 ") else " were taken back", 1)


def _taken_why(borrowed: int, gpus: int) -> str:
    """Why a notice takes GPUs back, in a few words (its full reason is in the panel)."""
    if borrowed:
        return f"{_gpu_count(borrowed).replace('GPU', 'borrowed GPU')} taken back for a waiting request"
    return f"{_gpu_count(gpus)} that started ahead of a waiting request taken back at its turn"


def events(
    me: Mapping[str, Any],
    ended_waits: Iterable[Mapping[str, Any]],
    server_name: str,
    now: datetime,
) -> list[dict[str, Any]]:
    """What the researcher is told now (see the module's docstring), oldest notice first.

    Each event: ``key``, ``kind``, ``level``, ``title`` and ``message`` (together short: a
    notification shows about 140 characters), ``deadline`` (ISO time or null), ``past`` (what
    happened, said when the server is gone: why it stopped) and ``detail`` (the broker's full
    words)."""
    out: list[dict[str, Any]] = []

    def what(purpose: str, name: str, allocation_id: int) -> str:
        if purpose == "server":
            return "This server" if name == server_name else f"Your server {name!r}"
        return f"The %%distributed burst #{allocation_id}"

    for p in me.get("preempted", ()):
        if p.get("withdrawn"):
            continue
        target = what(p["purpose"], p["server_name"], p["allocation_id"])
        why = _taken_why(p["borrowed"], p["gpus"])
        if p.get("ended") is None:
            after = "Save your work now." if p["purpose"] == "server" else "With --autosave it saves first."
            out.append(
                {
                    "key": f"preempt:{p['id']}",
                    "kind": "preemption",
                    "level": "warning",
                    "title": f"{target} stops",
                    "message": f"{why}. {after}",
                    "deadline": p["due"],
                    "past": _were(why),
                    "detail": p["reason"],
                }
            )
        elif _recent(p["ended"], now):
            out.append(
                {
                    "key": f"preempted:{p['id']}",
                    "kind": "preempted",
                    "level": "error",
                    "title": f"{target} stopped",
                    "message": f"{why}.",
                    "deadline": None,
                    "past": _were(why),
                    "detail": p["reason"],
                }
            )
    for a in me.get("allocations", ()):
        target = what(a["purpose"], a["server_name"], a["id"])
        idle = a.get("idle") or {}
        if idle.get("state") == "warned" and idle.get("reclaim_in_seconds") is not None:
            due = _epoch(now) + float(idle["reclaim_in_seconds"])
            n = len(a["gpus"])
            out.append(
                {
                    "key": f"idle:{a['id']}:{_spell(idle, now)}",
                    "kind": "idle",
                    "level": "warning",
                    "title": f"{_gpu_count(n)} of {target.lower() if a['purpose'] == 'server' else target} "
                    "taken back for idleness",
                    "message": "Run something on it to keep it."
                    if n == 1
                    else "Run something on them to keep them.",
                    "deadline": iso(datetime.fromtimestamp(due, UTC).replace(tzinfo=None)),
                    "past": f"its {_gpu_count(n)} sat idle and were taken back",
                    "detail": idle.get("reason") or "",
                }
            )
        limit = a.get("time_limit") or {}
        if limit.get("warned"):
            out.append(
                {
                    "key": f"time:{a['id']}:{limit['ends']}",
                    "kind": "time",
                    "level": "warning",
                    "title": f"{target} reaches its time limit",
                    "message": "Save your work; more time: My GPUs or %gpus --extend.",
                    "deadline": limit["ends"],
                    "past": "it reached its time limit",
                    "detail": f"time limit {limit.get('seconds', 0) / 3600:g} h, ending {limit['ends']}",
                }
            )
    for r in me.get("reclaimed", ()):
        if _recent(r.get("created"), now):
            target = what(r["purpose"], r["server_name"], r["allocation_id"])
            out.append(
                {
                    "key": f"reclaimed:{r['id']}",
                    "kind": "reclaimed",
                    "level": "error",
                    "title": f"{target} stopped",
                    "message": f"Its {_gpu_count(r['gpus'])} sat idle and were taken back.",
                    "deadline": None,
                    "past": f"its {_gpu_count(r['gpus'])} sat idle and were taken back",
                    "detail": r["reason"],
                }
            )
    for e in ended_waits:
        granted = e.get("state") == "granted"
        out.append(
            {
                "key": f"wait:{e['id']}",
                "kind": "turn" if granted else "wait-ended",
                "level": "success" if granted else "warning",
                "title": f"Your wait for {_gpu_count(e['gpus'])} "
                + ("is over: your turn came" if granted else "ended"),
                "message": (
                    f"Allocation #{e['allocation_id']} holds them."
                    if granted
                    else (e.get("end_reason") or "It no longer waits.")
                ),
                "deadline": None,
                "past": None,
                "detail": e.get("end_reason") or "",
            }
        )
    return out


def saves(kernel_pools: Iterable[Mapping[str, Any]]) -> str:
    """What the pools' ``--autosave`` saves before they stop, and where ("" when none does)."""
    said = [
        f"{', '.join(p['autosave']['names'])} to {p['autosave']['dir']}"
        for p in kernel_pools
        if p.get("autosave")
    ]
    return f"--autosave saves {'; '.join(said)} first." if said else ""


def with_autosave(found: list[dict], kernel_pools: list[dict]) -> list[dict]:
    """A notice that stops a pool says what its autosave keeps (in the event's detail)."""
    words = saves(kernel_pools)
    if not words:
        return found
    return [
        e | {"detail": f"{e['detail']} {words}".strip()} if e["kind"] in ("preemption", "idle", "time") else e
        for e in found
    ]


def document(
    me: Mapping[str, Any],
    util: Mapping[str, Any],
    queue: Iterable[Mapping[str, Any]],
    ended_waits: Iterable[Mapping[str, Any]],
    server_name: str,
    now: datetime,
    kernel_pools: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The whole answer of ``GET gpuhub/api/status`` (see ``docs/jupyterlab.md``);
    ``kernel_pools``: what this server's kernels say of their pools (``common.poolstatus``)."""
    kernel_pools = [dict(p) for p in kernel_pools]
    mine = [a for a in me.get("allocations", ()) if a.get("server_name", "") == server_name]
    costing = me.get("energy")
    server = next((allocation_view(a, util, costing) for a in mine if a["purpose"] == "server"), None)
    pools = [allocation_view(a, util, costing) for a in mine if a["purpose"] == "distributed"]
    waiting = [
        {
            "id": q["id"],
            "gpus": q["gpus"],
            "purpose": q["purpose"],
            "position": q["position"],
            "waiting": q["waiting"],
            "line": q.get("line"),
        }
        for q in queue
        if q.get("state") == "waiting" and q.get("server_name", "") == server_name
    ]
    return {
        "available": True,
        "user": me.get("user"),
        "server_name": server_name,
        "now": iso(now),
        "server": server,
        "pools": pools,
        "queue": waiting,
        "limit": me.get("limit"),
        "held": me.get("held"),
        "may_take": me.get("may_take"),
        "borrow": me.get("borrow"),
        "gpu_hours_used": me.get("gpu_hours_used"),
        "energy": costing,
        "history_seconds": util.get("history_seconds"),
        "kernel_pools": kernel_pools,
        "summary": summary(server, pools, waiting, kernel_pools),
        "events": with_autosave(events(me, ended_waits, server_name, now), kernel_pools),
    }


def unavailable(reason: str) -> dict[str, Any]:
    """The answer while the broker cannot be asked: the page shows it, never an exception."""
    return {"available": False, "reason": reason, "summary": {"text": "GPU status unavailable"}, "events": []}
