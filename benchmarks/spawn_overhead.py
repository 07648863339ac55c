"""A local gpuhub spawn against its floor (a bare Jupyter server's start) and plain JupyterHub.

    PATH=node_modules/.bin:$PATH .venv/bin/python benchmarks/spawn_overhead.py [rounds]

Arms interleaved round by round, so that all see the same machine noise:

- **floor**: a bare ``python -m jupyter_server`` (the same Python, the same extensions), from
  the process's start until ``/api`` answers (polled every 10 ms): no hub, no proxy;
- **gpu-local-simple**: a real hub (demo configuration, real proxy), REST POST for 2 GPUs
  until the hub's progress stream says ready, then stop;
- **gpu-local-simple, untuned**: the same without what makes it faster (JupyterHub's own
  ``jupyterhub-singleuser`` and its back-off: ``UNTUNED``), i.e. gpuhub before;
- **gpu-local-simple, previous launcher**: the same hub, for bob, with gpuhub's launcher as it
  was before it read JupyterLab's version without yarn (``PREVIOUS``: ``rfc3987_syntax``
  deferred only): what the launcher's newer cut is worth, in the same run;
- **SimpleLocalProcessSpawner**: the same with JupyterHub's own spawner, no GPUs, as installed.

Prints medians, the spread, gpuhub minus the floor and the ratios.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.hubtools import Hub, free_port

POLL = 0.01
# gpuhub without its spawn speedups: JupyterHub's own launcher, and JupyterHub's wait alone
UNTUNED = (
    f'c.Spawner.cmd = ["{sys.executable}", "-m", "jupyterhub.singleuser"]\nc.Spawner.ready_poll_seconds = 0\n'
)

# gpuhub-singleuser before it read JupyterLab's version without yarn, for bob on the gpuhub hub
PREVIOUS_CODE = (
    "import sys; from spawner.singleuser import defer_import; defer_import(); "
    "from jupyterhub.singleuser import main; sys.exit(main())"
)
PREVIOUS = f"""
def _previous(spawner):
    if spawner.user.name == "bob":
        spawner.cmd = [{sys.executable!r}, "-c", {PREVIOUS_CODE!r}]
c.Spawner.pre_spawn_hook = _previous
"""


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except requests.ConnectionError:
            pass
        time.sleep(POLL)
    raise TimeoutError(f"{what} took over {timeout} s")


def bare_server(workdir: Path) -> float:
    """Process start to the first HTTP answer of a bare Jupyter server."""
    port = free_port()
    home = Path(tempfile.mkdtemp(dir=workdir))
    env = dict(os.environ, HOME=str(home), JUPYTER_RUNTIME_DIR=str(home / "runtime"))
    argv = [
        sys.executable, "-m", "jupyter_server", "--allow-root", "--no-browser", "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}", "--IdentityProvider.token=", f"--ServerApp.root_dir={home}",
    ]  # fmt: skip
    t = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:

        def answers():
            if proc.poll() is not None:
                raise RuntimeError(f"the bare server exited ({proc.returncode})")
            return requests.get(f"http://127.0.0.1:{port}/api", timeout=30).status_code == 200

        wait_until(answers, 120, "the bare server")
        return time.perf_counter() - t
    finally:
        proc.terminate()
        proc.wait(30)


def spawn_once(hub: Hub, options, user: str = "alice") -> float:
    """REST POST to 'ready' on the hub's progress stream (pushed, not polled: polling the
    hub would load the very process that runs the spawn); the server is stopped afterwards."""
    hub.ensure_user(user)
    t = time.perf_counter()
    r = hub.spawn(user, options)
    assert r.status_code in (201, 202), r.text
    if r.status_code == 202:
        events = list(hub.progress(user, timeout=120))
        last = events[-1] if events else {}
        assert last.get("ready"), f"{user}'s spawn did not become ready: {last}\n{hub.log()}"
    elapsed = time.perf_counter() - t
    hub.stop_server(user)
    return elapsed


def line(name: str, times: list[float]) -> str:
    return f"  {name:<28}{statistics.median(times):6.2f} s  {[round(t, 2) for t in times]}"


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    with tempfile.TemporaryDirectory() as d:
        gpu_hub = Hub(Path(d) / "gpu", extra_config=PREVIOUS).start()
        untuned_hub = Hub(Path(d) / "untuned", extra_config=UNTUNED).start()
        plain_hub = Hub(
            Path(d) / "plain",
            extra_config='c.JupyterHub.spawner_class = "simple"\n'
            'c.Spawner.options_form = ""\nc.Spawner.cmd = ["jupyterhub-singleuser"]',
        ).start()
        floor, gpu, untuned, plain, before = [], [], [], [], []
        try:
            for hub, options in ((gpu_hub, {"gpus": 2}), (untuned_hub, {"gpus": 2}), (plain_hub, None)):
                spawn_once(hub, options)  # first spawns warm the file cache: not measured
            spawn_once(gpu_hub, {"gpus": 2}, "bob")
            for _ in range(rounds):
                floor.append(bare_server(Path(d)))
                gpu.append(spawn_once(gpu_hub, {"gpus": 2}))
                before.append(spawn_once(gpu_hub, {"gpus": 2}, "bob"))
                untuned.append(spawn_once(untuned_hub, {"gpus": 2}))
                plain.append(spawn_once(plain_hub, None))
        finally:
            for hub in (gpu_hub, untuned_hub, plain_hub):
                hub.stop()
    f, g, u, p, v = (statistics.median(x) for x in (floor, gpu, untuned, plain, before))
    print(f"POST to ready, median of {rounds} interleaved rounds:")
    print(line("bare jupyter server -> HTTP", floor))
    print(line("gpu-local-simple (2 GPUs)", gpu))
    print(line("  the same, untuned", untuned))
    print(line("  previous launcher", before))
    print(line("SimpleLocalProcessSpawner", plain))
    print(f"  gpuhub - floor: {g - f:+.2f} s ({g / f:.2f}x); untuned - floor: {u - f:+.2f} s")
    print(f"  gpuhub / untuned: {g / u:.2f}x; gpuhub / plain JupyterHub: {g / p:.2f}x")
    rounds = [round(x / y, 2) for x, y in zip(gpu, before, strict=True)]
    print(f"  gpuhub / previous launcher: {g / v:.2f}x (rounds: {rounds})")


if __name__ == "__main__":
    main()
