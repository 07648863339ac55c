"""CUDA MPS for slices on the local backend (pure): the command lines and environments that
give each slice of a GPU its memory limit and its part of the compute. The server's launcher
runs them (``spawner.mps_run``); here they are built, so that what a slice gets is table-tested
without a GPU.

How MPS is shared, and why one control daemon per user and GPU: an MPS control daemon serves
one Unix user at a time. A client of another user waits until the running MPS server's clients
have all ended (NVIDIA's ``nvidia-cuda-mps-control(1)``). Students are separate accounts, so
each (user, GPU) gets a daemon of its own, started as that user, whose pipe directory is in a
0700 directory of that user's: no other account can reach it. One user's slices on a GPU share
that user's MPS server; different users' servers share the GPU by time-slicing, each client
held to its memory limit (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and its active thread
percentage (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``). What this does not fence: one fault domain
per MPS server (a fatal fault in one client ends the others of that server), and the GPU's
compute mode must stay DEFAULT so that several users' servers can hold contexts at once.
"""

from __future__ import annotations

import re

from spawner.policy.slices import Offer

CONTROL = "nvidia-cuda-mps-control"
_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]{1,80}")


def check_uuid(uuid: str) -> str:
    """A GPU's UUID as NVML gives it (``GPU-…`` or ``MIG-…``); ``ValueError`` otherwise (it
    names a directory and goes into an environment: nothing else may pass)."""
    if not isinstance(uuid, str) or not _UUID.fullmatch(uuid):
        raise ValueError(f"not a GPU UUID as NVML gives it (GPU-… or MIG-…): {uuid!r}")
    return uuid


def pipe_dir(private_dir: str, uuid: str) -> str:
    """The MPS pipe directory of one user's daemon for one GPU, inside ``private_dir`` (the
    user's own 0700 runtime directory: never a predictable shared ``/tmp`` name)."""
    return f"{private_dir.rstrip('/')}/mps-{check_uuid(uuid)}/pipe"


def log_dir(private_dir: str, uuid: str) -> str:
    return f"{private_dir.rstrip('/')}/mps-{check_uuid(uuid)}/log"


def control_start(private_dir: str, uuid: str) -> tuple[list[str], dict[str, str]]:
    """The command that starts the daemon for one GPU (run as the user), and its environment:
    only that GPU visible, by UUID (MPS renumbers devices, so indices would mislead)."""
    env = {
        "CUDA_VISIBLE_DEVICES": check_uuid(uuid),
        "CUDA_MPS_PIPE_DIRECTORY": pipe_dir(private_dir, uuid),
        "CUDA_MPS_LOG_DIRECTORY": log_dir(private_dir, uuid),
    }
    return [CONTROL, "-d"], env


def control_quit(private_dir: str, uuid: str) -> tuple[list[str], dict[str, str], str]:
    """The command, environment and standard input that stop the daemon (and its server) once
    the user's last slice on the GPU has ended."""
    env = {"CUDA_MPS_PIPE_DIRECTORY": pipe_dir(private_dir, uuid)}
    return [CONTROL], env, "quit\n"


def client_env(private_dir: str, uuid: str, offer: Offer) -> dict[str, str]:
    """What a slice's server (and everything it starts) runs with: its GPU through the user's
    daemon, held to the slice's memory and its part of the compute. The one visible device is
    ordinal 0, which the memory limit names."""
    if offer.memory_mib is None:
        raise ValueError(
            f"the memory of a {offer.model} GPU is not known, so a slice's limit cannot be set: "
            "the inventory must give memory_mib for GPUs that are split"
        )
    return {
        "CUDA_VISIBLE_DEVICES": check_uuid(uuid),
        "CUDA_MPS_PIPE_DIRECTORY": pipe_dir(private_dir, uuid),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={offer.memory_mib}M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(offer.thread_percent),
    }
