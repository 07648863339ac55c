"""What a Slurm pool's kernel asks each engine about itself, run there by ``apply_async``
(``launch.slurm.SlurmLauncher.place``): where the engine's task runs (``engine_facts``) and, on
rank 0's engine, a free port of its node (``free_port``). Standard library only.
"""

from __future__ import annotations

import os
import socket


def engine_facts() -> dict:
    """Where this engine's Slurm task runs: its node, local id, its step's GPUs, its
    ``CUDA_VISIBLE_DEVICES``, host name, pid, job and step (``launch.slurm.EngineFacts``)."""
    env = os.environ
    gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or ""
    return {
        "node": env.get("SLURMD_NODENAME") or socket.gethostname(),
        "local_id": int(env.get("SLURM_LOCALID", "0")),
        "gpus": [int(g) for g in gpus.split(",") if g.strip().isdigit()],
        "cuda": [c for c in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if c],
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": env.get("SLURM_JOB_ID", ""),
        "step": env.get("SLURM_STEP_ID", ""),
    }


def free_port() -> int:
    """Runs on rank 0's engine: a port free on its node for the process group."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
