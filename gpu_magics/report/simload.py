"""Simulated GPUs that move: each GPU's use read from the processes bound to it.

A machine without GPUs (the demo) still runs real kernels and engines on its simulated GPUs,
and each process knows its GPUs as on a GPU machine: a server and its kernels by
``GPUHUB_GPUS`` (``node:index,...``), a ``%%distributed`` rank by ``GPUHUB_RANK_GPU`` (its one
GPU; it inherits its kernel's ``GPUHUB_GPUS`` too, and the rank's own wins). Here a simulated GPU's
utilization is the CPU time its processes used in the last period (one CPU-second per second
is 100 %), and its memory their resident memory; a process bound to several GPUs counts
equally on each. So a busy cell makes its GPUs busy, an idle kernel leaves them idle, and the
live grid, the charts and the idle reclaim can be watched working.

Only processes whose ``/proc/PID/environ`` the reader may read count: every process for
root (the demo's broker samples as root), a user's own otherwise. Real GPUs read NVML.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcessReading:
    gpus: tuple[str, ...]  # the labels (node:index) of the GPUs it is bound to
    cpu_seconds: float  # user and system time since it started
    rss_mib: float


def gpus_of(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The GPUs a process is bound to: a rank's own, else its server's; none without either."""
    value = environ.get("GPUHUB_RANK_GPU") or environ.get("GPUHUB_GPUS") or ""
    return tuple(p for p in (part.strip() for part in value.split(",")) if p)


def gpu_load(
    before: Mapping[int, ProcessReading], after: Mapping[int, ProcessReading], seconds: float
) -> dict[str, tuple[float, float]]:
    """Per GPU label, ``(utilization percent, memory MiB)`` over ``seconds`` between two
    readings of the processes (by pid). A process not in ``before`` (just started) adds its
    memory but no utilization yet; utilization is capped at 100."""
    load: dict[str, list[float]] = {}
    for pid, p in after.items():
        if not p.gpus:
            continue
        was = before.get(pid)
        busy = 0.0
        if was is not None and seconds > 0:
            busy = max(0.0, p.cpu_seconds - was.cpu_seconds) / seconds * 100
        share = len(p.gpus)
        for label in p.gpus:
            row = load.setdefault(label, [0.0, 0.0])
            row[0] += busy / share
            row[1] += p.rss_mib / share
    return {label: (min(100.0, util), mem) for label, (util, mem) in load.items()}


def read_process(pid_dir: Path, hub: str | None = None) -> ProcessReading | None:
    """One process's binding, CPU time and memory; None when it is not bound to a GPU, is
    gone, is not ours to read, or (``hub``: a simulated GPUs' file) runs on another hub's
    simulated GPUs (a server and what it starts carry their hub's ``GPUHUB_SIMULATED_GPU_STATS``:
    two hubs on one machine have the same GPU names)."""
    try:
        environ = (pid_dir / "environ").read_bytes()
    except OSError:
        return None
    wanted = {}
    for item in environ.split(b"\0"):
        name, _, value = item.partition(b"=")
        if name in (b"GPUHUB_RANK_GPU", b"GPUHUB_GPUS", b"GPUHUB_SIMULATED_GPU_STATS"):
            wanted[name.decode()] = value.decode(errors="replace")
    gpus = gpus_of(wanted)
    if not gpus or (hub is not None and wanted.get("GPUHUB_SIMULATED_GPU_STATS") != hub):
        return None
    try:
        stat = (pid_dir / "stat").read_text()
        status = (pid_dir / "status").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    cpu = (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14 and 15)
    rss_kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return ProcessReading(gpus, cpu, rss_kib / 1024)


def read_processes(proc: str | os.PathLike = "/proc", hub: str | None = None) -> dict[int, ProcessReading]:
    """Every readable process bound to a GPU (of ``hub``'s, see :func:`read_process`), by pid."""
    found = {}
    for entry in Path(proc).iterdir():
        if entry.name.isdigit():
            reading = read_process(entry, hub)
            if reading is not None:
                found[int(entry.name)] = reading
    return found
