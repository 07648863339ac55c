"""A class-start storm against a running hub: many users press Start within a few seconds, as
a lab session begins. Shared by ``tests/test_storm.py`` (a short one, its behaviour checked) and
``benchmarks/storm.py`` (the full one, against plain JupyterHub, measured).

Each user's start is one REST POST at a random moment of the window; its spawn counts as
*settled* when the hub's progress stream says it is ready, or that it waits with its place in
the queue (``3rd of 40 waiting``). The hub's own API is probed all the while (a user's model,
which reads the hub's database) for its latency. Every answer of 500 or more is counted.
"""

from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass, field

import requests

PLACE = re.compile(r"\b(\d+)(?:st|nd|rd|th) of (\d+) waiting\b")


@dataclass
class Spawn:
    user: str
    status: int = 0  # the POST's answer
    settled: float | None = None  # seconds from the POST until ready or waiting with a place
    ready: bool = False
    place: int | None = None  # the place it first saw, where it waits
    error: str = ""


@dataclass
class Storm:
    spawns: list[Spawn]
    window: float
    api_latencies: list[float] = field(default_factory=list)
    api_5xx: int = 0
    stop_5xx: int = 0  # DELETEs of the stops after the storm that answered 500 or more

    @property
    def server_errors(self) -> int:
        return sum(1 for s in self.spawns if s.status >= 500) + self.api_5xx

    @property
    def unsettled(self) -> list[Spawn]:
        return [s for s in self.spawns if s.settled is None]

    def settle_times(self) -> list[float]:
        return sorted(s.settled for s in self.spawns if s.settled is not None)


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank) of ``values``; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def _one(hub, spawn: Spawn, at: float, options: dict | None, deadline: float) -> None:
    time.sleep(max(0.0, at - time.monotonic()))
    body = {} if options is None else {"user_options": options}
    t = time.perf_counter()
    try:
        r = hub.api("POST", f"/users/{spawn.user}/server", json=body)
    except requests.RequestException as e:
        spawn.error = f"POST failed: {e}"
        return
    spawn.status = r.status_code
    if r.status_code >= 400:
        spawn.error = r.text[:300]
        return
    try:
        for event in hub.progress(spawn.user, timeout=max(1.0, deadline - time.monotonic())):
            m = PLACE.search(event.get("message", ""))
            if event.get("ready") or m:
                spawn.settled = time.perf_counter() - t
                spawn.ready = bool(event.get("ready"))
                spawn.place = int(m.group(1)) if m else None
                return
            if event.get("failed"):
                spawn.error = event.get("message", "failed")
                return
        spawn.error = "the progress stream ended unsettled"
    except (requests.RequestException, AssertionError) as e:
        spawn.error = f"progress: {e}"[:300]


def run_storm(
    hub, users: list[str], window: float, options: dict | None, timeout: float = 300, seed: int = 0
) -> Storm:
    """Every user of ``users`` (existing already) POSTs a start with ``options`` at a random
    moment of the next ``window`` seconds; returns when each has settled, failed or
    ``timeout`` passed."""
    rng = random.Random(seed)
    start = time.monotonic() + 0.5
    deadline = start + window + timeout
    storm = Storm([Spawn(u) for u in users], window)
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                r = hub.api("GET", f"/users/{users[0]}")
                storm.api_latencies.append(time.perf_counter() - t)
                storm.api_5xx += r.status_code >= 500
            except requests.RequestException:
                storm.api_5xx += 1
            stop.wait(0.1)

    prober = threading.Thread(target=probe, daemon=True)
    threads = [
        threading.Thread(
            target=_one, args=(hub, s, start + rng.uniform(0, window), options, deadline), daemon=True
        )
        for s in storm.spawns
    ]
    prober.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    prober.join(5)
    return storm


def stop_all(hub, users: list[str], timeout: float = 300) -> int:
    """Stop every user's server (a waiting spawn leaves the queue), in parallel, and wait until
    none is left; a server still there is asked again. Returns how many DELETEs answered 500 or
    more (the goal: none; jupyterhub 6.1.1 answers 500 where a start it interrupts is still
    pending a second later, which gpuhub's cancelled starts no longer are:
    ``spawner/spawners/waiting.py``)."""
    errors = 0

    def stop(user: str) -> None:
        nonlocal errors
        errors += hub.api("DELETE", f"/users/{user}/server").status_code >= 500

    deadline = time.monotonic() + timeout
    left = list(users)
    while left and time.monotonic() < deadline:
        threads = [threading.Thread(target=stop, args=(u,), daemon=True) for u in left]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        for _ in range(20):  # up to 10 s for the stops to land, then ask again
            left = [u for u in left if hub.api("GET", f"/users/{u}").json().get("servers")]
            if not left:
                break
            time.sleep(0.5)
    if left:
        raise AssertionError(f"servers still there after the storm: {left[:10]}")
    return errors


def summary(name: str, storm: Storm) -> str:
    times = storm.settle_times()
    lat = storm.api_latencies
    return (
        f"  {name:<34} settled {len(times)}/{len(storm.spawns)}, "
        f"p50 {percentile(times, 50):6.2f} s, p99 {percentile(times, 99):6.2f} s, "
        f"API p99 {percentile(lat, 99) * 1000:7.1f} ms (median {percentile(lat, 50) * 1000:.1f} ms, "
        f"{len(lat)} probes), 5xx {storm.server_errors}"
    )
