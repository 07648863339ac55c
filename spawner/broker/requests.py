"""Request bodies of the broker's REST API, checked strictly: pure functions.

Unknown fields, wrong types (``true`` is not a number), out-of-range values and bodies that
are not a JSON object are refused with a message that names the field and what it takes.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from spawner import policy
from spawner.policy import timelimits, values

MAX_BODY_BYTES = 16 * 1024
MAX_COUNT = policy.MAX_COUNT
MAX_DIGITS = 30  # no count or time here needs more; int() of a long one is quadratic


class BadRequest(ValueError):
    """A malformed request; ``str(e)`` is the message for the caller."""


def _refuse_constant(name: str):
    raise BadRequest(f"The request body holds {name}, which is not a JSON number; send a finite number.")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise BadRequest(
            f"The request body holds a number of {len(text)} digits; at most {MAX_DIGITS} are accepted."
        )
    return int(text)


def parse_json_object(body: bytes, max_bytes: int = MAX_BODY_BYTES) -> dict[str, Any]:
    if len(body) > max_bytes:
        raise BadRequest(f"The request body is {len(body)} bytes; at most {max_bytes} are accepted.")
    if not body.strip():
        return {}
    try:
        value = json.loads(body, parse_constant=_refuse_constant, parse_int=_bounded_int)
    except RecursionError:
        raise BadRequest("The request body is nested too deeply; send a flat JSON object.") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"The request body is not valid JSON ({e}).") from None
    if not isinstance(value, dict):
        raise BadRequest(f"The request body must be a JSON object, not {type(value).__name__}.")
    return value


def _only(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        shown = ", ".join(values.show(k) for k in unknown[:5])
        raise BadRequest(f"Unknown field(s) {shown}; accepted: {', '.join(allowed)}.")


def _int(body: dict, key: str, *, lo: int, hi: int, required: bool = False) -> int | None:
    value = body.get(key)
    if value is None:
        if required:
            raise BadRequest(f"{key!r} is required: a whole number from {lo} to {hi}.")
        return None
    try:
        return values.parse_count(value, repr(key), lo=lo, hi=hi, text=False)
    except values.BadValue as e:
        raise BadRequest(e.message) from None


def _number(body: dict, key: str, *, lo: float, hi: float, unit: str = "") -> float | None:
    value = body.get(key)
    if value is None:
        return None
    try:
        return values.parse_number(value, repr(key), lo=lo, hi=hi, unit=unit, text=False)
    except values.BadValue as e:
        raise BadRequest(e.message) from None


@dataclass(frozen=True)
class BurstRequest:
    gpus: int
    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu_model: str | None = None
    lease_seconds: float | None = None
    node: str | None = None  # every GPU on this node (a kernel adding GPUs beside its server's)
    wait: bool = False  # join the queue when the GPUs are all taken (202), instead of a 409
    server: str | None = None  # the caller's server whose kernel asks ("": the default server):
    # the burst is released when that server stops; None: it lives by its lease alone
    hours: float | None = None  # how long it may run (None: the user's longest session)


def _label(body: dict, key: str) -> str | None:
    """An optional label field (a GPU model, a node name), or ``BadRequest``."""
    raw = body.get(key)
    if raw is None:
        return None
    try:
        return values.parse_label(raw, f"'{key}'")
    except values.BadValue as e:
        raise BadRequest(e.message) from None


def parse_burst_request(body: dict, *, max_lease_seconds: float) -> BurstRequest:
    _only(
        body,
        ("gpus", "nodes", "gpus_per_node", "gpu_model", "lease_seconds", "node", "wait", "server", "hours"),
    )
    model, node, server = _label(body, "gpu_model"), _label(body, "node"), _label(body, "server")
    if server is not None and "/" in server:
        raise BadRequest(
            "'server' must be the name of the server the kernel runs in (no '/'), or \"\" for the "
            f"default one; got {values.show(server)}."
        )
    wait = body.get("wait", False)
    if not isinstance(wait, bool):
        raise BadRequest(f"'wait' must be true or false; got {values.show(wait)}.")
    if node is not None and not node.strip():
        raise BadRequest("'node' must be a node's name, e.g. \"gpu1\", or absent for any node.")
    req = BurstRequest(
        gpus=_int(body, "gpus", lo=1, hi=MAX_COUNT, required=True),
        nodes=_int(body, "nodes", lo=1, hi=MAX_COUNT),
        gpus_per_node=_int(body, "gpus_per_node", lo=1, hi=MAX_COUNT),
        gpu_model=model or None,
        lease_seconds=_number(body, "lease_seconds", lo=10, hi=max_lease_seconds, unit="seconds"),
        node=node,
        wait=wait,
        server=server,
        hours=_hours(body),
    )
    if req.node is not None and (req.nodes or 1) != 1:
        raise BadRequest(
            f"'node' puts every GPU on one node; 'nodes' must then be 1 or absent, not {req.nodes}."
        )
    if req.gpus_per_node and req.gpus % req.gpus_per_node:
        raise BadRequest(f"'gpus' ({req.gpus}) must be a multiple of 'gpus_per_node' ({req.gpus_per_node}).")
    if req.gpus_per_node and req.nodes and req.nodes * req.gpus_per_node != req.gpus:
        raise BadRequest("'nodes' x 'gpus_per_node' must equal 'gpus'.")
    return req


def _hours(body: dict) -> float | None:
    try:
        return timelimits.parse_asked_hours(body.get("hours"), "'hours'", text=False)
    except values.BadValue as e:
        raise BadRequest(e.message) from None


def parse_renew(body: dict, *, max_lease_seconds: float) -> float | None:
    """The lease asked for; the body may also carry ``idle_seconds`` (``parse_activity``)."""
    _only(body, ("lease_seconds", "idle_seconds"))
    return _number(body, "lease_seconds", lo=10, hi=max_lease_seconds, unit="seconds")


MAX_IDLE_SECONDS = 10 * 365 * 86400.0


def parse_activity(body: dict) -> float | None:
    """``idle_seconds``: how long ago the owner's code was last active (0: busy now)."""
    return _number(body, "idle_seconds", lo=0, hi=MAX_IDLE_SECONDS, unit="seconds")


