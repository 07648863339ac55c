"""Code that runs inside each engine (imported there by ipyparallel, never in the kernel).

``setup_rank`` pins the rank's GPU *before* torch touches CUDA, starts a watchdog that ends
the engine when the notebook kernel is gone (engines run in their own session and would
otherwise outlive a killed kernel), and initialises the default process group on a
rendezvous that only the owner can reach (``engine.rendezvous``). What an engine sends back per
cell is what the kernel shows (``quiet_cells``), and its output streams wait for the IOPub
thread only when they hold output (``gate_flushes``).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from gpu_magics.common.procs import alive
from gpu_magics.engine.recovery import init_group, start_freer
from gpu_magics.engine.rendezvous import group_store


def _watch(kernel_pid: int, interval: float = 1.0) -> None:
    while alive(kernel_pid):  # a zombie kernel counts as gone
        time.sleep(interval)
    os._exit(0)


def pin_to_gpu(label: str) -> bool:
    """Run this process on the CPUs nearest its GPU (NVML's affinity, as dask-cuda does),
    within the CPUs it may use. False where NVML cannot tell (no GPU, simulated GPUs)."""
    if not label or os.environ.get("GPUHUB_GPU_SOURCE") == "simulated":
        return False
    from gpu_magics.report.gpustats import NvmlSource, NvmlUnavailable, parse_label

    try:
        source = NvmlSource()
    except NvmlUnavailable:
        return False
    try:
        near = set(source.cpu_affinity(parse_label(label)[1]))
    except Exception:  # an NVML without affinity support: leave the scheduler alone
        return False
    finally:
        source.close()
    chosen = near & os.sched_getaffinity(0)
    if not chosen:
        return False
    os.sched_setaffinity(0, chosen)
    return True


def quiet_cells(shell, rank: int) -> None:
    """What an engine sends back per cell is only what the kernel shows: its output, its reply,
    and rank 0's result. Not the cell's code (ipykernel echoes every cell on IOPub as
    ``execute_input``; nothing reads it), nor another rank's result, which is kept (``_``,
    ``Out``) but neither formatted nor sent (no message, so no flushes to order before it).
    Together about 1.5 ms of a trivial cell's 9 ms on 4 ranks sharing 2 cores (measured)."""
    kernel = getattr(shell, "kernel", None)
    if kernel is not None and hasattr(kernel, "_publish_execute_input"):
        kernel._publish_execute_input = lambda code, parent, count: None
    if rank != 0:
        hook = shell.displayhook  # still sets _ and Out (update_user_ns)
        hook.msg = None
        hook.start_displayhook = hook.finish_displayhook = lambda: None
        hook.compute_format_data = lambda result: ({}, {})


def lift_log_levels(*loggers) -> None:
    """Each logger's level raised to the lowest level of its handlers, so that a record none of
    them would write is never built. ipyparallel's engine (a traitlets application) sets its
    logger to DEBUG and filters in the handler (``--log-level``, WARNING in gpuhub's engines,
    ``engine.main``): its debug calls per message (the whole reply, among them) each made a
    record only to drop it."""
    import logging

    for log in loggers:
        if not isinstance(log, logging.Logger) or not log.handlers:
            continue
        lowest = min(h.level for h in log.handlers)
        if lowest > log.level:
            log.setLevel(lowest)


class _FlushGate:
    """An output stream's ``flush`` that costs nothing when there is nothing to send.

    ipykernel's ``OutStream.flush`` hands the send to the IOPub thread and waits until it is
    done: a round trip between threads, and ipykernel flushes stdout and stderr four times per
    cell (before the reply, after the handler), the displayhook twice more, so 4 to 6 thread
    hand-overs per engine for a cell that printed nothing (0.6 to 1.7 ms of waiting per cell,
    4 ranks on 2 cores, measured). The round trip is skipped only when the stream's buffers are
    empty and no send of the stream's (``_flush``, which takes the buffers under their lock) is
    under way: then everything written before has gone out already, and ``flush`` keeps its
    promise. Writes are not counted: whoever wraps ``write`` (IPython tees it in every cell),
    what is written lands in those buffers."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.sending = 0
        self.flush, self.send = stream.flush, stream._flush  # the stream's own, bound

    def counted_send(self):
        with self.stream._buffer_lock:
            self.sending += 1
        try:
            return self.send()
        finally:
            with self.stream._buffer_lock:
                self.sending -= 1

    def gated_flush(self, *args, **kwargs):
        with self.stream._buffer_lock:
            nothing = not self.stream._buffers and not self.sending
        if nothing:
            return None
        return self.flush(*args, **kwargs)


def gate_flushes(*streams) -> int:
    """Install :class:`_FlushGate` on each of ``streams`` that is ipykernel's ``OutStream`` with
    the parts it relies on (an engine's ``sys.stdout`` and ``sys.stderr``); the number gated."""
    try:
        from ipykernel.iostream import OutStream
    except ImportError:
        return 0
    gated = 0
    for stream in streams:
        if not isinstance(stream, OutStream) or "_gpuhub_gate" in vars(stream):
            continue
        if not all(hasattr(stream, name) for name in ("_buffers", "_buffer_lock", "_flush")):
            continue  # an ipykernel whose stream works otherwise: leave its flush alone
        gate = stream._gpuhub_gate = _FlushGate(stream)
        stream.flush, stream._flush = gate.gated_flush, gate.counted_send
        gated += 1
    return gated


def setup_rank(env: dict, backend: str | None, timeout_s: float, kernel_pid: int, rendezvous: dict) -> dict:
    os.environ.update(env)
    pinned = pin_to_gpu(env.get("GPUHUB_RANK_GPU", ""))  # before torch starts its threads
    burst = int(env.get("GPUHUB_REPORT_ALLOCATION") or 0)
    if burst:
        from gpu_magics.report.reporter import start_burst_reporter

        start_burst_reporter(burst, env.get("GPUHUB_RANK_GPU", ""))
    if int(env.get("LOCAL_WORLD_SIZE", "1")) > 1:
        # as torchrun does: one OpenMP thread per rank unless the user chose otherwise, or
        # several ranks on one machine fight over its cores (5x slower measured here)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    if kernel_pid:  # 0: the kernel is on another machine (Slurm ends those engines' job)
        threading.Thread(target=_watch, args=(kernel_pid,), daemon=True, name="gpuhub-watchdog").start()
    import torch
    import torch.distributed as dist

    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(0)  # the one GPU CUDA_VISIBLE_DEVICES leaves visible
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    freer = start_freer()  # SIGUSR1 (blocked since the engine started) frees a stuck collective
    init_group(
        backend, group_store(rendezvous, env, timeout_s), int(env["RANK"]), int(env["WORLD_SIZE"]), timeout_s
    )

    from IPython import get_ipython

    shell = get_ipython()
    quiet_cells(shell, dist.get_rank())
    gate_flushes(sys.stdout, sys.stderr)
    import logging

    lift_log_levels(getattr(getattr(shell, "kernel", None), "log", None), logging.getLogger("IPEngine"))
    ns = shell.user_ns
    ns.update(
        device=device,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(env["LOCAL_RANK"]),
        dist=dist,
        torch=torch,
    )
    return {
        "rank": dist.get_rank(),
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "backend": backend,
        "device": str(device),
        "gpu": env.get("GPUHUB_RANK_GPU", ""),
        "cpus": sorted(os.sched_getaffinity(0)),
        "pinned": pinned,
        "freer": freer,  # SIGUSR1 gets this rank out of a stuck collective
    }
