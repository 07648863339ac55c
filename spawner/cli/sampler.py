"""``gpuhub sampler``: gpuhub's own readings of one node's GPUs, the ones that decide idle
reclaims where the broker cannot sample them itself (Slurm nodes; docs/reclaim.md).

Run it on each node as root or the hub's account (a systemd unit, say), never as a user: what it
reports decides whether a user's GPUs count as idle. Every ``--interval`` seconds it samples
the node's GPUs (NVML, or the simulated file on a machine without GPUs: utilization, memory,
and power and the energy counter where the GPU has them) and posts them to the broker's
``POST nodes/{node}/samples`` with the token in ``--token-file``, which must be readable by
its owner only (the broker's ``gpuhub-sampler`` service: ``enable_broker(c,
sampler_token_file=...)`` on the hub). A failed post is logged and the next one goes on.

    gpuhub sampler --broker-url http://hub:8000/services/gpuhub/api/v1/ \\
        --token-file /etc/gpuhub/sampler.token
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import threading

from gpu_magics.common import words
from spawner.cli.output import UsageError

log = logging.getLogger("gpuhub.sampler")


OPTIONAL = ("memory_total_mib", "power_watts", "energy_mj")  # left out where not read


def make_report(samples) -> dict:
    """The body of ``POST nodes/{node}/samples`` for ``gpu_magics.report.gpustats.GpuSample``s
    (pure): with the board's power and NVML's energy counter where they were read, which the
    broker integrates into each allocation's energy."""
    gpus = []
    for s in samples:
        g = {"node": s.node, "index": s.index, "utilization": s.utilization}
        g["memory_used_mib"] = s.memory_used_mib
        for key in OPTIONAL:
            value = getattr(s, key, None)
            if value is not None:
                g[key] = value
        gpus.append(g)
    return {"source": "gpuhub-sampler", "gpus": gpus}


def register(sub) -> None:
    """``gpuhub sampler``: its own options only (none of the ledger's)."""
    p = sub.add_parser(
        "sampler", help="report this node's GPU readings to the broker (as root, on each node)"
    )
    add_arguments(p)
    p.set_defaults(func=_command)


def _command(args, out) -> int:
    try:
        return run(args)
    except (ValueError, OSError) as e:
        raise UsageError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--broker-url", required=True, help="the broker's API, e.g. http://hub:8000/services/gpuhub/api/v1/"
    )
    p.add_argument("--token-file", required=True, help="the gpuhub-sampler token (mode 0600)")
    p.add_argument(
        "--node", default=socket.gethostname(), help="this node's name in gpuhub (default: the host name)"
    )
    p.add_argument("--gpus", type=int, help="how many GPUs the node has (default: as NVML counts them)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between reports (default 30)")
    p.add_argument("--source", choices=("nvml", "simulated"), default="nvml")
    p.add_argument("--simulated-file", help="the simulated readings (--source simulated)")
    p.add_argument("--once", action="store_true", help="report once and exit")


def _source(args):
    from gpu_magics.report.gpustats import make_source

    env = {"GPUHUB_GPU_SOURCE": args.source}
    if args.simulated_file:
        env["GPUHUB_SIMULATED_GPU_STATS"] = args.simulated_file
    return make_source(env)


def _count(source) -> int:
    nvml = getattr(source, "nvml", None)
    if nvml is None:
        raise ValueError("--gpus is needed with --source simulated (how many GPUs the node has)")
    return int(nvml.nvmlDeviceGetCount())


def run(args, stop: threading.Event | None = None, post=None) -> int:
    from spawner.broker import read_sampler_token

    logging.basicConfig(
        level=logging.INFO, format="[%(levelname)1.1s %(asctime)s gpuhub-sampler] %(message)s"
    )
    token = read_sampler_token(args.token_file)
    if args.interval <= 0:
        raise ValueError(f"--interval must be more than 0 seconds; got {args.interval:g}")
    source = _source(args)
    count = args.gpus if args.gpus is not None else _count(source)
    url = f"{args.broker_url.rstrip('/')}/nodes/{args.node}/samples"
    if post is None:
        import requests

        def post(url, body):
            return requests.post(
                url, data=json.dumps(body), headers={"Authorization": f"token {token}"}, timeout=30
            )

    stop = stop or threading.Event()
    log.info("reporting %s of %s to %s every %g s", words.count(count, "GPU"), args.node, url, args.interval)
    failed = 0
    while True:
        try:
            r = post(url, make_report(source.sample(args.node, range(count))))
            if r.status_code >= 400:
                raise RuntimeError(f"{r.status_code} {r.text[:300]}")
            failed = 0
        except Exception as e:  # the broker restarting, NVML hiccups: try again next time
            failed += 1
            if failed == 1 or failed % 20 == 0:
                log.warning("report %d failed: %s", failed, e)
        if args.once:
            return 0 if failed == 0 else 1
        if stop.wait(args.interval):
            return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gpuhub sampler", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    try:
        return run(p.parse_args(argv))
    except (ValueError, OSError) as e:
        print(f"gpuhub sampler: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
