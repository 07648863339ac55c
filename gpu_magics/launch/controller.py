"""ipyparallel's controller, with its Unix-socket (``ipc``) addresses as its engines and clients
read them. ``python -m gpu_magics.launch.controller`` takes ``ipyparallel.controller``'s arguments.

ipyparallel 9 names an ``ipc`` endpoint ``<path>-<port>`` where the controller binds it
(``IPController.construct_url``) but ``<path>:<port>`` in its engines and clients (the
connection files hold the path and the numbers apart): over ``ipc`` nothing would ever connect.
This controller binds ``<path>:<port>``, the names the others connect to; TCP addresses are
unchanged. A local pool (``launch.local.LocalLauncher``) runs it with its sockets in a private
directory (``channels.socket_dir``)."""

from __future__ import annotations


def ipc_url(url: str, interface: str) -> str:
    """``url`` (``interface`` + separator + port) with ``:`` as the separator where
    ``interface`` is an ``ipc://`` one (pure)."""
    if not interface.startswith("ipc://") or not url.startswith(interface + "-"):
        return url
    return f"{interface}:{url[len(interface) + 1 :]}"


def patch(controller_class) -> None:
    original = controller_class.construct_url

    def construct_url(self, kind: str, channel: str, index=None):
        url = original(self, kind, channel, index)
        info = {"engine": self.engine_info, "client": self.client_info, "internal": self.internal_info}
        return ipc_url(url, info[kind]["interface"])

    construct_url.__wrapped__ = original
    controller_class.construct_url = construct_url


if __name__ == "__main__":
    from ipyparallel.controller.app import IPController, main

    patch(IPController)
    main()
