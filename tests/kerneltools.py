"""Notebooks through a real Jupyter kernel ("Python 3 (GPUs)"), with nbclient."""

from __future__ import annotations

import ast
import os
import re
import time
from contextlib import contextmanager

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient

RANK_LINE = re.compile(r"^\[rank (\d+)\] (.*)$", re.M)


def run_notebook(cells: list[str], env: dict, timeout: float = 120, interrupt_on_timeout: bool = False):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(
        nb,
        kernel_name="python3-gpus",
        timeout=timeout,
        allow_errors=True,
        interrupt_on_timeout=interrupt_on_timeout,
    )
    client.execute(env=env)
    return [Cell(c) for c in nb.cells]


class Cell:
    def __init__(self, cell):
        self.outputs = cell.outputs

    @property
    def stdout(self) -> str:
        return "".join(o.get("text", "") for o in self.outputs if o.get("name") == "stdout")

    @property
    def stderr(self) -> str:
        return "".join(o.get("text", "") for o in self.outputs if o.get("name") == "stderr")

    @property
    def shown(self) -> str:
        """Everything the cell showed as text, in order: its streams, and its displays'
        text (gpuhub's save and restore lines are displays, wrapped at spaces only)."""
        out = []
        for o in self.outputs:
            if o.output_type == "stream":
                out.append(o.get("text", ""))
            elif o.output_type in ("display_data", "execute_result"):
                text = o.get("data", {}).get("text/plain", "")
                out.append(text if text.endswith("\n") else text + "\n")
        return "".join(out)

    @property
    def error(self) -> dict | None:
        return next((o for o in self.outputs if o.output_type == "error"), None)

    @property
    def traceback(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""

    @property
    def result(self):
        for o in self.outputs:
            if o.output_type == "execute_result":
                return ast.literal_eval(o["data"]["text/plain"])
        return None

    def rank_lines(self, stream: str = "stdout") -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rank, text in RANK_LINE.findall(getattr(self, stream)):
            out.setdefault(int(rank), []).append(text)
        return out

    def __repr__(self):
        return f"Cell(stdout={self.stdout!r}, stderr={self.stderr!r}, error={self.traceback!r})"


def own_gpus_env(tmp_path, gpus: str) -> dict:
    """A kernel's environment outside any hub, on the server's own (simulated) GPUs ``gpus``
    (e.g. ``"t:0,t:1"``): a ``%%distributed`` pool of them needs no broker."""
    env = dict(os.environ)
    for var in (
        "GPUHUB_BROKER_URL",
        "JUPYTERHUB_API_TOKEN",
        "GPUHUB_ALLOCATION_ID",
        "GPUHUB_BACKEND",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
    ):
        env.pop(var, None)
    env.update(
        GPUHUB_GPUS=gpus,
        GPUHUB_GPU_SOURCE="simulated",
        IPYTHONDIR=str(tmp_path / "ipython"),
        HOME=str(tmp_path / "home"),
    )
    os.makedirs(env["HOME"], exist_ok=True)
    return env


def run_cell(kc, code: str, timeout: float = 180) -> tuple[str, str]:
    """One cell through a connected kernel client: its reply status and everything it showed
    (streams, results, displays, the traceback of an error), in order."""
    out = []

    def hook(msg):
        c = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(c["text"])
        elif msg["msg_type"] in ("execute_result", "display_data", "update_display_data"):
            out.append(c["data"].get("text/plain", ""))
        elif msg["msg_type"] == "error":
            out.append("\n".join(c["traceback"]))

    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    return reply["content"]["status"], "".join(out)


@contextmanager
def started_kernel(env: dict):
    """A "Python 3 (GPUs)" kernel with ``env``: (manager, connected client), shut down after."""
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3-gpus")
    km.start_kernel(env=env)
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


class BrokerKernel:
    """A real "Python 3 (GPUs)" kernel of ``user``'s, outside any server, that reaches the
    hub's broker with the user's token; driven cell by cell."""

    def __init__(self, hub, tmp_path, user: str = "alice"):
        env = dict(os.environ)
        env.update(
            JUPYTERHUB_API_TOKEN=hub.user_token(user),
            GPUHUB_BROKER_URL=f"http://127.0.0.1:{hub.broker_port}/services/gpuhub/api/v1/",
            IPYTHONDIR=str(tmp_path / f"ipython-{user}"),
        )
        for var in ("GPUHUB_GPUS", "GPUHUB_ALLOCATION_ID", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"):
            env.pop(var, None)
        self.hub, self.user = hub, user
        self.km = KernelManager(kernel_name="python3-gpus")
        self.km.start_kernel(env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, *, interrupt_when: str | None = None, then=None, timeout: float = 240) -> dict:
        """Run a cell; with ``interrupt_when``, interrupt the kernel once that text has been
        shown (or call ``then()`` instead, once). Returns the reply's content, the text shown,
        and how long the interrupt took."""
        msg_id = self.kc.execute(code)
        shown, result, interrupted_at, deadline = [], None, None, time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            c, kind = msg["content"], msg["msg_type"]
            if kind == "stream":
                shown.append(c["text"])
            elif kind in ("execute_result", "display_data", "update_display_data"):
                shown.append(c["data"].get("text/plain", ""))
                if kind == "execute_result":
                    result = c["data"].get("text/plain")
            elif kind == "error":
                shown.append("\n".join(c["traceback"]))
            elif kind == "status" and c["execution_state"] == "idle":
                break
            if interrupt_when and interrupted_at is None and interrupt_when in "".join(shown):
                interrupted_at = time.monotonic()
                if then is None:
                    self.km.interrupt_kernel()
                else:  # something else to do at that moment (the cell goes on)
                    then()
        while True:  # the reply to this cell (never one left over from another request)
            msg = self.kc.get_shell_msg(timeout=30)
            if msg["parent_header"].get("msg_id") == msg_id:
                reply = msg["content"]
                break
        took = time.monotonic() - interrupted_at if interrupted_at else None
        return {
            "status": reply["status"],
            "ename": reply.get("ename"),
            "text": "".join(shown),
            "result": result,
            "took": took,
        }

    def result(self, code: str):
        import ast

        out = self.run(code)
        assert out["status"] == "ok" and out["result"], out["text"]
        return ast.literal_eval(out["result"])

    def close(self):
        """Shut the kernel down as JupyterLab's "Shut Down Kernel" does (a shutdown request, not
        a kill): its exit hook stops the engines and gives the bursts back now, not at their
        lease's end (1.5 s where ``%distributed shutdown``'s graceful round took 7 s); checked."""
        from spawner.ledger import Ledger

        from .hubtools import wait_for

        self.kc.stop_channels()
        self.km.shutdown_kernel()
        ledger = Ledger(self.hub.ledger_url)
        try:
            wait_for(
                lambda: not [a for a in ledger.active(user=self.user) if a.purpose == "distributed"],
                30,
                f"{self.user}'s bursts to be released at the kernel's exit",
            )
        finally:
            ledger.close()


class OwnKernel(BrokerKernel):
    """A real "Python 3 (GPUs)" kernel on the server's own (simulated) GPUs ``gpus``, outside
    any hub (``own_gpus_env``); driven cell by cell as :class:`BrokerKernel`."""

    def __init__(self, tmp_path, gpus: str = "t:0,t:1"):
        self.hub, self.user = None, None
        self.km = KernelManager(kernel_name="python3-gpus")
        self.km.start_kernel(env=own_gpus_env(tmp_path, gpus))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def close(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel()
