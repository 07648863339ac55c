"""Where a user's kernels and pools listen: Unix sockets in directories only their owner can
enter, never a TCP port another account can reach.

- **Kernels** (a server extension, ``--ServerApp.jpserver_extensions=gpu_magics.common.channels=True``,
  which gpuhub's spawners pass with ``--KernelManager.transport=ipc``): every kernel the server
  starts uses ZeroMQ's ``ipc`` transport, its connection file and sockets in the user's Jupyter
  runtime directory (0700) or, where that is not private or its path is too long for a socket's
  name, in a new private directory (:func:`socket_dir`). The extension sets
  ``GPUHUB_KERNEL_TRANSPORT=ipc`` for the kernels, and the "Python 3 (GPUs)" kernel
  (``python -m gpu_magics.kernel``) refuses to start over TCP where it is set.
- **Pools** (``launch.local.LocalLauncher``): the ipyparallel controller of a ``%%distributed`` pool
  on one host binds Unix sockets in a private directory made by :func:`socket_dir`; every pool
  also runs with ipyparallel's CurveZMQ (:data:`CONTROLLER_ARGS`), so a socket without its
  owner's keys (the connection files, 0700) gets nothing: the TCP ones of a pool across hosts
  (``launch.slurm.SlurmLauncher``) and each engine's own loopback ones (its nanny, its heartbeat
  monitor) alike. Other ipyparallel clusters started from the server or its kernels get
  CurveZMQ by default too (``IPP_ENABLE_CURVE=1`` in the server's environment).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import stat
import tempfile

from gpu_magics.common.scratch import make_private, why_not_private

# the longest path a Unix socket can have on Linux (sun_path is 108 bytes with its NUL)
SUN_PATH_MAX = 107
TRANSPORT_ENV = "GPUHUB_KERNEL_TRANSPORT"
# a kernel's sockets: <dir>/kernel-<uuid>-ipc-<n>, n 1..5 (jupyter_client's ipc numbering),
# and its IOPub pipe <dir>/kernel-<uuid>-ipc-pipe (private_iopub_pipe)
KERNEL_SOCKET_NAME = len("/kernel-") + 36 + len("-ipc-pipe")
# a pool controller's sockets: <dir>/c:<port> (gpu_magics.launch.controller)
CONTROLLER_PREFIX = "c"
CONTROLLER_SOCKET_NAME = len("/c:65535")
# every pool's controller: CurveZMQ on all its sockets (ipyparallel then drops its HMAC key:
# Curve authenticates and encrypts each connection)
CONTROLLER_ARGS = ["--IPController.enable_curve=True"]
IPC_CONTROLLER_ARGS = ["--IPController.transport=ipc", *CONTROLLER_ARGS]


def is_private_dir(path: str, uid: int | None = None) -> bool:
    """Whether ``path`` is a real directory (no symlink) of ``uid`` (default: ours) that no one
    else may enter, list or write (no group or other bits)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return why_not_private(st, os.geteuid() if uid is None else uid) is None


def fits(directory: str, longest_name: int) -> bool:
    """Whether sockets named up to ``longest_name`` characters (with their ``/``) fit in
    ``directory`` (pure)."""
    return len(directory) + longest_name <= SUN_PATH_MAX


def socket_dir(prefix: str, longest_name: int) -> str:
    """A new directory for Unix sockets: made now, 0700, ours, with an unpredictable name
    (``tempfile.mkdtemp``, which never takes an existing one) in the temporary directory, or in
    ``/tmp`` where the temporary directory's path leaves no room for the sockets' names."""
    name = len(prefix) + 8 + 1  # mkdtemp's random part and the separator
    for base in dict.fromkeys((tempfile.gettempdir(), "/tmp")):
        if fits(base, name + longest_name):
            return str(make_private(base, prefix))
    raise OSError(f"no directory short enough for Unix sockets ({tempfile.gettempdir()!r})")


def kernel_connection_dir(runtime_dir: str, log=None) -> tuple[str, bool]:
    """Where a server's kernels keep their connection files and sockets: ``runtime_dir`` when it
    is ours, private (tightened to 0700 where it is ours but wider) and short enough; else a new
    private directory. Returns (the directory, whether it is a new one)."""
    try:
        st = os.lstat(runtime_dir)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and st.st_mode & 0o077:
            os.chmod(runtime_dir, 0o700)  # our own directory, open to others: close it
            if log:
                log.warning(
                    "gpuhub: Jupyter's runtime directory %s was open to others; now 0700", runtime_dir
                )
    except OSError:
        pass
    if is_private_dir(runtime_dir) and fits(runtime_dir, KERNEL_SOCKET_NAME):
        return runtime_dir, False
    path = socket_dir("gpuhub-kernels-", KERNEL_SOCKET_NAME)
    if log:
        why = "its path is too long for sockets" if is_private_dir(runtime_dir) else "it is not private"
        log.warning(
            "gpuhub: kernels' sockets in %s, not Jupyter's runtime directory %s (%s)", path, runtime_dir, why
        )
    return path, True


