"""What GPU admission adds to a spawn: gpu-local-simple against plain SimpleLocalProcessSpawner.

    PATH=node_modules/.bin:$PATH .venv/bin/python benchmarks/spawn_overhead.py [spawns]

Two real hubs (demo configuration, real proxy) on free ports, spawning in turn: POST to ready
for the same user, `spawns` times each, stopping in between. Prints medians and the ratio.
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hubtools import Hub


def spawn_once(hub: Hub, options) -> float:
    t = time.perf_counter()
    r = hub.spawn("alice", options)
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("alice", timeout=120)
    elapsed = time.perf_counter() - t
    hub.stop_server("alice")
    return elapsed


def main() -> None:
    spawns = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with tempfile.TemporaryDirectory() as d:
        gpu_hub = Hub(Path(d) / "gpu").start()
        plain_hub = Hub(
            Path(d) / "plain",
            extra_config='c.JupyterHub.spawner_class = "simple"\nc.Spawner.options_form = ""',
        ).start()
        gpu, plain = [], []
        try:
            for _ in range(spawns):  # interleaved, so both see the same machine noise
                gpu.append(spawn_once(gpu_hub, {"gpus": 2}))
                plain.append(spawn_once(plain_hub, None))
        finally:
            gpu_hub.stop()
            plain_hub.stop()
    print(f"POST to ready, median of {spawns} interleaved spawns each:")
    print(f"  gpu-local-simple (2 GPUs)     {statistics.median(gpu):6.2f} s  {[round(t, 2) for t in gpu]}")
    spread = [round(t, 2) for t in plain]
    print(f"  SimpleLocalProcessSpawner     {statistics.median(plain):6.2f} s  {spread}")
    print(f"  ratio gpuhub / plain: {statistics.median(gpu) / statistics.median(plain):.2f}x")


if __name__ == "__main__":
    main()
