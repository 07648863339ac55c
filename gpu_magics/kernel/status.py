"""``%gpus`` (:class:`GpuMagics`): what this session holds, and the use of the user's GPUs
(:func:`describe_use`, pure): the latest reading of each and any idle warning, which
allocations hold borrowed GPUs and any notice that they are taken back, from the broker's
``me`` and ``utilization`` answers; and the energy this session used so far
(:mod:`gpu_magics.kernel.energy`)."""

from __future__ import annotations

import os

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class

from gpu_magics.common import words
from gpu_magics.common.session import describe, server_gpus
from gpu_magics.common.words import stamp
from gpu_magics.kernel import energy
from gpu_magics.kernel.broker import BrokerClient, BrokerError
from gpu_magics.kernel.burst import burst_size
from gpu_magics.kernel.notices import parse_due, taken, taken_back
from spawner.policy.extensions import parse_duration
from spawner.policy.values import BadValue


def _minutes(seconds: float | None) -> str:
    s = seconds or 0
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min"


def notice_text(a: dict, notice: dict) -> str:
    """The broker's preemption notice of allocation ``a``, said once, at a UTC clock time."""
    n = int(a.get("borrowed") or 0) or burst_size(a)
    what = taken(int(a.get("borrowed") or 0), burst_size(a))
    return taken_back(what, n, a["id"], parse_due(notice.get("due")), notice.get("reason"))


def time_limit_text(allocation_id: int, limit: dict) -> str:
    """``allocation #3 ends at 2026-12-04 23:00:00 UTC (its time limit, 8 h)``."""
    hours = words.duration(limit["seconds"])
    return f"allocation #{allocation_id} ends at {stamp(parse_due(limit['ends']))} (its time limit, {hours})."


def extended_text(answer: dict) -> str:
    """The broker's answer to an extension, said in one line."""
    ext, limit = answer["extension"], answer["time_limit"]
    return (
        f"Extended allocation #{answer['id']} by {words.duration(ext['seconds'])}: it now ends at "
        f"{stamp(parse_due(limit['ends']))} (its time limit, {words.duration(limit['seconds'])})."
    )


def describe_use(me: dict, grid: dict) -> str:
    lines = []
    readings = {(g["node"], g["index"]): g for g in grid.get("gpus", [])}
    for a in me.get("allocations", []):
        what = "server" if a["purpose"] == "server" else "burst"
        if a.get("borrowed"):
            what += f", {a['borrowed']} borrowed"
        for g in a.get("gpus", []):
            r = readings.get((g["node"], g["index"]), {})
            if r.get("utilization") is None:
                use = "no recent report"
            else:
                total = f"/{r['memory_total_mib']}" if r.get("memory_total_mib") else ""
                use = f"{r['utilization']:.0f}% busy, {r['memory_used_mib']}{total} MiB"
            lines.append(f"  {g['node']}:{g['index']:<4} {use:<34} allocation #{a['id']} ({what})")
        idle = a.get("idle") or {}
        if idle.get("state") == "warned":
            when = idle.get("reclaim_in_seconds")
            tail = (
                f"it will be reclaimed in {_minutes(when)} unless its GPUs are used."
                if when is not None
                else "its owner is warned only (servers are not stopped here)."
            )
            lines.append(f"  WARNING: allocation #{a['id']}: {idle.get('reason')}; {tail}")
        notice = a.get("preemption")
        if notice:
            lines.append("  NOTICE: " + notice_text(a, notice))
        limit = a.get("time_limit")
        if limit:
            lines.append(f"  TIME: {time_limit_text(a['id'], limit)}")
    for r in me.get("reclaimed", []):
        name = f" {r['server_name']!r}" if r.get("server_name") else ""
        lines.append(f"  Your server{name} was reclaimed at {stamp(parse_due(r['created']))}: {r['reason']}.")
    return "\n".join(["GPU use (latest reports):", *lines]) if lines else ""


@magics_class
class GpuMagics(Magics):
    def __init__(self, shell, distributed):
        super().__init__(shell=shell)
        self.distributed = distributed

    @line_magic
    def gpus(self, line: str = ""):
        """Show the GPUs this session holds: the server's, and the %%distributed pool's.
        ``%gpus --extend 2h``: ask for more time on each of them that has a time limit."""
        words_ = line.split()
        if words_[:1] == ["--extend"] and len(words_) in (2, 3):
            return self._extend(" ".join(words_[1:]))
        if line.strip():
            raise UsageError(
                f"%gpus takes no arguments (got {line.strip()!r}) but --extend LENGTH: it shows every GPU "
                "this session holds.\nusage: %gpus   (the engines alone: %distributed status; Dask: "
                "%dask_cuda status)\n       %gpus --extend 2h   (more time: 2h, 90min or 1.5 hours)"
            )
        print(describe(server_gpus()))
        d = self.distributed
        if d.pool is not None or d.burst is not None:
            print()
            print(d.describe().split("\n", 1)[1])
        client = BrokerClient.from_env()
        if client is not None:  # how busy the user's GPUs are, any idle warning, the energy used
            used = ""
            try:
                started = energy.server_started()
                name = os.environ.get("JUPYTERHUB_SERVER_NAME", "")
                me = client.me(session=(name, started) if started else None)
                use = describe_use(me, client.utilization())
                used = self._energy(me)
            except BrokerError as e:
                use = f"(GPU use unknown: {e.message})"
            if use:
                print()
                print(use)
            if used:
                print()
                print(used)

    def _energy(self, me: dict) -> str:
        """``This session so far: ...``: the energy of the server's allocation and its kernels'
        bursts (:func:`gpu_magics.kernel.energy.session_line`)."""
        ids = [server_gpus().allocation_id] if server_gpus().allocation_id else []
        burst = self.distributed.lifecycle.burst
        ids += [p.id for p in (burst.parts if burst is not None else ())]
        return energy.session_line(me, os.environ.get("JUPYTERHUB_SERVER_NAME", ""), ids)

    def _extend(self, raw: str) -> None:
        """``%gpus --extend LENGTH``: each of this session's time-limited allocations (the
        server's, the pool's burst) asks the broker for ``LENGTH`` more; each answer said."""
        try:
            hours = parse_duration(raw)
        except BadValue as e:
            raise UsageError(str(e)) from None
        client = BrokerClient.from_env()
        if client is None:
            raise UsageError(
                "%gpus --extend needs the gpuhub broker: this kernel was not started by the hub."
            )
        ids = [server_gpus().allocation_id] if server_gpus().allocation_id else []
        burst = self.distributed.lifecycle.burst
        ids += [p.id for p in (burst.parts if burst is not None else ()) if not (p.released or p.lost)]
        if not ids:
            raise UsageError("This session holds no GPUs: there is no time limit to extend.")
        refused = []
        for allocation_id in ids:
            try:
                print(extended_text(client.extend(allocation_id, hours)))
            except BrokerError as e:
                refused.append(f"allocation #{allocation_id}: {e.message}")
        self.distributed.lifecycle.timeleft.refresh()  # the pool's warnings move with its end
        if refused:
            raise UsageError("Not extended: " + "\n".join(refused))
