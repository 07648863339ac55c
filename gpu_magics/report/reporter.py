"""Report GPU use to the gpuhub broker from where the GPUs are.

- In the single-user server (a Jupyter server extension the GPU spawner enables): every
  ``GPUHUB_REPORT_SECONDS`` it samples the server's GPUs and tells the broker, with how long
  ago its kernels were last active (0 while one is busy). The broker answers with the
  allocation's idle state; a warning goes to the server's log.
- In each ``%%distributed`` engine of a burst (``start_burst_reporter``): the engine's own
  GPU, from a thread; the kernel reports the pool's activity with its lease renewals.

Nothing runs, and nothing is lost, where there is no allocation, no broker, or no way to
sample: the broker then sees the allocation's use as unknown and never reclaims it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime

from gpu_magics.common.session import server_gpus
from gpu_magics.kernel.broker import BrokerClient, BrokerError
from gpu_magics.report.gpustats import NvmlUnavailable, make_source, parse_label

log = logging.getLogger("gpuhub.reporter")


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def kernel_idle_seconds(kernels: Iterable[Mapping], now: datetime) -> float | None:
    """Seconds since any kernel was last active: 0 when one is busy (or starting), None
    when there is no kernel (the server then shows no activity at all)."""
    latest = None
    for k in kernels:
        if k.get("execution_state") in ("busy", "starting"):
            return 0.0
        t = parse_time(k.get("last_activity"))
        if t is not None and (latest is None or t > latest):
            latest = t
    if latest is None:
        return None
    return max(0.0, (now - latest).total_seconds())


class Reporter:
    """Samples some GPUs of one allocation and posts them to the broker."""

    def __init__(self, client: BrokerClient, allocation_id: int, labels: Iterable[str], source, say=None):
        self.client, self.allocation_id, self.source = client, allocation_id, source
        self.gpus: dict[str, list[int]] = {}
        for label in labels:
            node, index = parse_label(label)
            self.gpus.setdefault(node, []).append(index)
        self.say = say or log.warning
        self.state = ""
        self.stopped = False
        self._failing = False

    def report_once(self, idle_seconds: float | None = None) -> dict | None:
        if self.stopped:
            return None
        try:
            samples = [s.to_json() for node, idx in self.gpus.items() for s in self.source.sample(node, idx)]
        except Exception as e:  # a GPU that fell off the bus must not end the server
            self._once(f"gpuhub: could not sample the GPUs: {e!r}")
            return None
        body: dict = {"gpus": samples, "source": self.source.name}
        if idle_seconds is not None:
            body["idle_seconds"] = round(idle_seconds, 1)
        try:
            answer = self.client.report(self.allocation_id, body)
        except BrokerError as e:
            if e.status == 409:  # released: nothing to report on any more
                self.stopped = True
                self.say(
                    f"gpuhub: allocation {self.allocation_id} is released; GPU reports stop: {e.message}"
                )
            elif e.status == 404:
                self._once(
                    "gpuhub: the broker does not let this server's token see allocation "
                    f"{self.allocation_id} (check c.Spawner.server_token_scopes); GPU use is not reported"
                )
            else:
                self._once(f"gpuhub: could not report GPU use to the broker: {e.message}")
            return None
        self._failing = False
        idle = answer.get("idle") or {}
        if idle.get("state") == "warned" and self.state != "warned":
            when = idle.get("reclaim_in_seconds")
            self.say(
                f"gpuhub: allocation {self.allocation_id}: {idle.get('reason')}; "
                + (
                    "stop the server to give its GPUs back"
                    if when is None
                    else f"it will be reclaimed in {when:.0f} s unless its GPUs are used"
                )
            )
        self.state = idle.get("state", "")
        return answer

    def _once(self, text: str) -> None:
        if not self._failing:  # log a failure once, not at every tick
            self._failing = True
            self.say(text)


def _interval(env: Mapping[str, str]) -> float:
    try:
        return max(0.2, float(env.get("GPUHUB_REPORT_SECONDS", "30")))
    except ValueError:
        return 30.0


def start_burst_reporter(
    allocation_id: int, labels: str | Iterable[str], environ: Mapping[str, str] | None = None
):
    """From an engine of a burst (its own GPU), or a kernel whose Dask workers hold a burst
    here (their GPUs): report every interval from a daemon thread, until it is released."""
    env = os.environ if environ is None else environ
    client = BrokerClient.from_env(env)
    if client is None or not allocation_id:
        return None
    try:
        source = make_source(env)
    except (NvmlUnavailable, ValueError):
        return None
    labels = [labels] if isinstance(labels, str) else list(labels)
    reporter = Reporter(client, allocation_id, labels, source, say=lambda text: None)
    interval = _interval(env)

    def loop():
        stop = threading.Event()
        while not reporter.stopped and not stop.wait(interval):
            reporter.report_once()

    threading.Thread(target=loop, daemon=True, name="gpuhub-report").start()
    return reporter


# the Jupyter server extension ---------------------------------------------------------------


def _jupyter_server_extension_points():
    # the private Dask dashboards' proxy comes with it (gpu_magics.dask.dashproxy)
    return [{"module": "gpu_magics.report.reporter"}, {"module": "gpu_magics.dask.dashproxy"}]


def _load_jupyter_server_extension(serverapp) -> None:
    from tornado.ioloop import PeriodicCallback

    own = server_gpus()
    client = BrokerClient.from_env()
    if not own.allocation_id or not own.gpus or client is None:
        serverapp.log.info("gpuhub: no GPUs or no broker; GPU use is not reported")
        return
    try:
        source = make_source()
    except (NvmlUnavailable, ValueError) as e:
        serverapp.log.warning(
            "gpuhub: cannot sample this server's GPUs (%s); idle reclaim leaves it alone", e
        )
        return
    # a slice reports its GPU's readings: the whole GPU's, shared with the other slices on it
    reporter = Reporter(client, own.allocation_id, own.whole_labels, source, say=serverapp.log.warning)
    interval = _interval(os.environ)
    km = serverapp.kernel_manager

    async def tick() -> None:
        idle = kernel_idle_seconds(km.list_kernels(), datetime.now(UTC))
        await asyncio.to_thread(reporter.report_once, idle)

    serverapp.io_loop.add_callback(tick)
    serverapp.gpuhub_reporter = PeriodicCallback(tick, interval * 1000)
    serverapp.gpuhub_reporter.start()
    serverapp.log.info(
        "gpuhub: reporting %s's use every %g s (%s)", ", ".join(own.gpus), interval, source.name
    )