def kernel_connection(argv: list[str]) -> dict | None:
    """The connection file a kernel's command line names (``-f FILE`` or ``--f=FILE``); None
    where it names none or the file cannot be read."""
    import json

    path = None
    for i, arg in enumerate(argv):
        if arg in ("-f", "--f", "--IPKernelApp.connection_file") and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith(("--f=", "--IPKernelApp.connection_file=")):
            path = arg.split("=", 1)[1]
    if not path:
        return None
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def kernel_transport(argv: list[str]) -> str | None:
    info = kernel_connection(argv)
    return None if info is None else str(info.get("transport", "tcp"))


def private_iopub_pipe(prefix: str) -> None:
    """ipykernel's IOPub pipe (what forked subprocesses print, relayed by the kernel) on the
    Unix socket ``<prefix>-pipe`` beside the kernel's own, instead of a loopback TCP port
    (ipykernel 7 binds ``tcp://127.0.0.1``: the one TCP listener an IPC kernel had left)."""
    import zmq
    from ipykernel import iostream
    from zmq.eventloop.zmqstream import ZMQStream

    address = f"ipc://{prefix}-pipe"

    def _setup_pipe_in(self):
        self._pipe_uuid = os.urandom(16)  # as ipykernel: pipe messages carry it
        pipe_in = self.socket.context.socket(zmq.PULL)
        pipe_in.linger = 0
        pipe_in.bind(address)
        self._pipe_port = 0
        self._pipe_in = ZMQStream(pipe_in, self.io_loop)
        self._pipe_in.on_recv(self._handle_pipe_msg)

    def _setup_pipe_out(self):
        ctx = zmq.Context()  # as ipykernel: a new context after fork
        pipe_out = ctx.socket(zmq.PUSH)
        pipe_out.linger = 3000
        pipe_out.connect(address)
        return ctx, pipe_out

    iostream.IOPubThread._setup_pipe_in = _setup_pipe_in
    iostream.IOPubThread._setup_pipe_out = _setup_pipe_out

    master = os.getpid()

    def remove() -> None:  # jupyter_client removes the sockets it numbered, not this one
        if os.getpid() == master:
            with contextlib.suppress(OSError):
                os.unlink(address[len("ipc://") :])

    atexit.register(remove)


def tcp_refusal(argv: list[str], environ) -> str | None:
    """Why a kernel must not start (it would listen on TCP in a server that says ipc), or None."""
    if environ.get(TRANSPORT_ENV) != "ipc":
        return None
    transport = kernel_transport(argv)
    if transport is None or transport == "ipc":
        return None
    return (
        f"gpuhub: this server's kernels use Unix sockets ({TRANSPORT_ENV}=ipc), but this kernel "
        f"was given a {transport!r} connection file: over TCP every account on the machine could "
        "read its messages. Its server's kernel manager must run with --KernelManager.transport=ipc "
        "(gpuhub's spawners pass it)."
    )


# the server extension ----------------------------------------------------------------------


def _jupyter_server_extension_points():
    return [{"module": "gpu_magics.common.channels"}]


def _load_jupyter_server_extension(serverapp) -> None:
    km = serverapp.kernel_manager
    for config in {id(c): c for c in (serverapp.config, km.config)}.values():
        config.KernelManager.transport = "ipc"  # every kernel manager the server makes from now
    directory, made = kernel_connection_dir(km.connection_dir, serverapp.log)
    km.connection_dir = directory
    if made:
        atexit.register(shutil.rmtree, directory, True)
    os.environ[TRANSPORT_ENV] = "ipc"
    # any other ipyparallel cluster started from this server or its kernels (JupyterLab's
    # IPython Parallel panel, a user's own ipp.Cluster()) is CurveZMQ too, unless they say not
    os.environ.setdefault("IPP_ENABLE_CURVE", "1")
    serverapp.log.info("gpuhub: kernels listen on Unix sockets in %s", directory)
