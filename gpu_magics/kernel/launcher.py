"""The "Python 3 (GPUs)" kernel's launcher: ``ipykernel_launcher``, which first refuses to start
over TCP in a gpuhub server (``channels.tcp_refusal``: the server says ``GPUHUB_KERNEL_TRANSPORT=ipc``
and the connection file it wrote says ``tcp``), before any socket is bound. Over IPC its IOPub
pipe (subprocesses' output) is a Unix socket beside the others (``channels.private_iopub_pipe``),
so the kernel listens on no TCP port at all. Elsewhere (a laptop's Jupyter, ``jupyter console``
over TCP) it is ipykernel's launcher as it is.

The debugger is off in a gpuhub server (:func:`debugger_allowed`): ipykernel's starts debugpy
listening on a loopback TCP port, which any account on the machine could attach to first and
run code as the kernel's owner. The kernel then tells JupyterLab it has no debugger
(``kernel_info``) and ignores debug requests."""

import os
import sys


def debugger_allowed(environ) -> bool:
    """Whether this kernel may start ipykernel's debugger (pure): not in a gpuhub server, whose
    kernels keep every channel off TCP (``GPUHUB_KERNEL_TRANSPORT=ipc``)."""
    return environ.get("GPUHUB_KERNEL_TRANSPORT", "") != "ipc"


def main() -> None:
    """Start the kernel (``python -m gpu_magics.kernel``, the kernelspec's argv)."""
    # as ipykernel_launcher: the working directory off sys.path while ipykernel loads
    # (InteractiveShellApp.init_path puts it back)
    if sys.path[0] == "":
        del sys.path[0]
    from gpu_magics.common.channels import kernel_connection, private_iopub_pipe, tcp_refusal

    refusal = tcp_refusal(sys.argv, os.environ)
    if refusal:
        sys.exit(refusal)
    connection = kernel_connection(sys.argv) or {}
    if connection.get("transport") == "ipc" and connection.get("ip"):
        private_iopub_pipe(connection["ip"])
    if not debugger_allowed(os.environ):
        from ipykernel import debugger

        debugger._is_debugpy_available = False  # read by the kernel for kernel_info and debug requests
    from ipykernel import kernelapp as app

    app.launch_new_instance()


if __name__ == "__main__":
    main()
