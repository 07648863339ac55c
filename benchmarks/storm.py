"""A class-start storm: N users press Start within W seconds, on gpuhub and on plain JupyterHub.

    PATH=node_modules/.bin:$PATH .venv/bin/python benchmarks/storm.py [users=200] [window_s=10] [gpus=8]

Arms, one after the other in the same run, on the same machine:

- **gpuhub**: a real hub (the demo's configuration, the real proxy and broker), ``gpus``
  simulated GPUs; each user asks for one GPU through the REST API. ``gpus`` servers start; the
  others wait in the queue with their place. A spawn is settled when its progress stream says
  ready or gives its place.
- **plain JupyterHub** (the floor): the same hub's JupyterHub with its own
  ``SimpleLocalProcessSpawner``, no gpuhub, no GPUs: every user's server starts (a real
  ``jupyterhub-singleuser``); settled when ready.

Measured for each: the time from each POST until its spawn settled (p50, p99, and the last),
the hub's API latency while the storm lasts (``GET /hub/api/users/NAME``, every 0.1 s: p50,
p99), and answers of 500 or more (the goal: none). Printed with the ratios of gpuhub to the
floor. The floor starts N servers where gpuhub starts ``gpus``; its times are what JupyterHub
alone takes to take N starts at once, not the same work.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hubtools import Hub
from tests.stormtools import percentile, run_storm, stop_all, summary

PLAIN = (
    'c.JupyterHub.spawner_class = "simple"\nc.Spawner.options_form = ""\n'
    'c.Spawner.cmd = ["jupyterhub-singleuser"]\nc.JupyterHub.concurrent_spawn_limit = 0\n'
    "c.Spawner.start_timeout = 600\nc.Spawner.http_timeout = 600\n"
)


def gpuhub_config(gpus: int) -> str:
    return (
        f'c.GpuHub.simulated_gpus = [{{"count": {gpus}, "model": "Simulated A100", "memory_mib": 40960}}]\n'
        "c.JupyterHub.concurrent_spawn_limit = 0\n"
    )


def arm(workdir: Path, config: str, users: list[str], window: float, options):
    hub = Hub(workdir, extra_config=config).start(timeout=180)
    try:
        for user in users:
            hub.ensure_user(user)
        t = time.perf_counter()
        storm = run_storm(hub, users, window, options, timeout=900)
        took = time.perf_counter() - t
        print(summary(workdir.name, storm), flush=True)  # before the stops, which may not end
        storm.stop_5xx = stop_all(hub, users, timeout=900)
        print(
            f"  {workdir.name}: every server stopped; DELETEs that answered 5xx: {storm.stop_5xx}", flush=True
        )
        return storm, took
    finally:
        hub.stop()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    window = float(sys.argv[2]) if len(sys.argv) > 2 else 10.0
    gpus = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    users = [f"u{i:03d}" for i in range(n)]
    with tempfile.TemporaryDirectory() as d:
        ours, ours_took = arm(Path(d) / "gpuhub", gpuhub_config(gpus), users, window, {"gpus": 1})
        floor, floor_took = arm(Path(d) / "plain", PLAIN, users, window, None)
    print(f"{n} users press Start within {window:g} s ({gpus} simulated GPUs for gpuhub):")
    print(summary("gpuhub (1 GPU each)", ours))
    print(summary("plain JupyterHub (no GPUs)", floor))
    waiting = sum(1 for s in ours.spawns if s.place is not None)
    print(f"  gpuhub: {n - waiting} started, {waiting} waiting with a place; storm over in {ours_took:.1f} s")
    print(f"  plain JupyterHub: storm over in {floor_took:.1f} s")
    for what, ours_v, floor_v in [
        ("p50 settle", percentile(ours.settle_times(), 50), percentile(floor.settle_times(), 50)),
        ("p99 settle", percentile(ours.settle_times(), 99), percentile(floor.settle_times(), 99)),
        ("API p99", percentile(ours.api_latencies, 99), percentile(floor.api_latencies, 99)),
    ]:
        print(f"  gpuhub / plain JupyterHub, {what}: {ours_v / floor_v:.2f}x")
    errors = [(s.user, s.status, s.error[:120]) for st in (ours, floor) for s in st.spawns if s.error]
    if errors:
        print(f"  errors ({len(errors)}): {errors[:5]}")


if __name__ == "__main__":
    main()
