"""A slice's CUDA MPS daemon, run by the server's launcher as the server's own user
(``spawner.singleuser``): started before the server, quit when the server's process ends.

The spawner asks for it with ``GPUHUB_SLICE_MPS=1`` (a slice of a GPU NVML reports), and tells
the slice: ``GPUHUB_SLICE_UUID``, ``GPUHUB_GPU_SLICE`` (``1/4``), ``GPUHUB_GPU_MEMORY_MIB``. The
daemon's pipe and log directories are in the server's private temporary directory (0700, a
random name: :func:`gpu_magics.common.scratch.private_tmpdir`), so no other account reaches it.
The server and everything it starts (kernels, engines) then run as MPS clients held to the
slice's memory and thread share (:func:`spawner.policy.mps.client_env`).

A slice that asked for MPS never runs without it: where the daemon cannot start, the launcher
ends with the reason, and the spawn fails with it (its GPU is given back).
"""

from __future__ import annotations

import atexit
import os
import subprocess
from collections.abc import Callable, MutableMapping

from spawner.policy import mps
from spawner.policy.slices import Offer

START_TIMEOUT = 30.0


class MpsError(RuntimeError):
    """The slice's MPS daemon could not start; the message says why and what to do."""


def slice_offer(environ: MutableMapping[str, str]) -> tuple[str, Offer]:
    """The slice the spawner described: its GPU's UUID and its offer (parts, memory)."""
    try:
        uuid = mps.check_uuid(environ.get("GPUHUB_SLICE_UUID", ""))
        parts = int(environ["GPUHUB_GPU_SLICE"].removeprefix("1/"))
        memory = int(environ["GPUHUB_GPU_MEMORY_MIB"])
    except (KeyError, ValueError) as e:
        raise MpsError(f"the slice's MPS settings from the spawner are incomplete or wrong ({e})") from None
    return uuid, Offer(environ.get("GPUHUB_GPU_MODEL", "GPU"), parts, memory * parts)


def start(
    environ: MutableMapping[str, str], private_dir: str, run=subprocess.run
) -> Callable[[], None] | None:
    """Start the daemon for this server's slice (nothing unless ``GPUHUB_SLICE_MPS=1``), put
    the client's settings into ``environ``, and return what quits it (also run at exit)."""
    if environ.get("GPUHUB_SLICE_MPS") != "1":
        return None
    uuid, offer = slice_offer(environ)
    argv, env = mps.control_start(private_dir, uuid)
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        os.makedirs(env[key], mode=0o700, exist_ok=True)
    try:
        done = run(argv, env={**environ, **env}, capture_output=True, text=True, timeout=START_TIMEOUT)
    except FileNotFoundError:
        raise MpsError(
            f"{mps.CONTROL} is not installed on this node, so this slice cannot be held to its share; "
            "ask an admin to install the NVIDIA driver's MPS tools or to stop splitting this GPU model"
        ) from None
    except subprocess.TimeoutExpired:
        raise MpsError(f"{mps.CONTROL} -d did not return within {START_TIMEOUT:g} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout or "").strip()[-500:]
        raise MpsError(f"{mps.CONTROL} -d failed ({done.returncode}): {said or 'no message'}")
    environ.update(mps.client_env(private_dir, uuid, offer))

    def quit_daemon() -> None:
        argv, env, stdin = mps.control_quit(private_dir, uuid)
        try:
            run(
                argv,
                env={**os.environ, **env},
                input=stdin,
                capture_output=True,
                text=True,
                timeout=START_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired):
            pass  # the daemon ends with the machine's MPS server's last client anyway

    atexit.register(quit_daemon)
    return quit_daemon
