"""Notebooks through a real Jupyter kernel ("Python 3 (GPUs)"), with nbclient."""

from __future__ import annotations

import ast
import re
from contextlib import contextmanager

import nbformat
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