@dataclass(frozen=True)
class SamplesReport:
    samples: tuple  # of broker.utilization.Sample
    idle_seconds: float | None
    source: str
    refused: tuple = ()  # readings left out as impossible: ("node:index", field, value)


# the most a GPU board draws (the largest today take about 1.2 kW); a reading above is refused
MAX_GPU_WATTS = 2000
POWER_FIELDS = ("power_watts", "energy_mj")


def _reading(g: dict, key: str, hi: float, node: str, index: int, refused: list, whole: bool = False):
    """An optional reading of ``g``: None when absent, or when impossible (then in ``refused``)."""
    value = g.get(key)
    if value is None:
        return None
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
        what = "a whole number" if whole else "a number"
        raise BadRequest(f"'{key}' must be {what} from 0 to {hi:g} (null: not read); got {value!r}.")
    if not 0 <= value <= hi:
        refused.append((f"{node}:{index}", key, value))
        return None
    return int(value) if whole else float(value)


def parse_samples(body: dict) -> SamplesReport:
    """``{"gpus": [{"node", "index", "utilization", "memory_used_mib", "memory_total_mib",
    "power_watts", "energy_mj"}], "idle_seconds": 12.5, "source": "nvml"}``: what a server,
    an engine or a node's sampler measured (power and the energy counter optional)."""
    from spawner.broker.utilization import Sample

    _only(body, ("gpus", "idle_seconds", "source"))
    gpus = body.get("gpus")
    if not isinstance(gpus, list) or len(gpus) > MAX_COUNT:
        raise BadRequest(
            "'gpus' must be a list of samples, e.g. "
            '[{"node": "gpu1", "index": 0, "utilization": 87, "memory_used_mib": 1024}].'
        )
    samples, refused = [], []
    for i, g in enumerate(gpus):
        if not isinstance(g, dict):
            raise BadRequest(f"'gpus'[{i}] must be an object.")
        _only(g, ("node", "index", "utilization", "memory_used_mib", "memory_total_mib", *POWER_FIELDS))
        node = g.get("node")
        try:
            node = values.parse_label(node, "node")
        except values.BadValue:
            node = ""
        if not node:
            raise BadRequest(f"'gpus'[{i}]['node'] must be the GPU's node name.")
        index = _int(g, "index", lo=0, hi=MAX_COUNT, required=True)
        util = _number(g, "utilization", lo=0, hi=100)
        if util is None:
            raise BadRequest(f"'gpus'[{i}]['utilization'] is required: a percentage from 0 to 100.")
        used = _int(g, "memory_used_mib", lo=0, hi=2**31) or 0
        total = _int(g, "memory_total_mib", lo=0, hi=2**31)
        # a reading of power is the reporter's word: below zero or beyond any GPU's draw is refused
        # a reading of power is the reporter's word (the reporter may be the user's own process):
        # an impossible one (below zero, beyond any GPU's draw) is left out and counted, never
        # stored; the rest of the sample stands. Not a number at all: the body is refused.
        power = _reading(g, "power_watts", MAX_GPU_WATTS, node, index, refused)
        energy = _reading(g, "energy_mj", 2**63 - 1, node, index, refused, whole=True)
        samples.append(Sample(node, index, util, used, total, power, energy))
    source = body.get("source", "")
    if not isinstance(source, str) or len(source) > 32 or not source.isprintable():
        raise BadRequest("'source' must be a short name, e.g. \"nvml\".")
    return SamplesReport(tuple(samples), parse_activity(body), source, tuple(refused))


@dataclass(frozen=True)
class LimitBody:
    max_gpus: int | None
    gpu_hours: float | None
    window_hours: float


def parse_limit_body(body: dict, default_window_hours: float) -> LimitBody:
    _only(body, ("max_gpus", "gpu_hours", "window_hours"))
    if "max_gpus" not in body:
        raise BadRequest("'max_gpus' is required: a whole number of GPUs, or null for unlimited.")
    read = {}
    for key in ("max_gpus", "gpu_hours", "window_hours"):
        try:
            raw = body.get(key)
            read[key] = (
                None if raw is None else policy.parse_limit_field(key, raw, field=repr(key), text=False)
            )
        except values.BadValue as e:
            raise BadRequest(e.message) from None
    window = read["window_hours"]
    return LimitBody(
        read["max_gpus"], read["gpu_hours"], window if window is not None else default_window_hours
    )


def parse_job(body: dict) -> str:
    """``{"job_id": "123"}``: a Slurm job id (digits only)."""
    _only(body, ("job_id",))
    job = body.get("job_id")
    if isinstance(job, int) and not isinstance(job, bool):
        job = str(job)
    if not isinstance(job, str) or not re.fullmatch(r"[0-9]{1,18}", job):  # ASCII: not "²"
        raise BadRequest('\'job_id\' must be a Slurm job id (digits), e.g. {"job_id": "123"}.')
    return job


def parse_extend(body: dict) -> float:
    """``{"hours": 2}``: how much longer, in hours (a JSON number, a minute to a year)."""
    _only(body, ("hours",))
    if body.get("hours") is None:
        raise BadRequest("'hours' is required: how many hours more, e.g. {\"hours\": 2}.")
    try:
        return timelimits.parse_asked_hours(body["hours"], "'hours'", text=False)
    except values.BadValue as e:
        raise BadRequest(str(e)) from None
