"""A soak: scripted users on a real hub (the real proxy and broker, simulated GPUs) for a bounded,
compressed stretch of a working day, with faults injected on a schedule while it runs; then the
ledger's history, every answer the users got, and the machine are checked. Shared by
``tests/test_soak.py`` (a short one, in the suite) and ``benchmarks/soak.py`` (a long one, by
hand, its figures in ``docs/reliability.md``).

What the users do, each in a thread of its own, at random (seeded) moments:

- start a server of 0 to 3 GPUs through the REST API (a lab member's 3 is 1 borrowed), or stop
  it: ready, starting, or still waiting in the queue (a wait cancelled);
- take a one-GPU ``%%distributed`` burst through the broker's API, of the server or not, keep
  renewing its lease or abandon it (a kernel that died: the lease ends it), and give it back;
- leave servers idle: the broker warns and reclaims them (``c.GpuReclaim``).

An admin raises one user's limit and puts it back, over and over. Faults, on the schedule:
the broker SIGKILLed (the hub starts it again), the proxy SIGKILLed (the hub starts it again),
the hub restarted (servers kept: ``cleanup_servers = False``), a user's server SIGKILLed, a
server stopped with SIGSTOP for a while, and on PostgreSQL every connection of the ledger's
database ended by the server (what a database restart does to its clients).

Every loop is bounded in count and time, and talks only to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

import requests

from spawner.ledger import Ledger, utcnow

from .hubtools import Hub, wait_for
from .invariants import check_invariants, history, unfinished
from .stormtools import stop_all

LEASE = 15.0  # seconds a burst lives without renewal (c.GpuBroker.lease_seconds)
SETTLE = 20.0  # after a fault's service is back, what it may still answer as unavailable
KILLED_SERVER_ENDS = 60.0  # a SIGKILLed server's GPUs come back within this (the hub's poll, 1 s)
KEEPALIVE = 30.0  # c.GpuHub.queue_keepalive_seconds: a wait lost with its spawn ends this later
FAULTS = ("broker", "server_kill", "proxy", "server_pause", "hub", "database")
SLURM_FAULTS = ("broker", "server_kill", "slurmctld", "hub")  # the Slurm test cluster's soak


def config(gpus: int, lab: list[str], admin_target: str, slurm: bool = False) -> str:
    """The soak's hub: ``gpus`` simulated GPUs (on Slurm: the test cluster's), limits of 1 and
    2 for the lab, which may borrow 1 more on the local backend."""
    local = f"""
c.GpuHub.simulated_gpus = [{{"count": {gpus}, "model": "Simulated A100", "memory_mib": 40960}}]
c.GpuHub.group_borrow = {{"lab": 1}}
c.Spawner.http_timeout = 120
"""
    return f"""
c.JupyterHub.cleanup_servers = False  # a hub restart keeps the servers
c.JupyterHub.concurrent_spawn_limit = 0
c.JupyterHub.load_groups = {{"lab": {{"users": {lab!r}}}}}
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {{"lab": 2}}
c.GpuHub.user_limits = {{}}
c.GpuHub.preempt_grace_seconds = 5
c.GpuHub.queue_poll_seconds = 1
c.GpuHub.queue_keepalive_seconds = {KEEPALIVE}
c.GpuReclaim.warn_after_seconds = 15
c.GpuReclaim.reclaim_after_seconds = 30
c.GpuBroker.lease_seconds = {LEASE}
c.Spawner.start_timeout = 120
""" + ("" if slurm else local)


def limits_of(lab: list[str], admin_target: str):
    """Each user's limit and borrowing allowance as configured; the admin's target (not in the
    lab), the highest limit the admin ever gives it (3)."""

    def limits(user: str) -> tuple[int, int]:
        if user == admin_target:
            return 3, 0
        return (2, 1) if user in lab else (1, 0)

    return limits


@dataclass
class Answer:
    t: float  # monotonic
    who: str
    what: str
    status: int  # 0: no answer (unreachable)
    body: str = ""
    broker: bool = False  # gpuhub's broker answered (else JupyterHub's API, gpuhub's spawner within)


@dataclass
class Fault:
    name: str
    start: float
    end: float | None = None
    detail: str = ""


@dataclass
class Soak:
    hub: Hub
    users: list[str]
    lab: list[str]
    admin_target: str
    duration: float
    seed: int = 0
    schedule: tuple[str, ...] = FAULTS
    database: str = ""  # the PostgreSQL application_name of the ledger's connections, if any
    answers: list[Answer] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    kills: list[tuple[datetime, str, int]] = field(default_factory=list)  # (when, user, allocation)
    until: float = 0.0
    stop_5xx: int = 0
    slurm: bool = False  # the hub's servers are jobs of the Slurm test cluster
    researcher: str = ""  # a lab member training in a %%distributed pool all along (none: "")
    research: list[str] = field(default_factory=list)  # what the researcher saw go wrong
    cells: int = 0  # the researcher's training cells that ran
    interrupts: int = 0  # and the cells interrupted among them
    crashed: list[str] = field(default_factory=list)  # a scripted actor's thread that raised
    leftover: list[str] = field(default_factory=list)  # what still ran after the shutdown

    # one answer ------------------------------------------------------------------------

    def call(self, who: str, what: str, method: str, path: str, broker_token: str | None = None, **kw):
        """One request (the hub's REST API, or the broker's with ``broker_token``), its answer
        kept; None where nothing answered."""
        try:
            if broker_token is not None:
                r = self.hub.broker(method, path, broker_token, **kw)
            else:
                r = self.hub.api(method, path, **kw)
        except requests.RequestException as e:
            self.answers.append(
                Answer(time.monotonic(), who, what, 0, str(e)[:200], broker_token is not None)
            )
            return None
        self.answers.append(
            Answer(time.monotonic(), who, what, r.status_code, r.text[:300], broker_token is not None)
        )
        return r

    # the users ---------------------------------------------------------------------------

    def user(self, name: str, token: str, rng: random.Random) -> None:
        sizes = [0, 1, 1, 2, 3] if name in self.lab or name == self.admin_target else [0, 1, 1, 2]
        bursts: dict[int, bool] = {}  # id -> whether it is renewed (False: abandoned)
        for _ in range(10_000):
            if time.monotonic() >= self.until:
                break
            r = self.call(name, "model", "GET", f"/users/{name}")
            server = r.json()["servers"].get("") if r is not None and r.status_code == 200 else None
            roll = rng.random()
            if server is None:
                if roll < 0.6:
                    gpus = rng.choice(sizes)
                    self.call(
                        name, "start", "POST", f"/users/{name}/server", json={"user_options": {"gpus": gpus}}
                    )
            elif roll < 0.08:
                self.call(name, "stop", "DELETE", f"/users/{name}/server")  # ready, starting or waiting
            elif roll < 0.3 and server.get("ready"):
                body = {"gpus": 1, "lease_seconds": LEASE} | ({"server": ""} if rng.random() < 0.5 else {})
                r = self.call(name, "burst", "POST", "allocations", token, json=body)
                if r is not None and r.status_code == 201:
                    bursts[r.json()["id"]] = rng.random() < 0.8
            for aid, renewed in list(bursts.items()):
                if renewed and rng.random() < 0.15:
                    r = self.call(name, "give back", "DELETE", f"allocations/{aid}", token)
                    if r is not None and r.status_code in (200, 204, 409):
                        del bursts[aid]
                elif renewed:
                    r = self.call(name, "renew", "POST", f"allocations/{aid}/renew", token, json={})
                    if r is not None and r.status_code == 409:  # preempted, reclaimed or released
                        del bursts[aid]
            time.sleep(rng.uniform(1.0, 3.0))
        for aid in bursts:  # the user's session ends: what it still holds is given back
            self.call(name, "give back", "DELETE", f"allocations/{aid}", token)

    def admin(self, token: str, rng: random.Random) -> None:
        for i in range(10_000):
            if time.monotonic() >= self.until:
                break
            if i % 2 == 0:
                self.call(
                    "admin", "limit", "PUT", f"limits/user/{self.admin_target}", token, json={"max_gpus": 3}
                )
            else:
                self.call("admin", "limit", "DELETE", f"limits/user/{self.admin_target}", token)
            time.sleep(rng.uniform(5, 10))

    def train(self, kc) -> None:
        """The researcher: a 2-rank pool on the server's own 2 GPUs with ``--autosave``, one
        training step per cell all along (each rank's state checked after each), every tenth
        cell one that sleeps and is interrupted (the stop button: the state is kept), then
        ``%distributed shutdown`` (which autosaves), a new pool, and a restore whose bytes must be
        the last step's, on every rank."""
        from .kerneltools import run_cell

        d = self.hub.dir / "research-checkpoints"
        steps = 0

        def cell(code: str, timeout: float = 120) -> str:
            status, out = run_cell(kc, code, timeout=timeout)
            if status != "ok":
                self.research.append(f"cell {code.splitlines()[0]!r} failed: {out[-300:]}")
            return out

        def ranks_hold(out: str, n: int, when: str) -> None:
            seen = sorted(re.findall(r"W (\d+) (-?\d+)", out))
            if seen != [("0", str(n)), ("1", str(n))]:
                self.research.append(f"{when}: the ranks hold {seen}, not step {n} on both")

        cell(f"%%distributed --gpus 2 --timeout 60 --autosave w --dir {d}\nimport torch\nw = torch.zeros(4)")
        for _ in range(1000):
            if time.monotonic() >= self.until - 30 or self.research:
                break
            out = cell("%%distributed --timeout 60\nw += 1\nprint('W', rank, int(w[0]), flush=True)")
            steps += 1
            ranks_hold(out, steps, f"step {steps}")
            self.cells += 1
            if steps % 10 == 5:
                self.interrupt_a_cell(kc)
            time.sleep(1)
        out = cell("%distributed shutdown")
        if "autosaved before %distributed shutdown" not in out:
            self.research.append(f"the shutdown did not say it autosaved: {out[-300:]}")
        cell("%%distributed --gpus 2 --timeout 60\nimport torch\nw = torch.full((4,), -1.0)")
        cell(f"%distributed restore w --dir {d}")
        ranks_hold(cell("%%distributed\nprint('W', rank, int(w[0]), flush=True)"), steps, "restored")
        cell("%distributed shutdown")

    def interrupt_a_cell(self, kc) -> None:
        """A cell that sleeps on both ranks, interrupted through the server's REST API (as
        JupyterLab's stop button): it must end with a KeyboardInterrupt, not hang or die."""
        sent = kc.execute(
            "%%distributed --timeout 60\nimport time\nprint('SLEEPING', rank, flush=True)\ntime.sleep(90)"
        )
        shown, deadline = "", time.monotonic() + 60
        while shown.count("SLEEPING") < 2 and time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                msg = kc.get_iopub_msg(timeout=1)
                if msg["parent_header"].get("msg_id") == sent and msg["msg_type"] == "stream":
                    shown += msg["content"]["text"]
        kernel = os.path.basename(kc.connection_file).removeprefix("kernel-").removesuffix(".json")
        path = f"/user/{self.researcher}/api/kernels/{kernel}/interrupt"
        for _ in range(60):  # the proxy or the hub may be down (a fault): pressed again
            try:
                r = self.hub.api_url_request("POST", path)
            except requests.RequestException:
                time.sleep(1)
                continue
            if r.status_code < 500:
                break
            time.sleep(1)
        else:
            self.research.append("the interrupt could not be sent for 60 s")
            return
        if r.status_code != 204:
            self.research.append(f"the interrupt answered {r.status_code}: {r.text[:200]}")
        while time.monotonic() < deadline + 60:
            with contextlib.suppress(queue.Empty):
                reply = kc.get_shell_msg(timeout=1)
                if reply["parent_header"].get("msg_id") == sent:
                    if reply["content"].get("ename") != "KeyboardInterrupt":
                        self.research.append(f"the interrupted cell ended {reply['content']}"[:300])
                    self.interrupts += 1
                    return
        self.research.append("the interrupted cell never ended")

    # the faults --------------------------------------------------------------------------

    def _ready_servers(self, ledger: Ledger, holding_only: bool = False) -> list[tuple[str, int]]:
        """Users' ready servers (not the researcher's), those holding GPUs first (only those)."""
        out = []
        for user in self.users:
            try:
                s = self.hub.server(user)
                if s and s.get("ready"):
                    out.append((user, self.hub.server_pid(user)))  # on Slurm: in its job
            except (requests.RequestException, AssertionError, KeyError, TypeError, ValueError):
                continue
        holding = {a.user for a in ledger.active(purpose="server") if a.gpus}
        return [r for r in out if r[0] in holding] or ([] if holding_only else out)

    def inject(self, name: str, ledger: Ledger, rng: random.Random) -> Fault:
        f = Fault(name, time.monotonic())
        self.faults.append(f)
        if name == "broker":
            pid = self.hub.broker_pid()
            os.kill(pid, signal.SIGKILL)
            f.detail = f"broker {pid} SIGKILLed"
            wait_for(lambda: _pid_or_none(self.hub.broker_pid) not in (None, pid), 120, "a broker again")
            self.hub.wait_for_broker(120)
        elif name == "proxy":
            pid = self.hub.proxy_pid()
            os.kill(pid, signal.SIGKILL)
            f.detail = f"proxy {pid} SIGKILLed"
            wait_for(lambda: _answers(f"{self.hub.url}/hub/api/"), 120, "the hub to start the proxy again")
        elif name == "hub":
            self.hub.stop()
            self.hub.start(timeout=120)
            self.hub.wait_for_broker(120)
            f.detail = "hub stopped (SIGTERM) and started again"
        elif name in ("server_kill", "server_pause"):
            ready = []
            for i in range(60):  # up to 30 s for a user's server holding GPUs (any, after 20 s)
                ready = self._ready_servers(ledger, holding_only=i < 40)
                if ready:
                    break
                time.sleep(0.5)
            if not ready:
                f.detail = "no ready server to hit"
            else:
                user, pid = rng.choice(ready)
                held = [a.id for a in ledger.active(user=user) if a.purpose == "server"]
                if name == "server_kill":
                    os.kill(pid, signal.SIGKILL)
                    self.kills.extend((utcnow(), user, a) for a in held)
                    f.detail = f"{user}'s server {pid} SIGKILLed"
                else:
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(8)
                    os.kill(pid, signal.SIGCONT)
                    f.detail = f"{user}'s server {pid} stopped (SIGSTOP) for 8 s"
        elif name == "slurmctld":
            from . import slurmtools

            pid = int((slurmtools.STATE_DIR / "run" / "slurmctld.pid").read_text())
            os.kill(pid, signal.SIGTERM)
            down = slurmtools.slurm
            wait_for(lambda: down("squeue", "-h", check=False).returncode != 0, 30, "slurmctld to stop")
            subprocess.run([str(slurmtools.SCRIPT), "start"], check=True, capture_output=True)
            f.detail = f"slurmctld {pid} stopped (SIGTERM) and started again"
        elif name == "database":
            if not self.database:
                f.detail = "SQLite: no database server to restart"
            else:
                from .dbtools import end_connections

                f.detail = f"ended {end_connections(self.database)} connections of the ledger's database"
        f.end = time.monotonic()
        return f

    # the run -----------------------------------------------------------------------------

    def run(self) -> None:
        rng = random.Random(self.seed)
        tokens = {u: self.hub.user_token(u) for u in self.users}
        admin = self.hub.user_token("admin")
        ledger = Ledger(self.hub.ledger_url)
        kc = None
        if self.researcher:  # first, so that its server does not wait behind the others
            assert self.hub.spawn(self.researcher, {"gpus": 2}).status_code in (201, 202)
            self.hub.wait_ready(self.researcher, timeout=120)
            kc = self.hub.server_kernel(self.researcher)
        self.until = time.monotonic() + self.duration
        threads = [
            threading.Thread(
                target=self.guarded(self.user), args=(u, tokens[u], random.Random(rng.random())), daemon=True
            )
            for u in self.users
        ] + [
            threading.Thread(
                target=self.guarded(self.admin), args=(admin, random.Random(rng.random())), daemon=True
            )
        ]
        if kc is not None:
            threads.append(threading.Thread(target=self.guarded(self.train), args=(kc,), daemon=True))
        for th in threads:
            th.start()
        try:
            gap = self.duration / (len(self.schedule) + 1)
            for i, name in enumerate(self.schedule):
                time.sleep(max(0.0, self.until - self.duration + gap * (i + 1) - time.monotonic()))
                self.inject(name, ledger, rng)
        finally:
            for th in threads:
                th.join(max(1.0, self.until - time.monotonic() + 180))
            if kc is not None:
                kc.stop_channels()
            ledger.close()

    def guarded(self, actor):
        """``actor`` for a thread: what it raises is a problem of the run, not a thread that
        ends unseen (and the checks of what it would have done after, skipped)."""

        def run(*args):
            try:
                actor(*args)
            except Exception as e:
                self.crashed.append(f"{actor.__name__}{args[:1]}: {e!r}"[:400])

        return run

    def shutdown(self) -> None:
        """Stop every server (a waiting one leaves the queue), then the hub; what is still
        running after that is killed, and the problems say so."""
        try:
            self.stop_5xx = stop_all(self.hub, self.users + ([self.researcher] if self.researcher else []))
            if self.slurm:  # every server's job ends with it
                from .slurmtools import slurm

                def jobs() -> list[str]:
                    return slurm("squeue", "-h", "-o", "%i %u %T").stdout.split("\n")

                with contextlib.suppress(AssertionError):
                    wait_for(lambda: jobs() == [""], 60, "every job to end")
                self.leftover += [f"Slurm job {j}" for j in jobs() if j]
            # a wait whose spawn a hub restart lost ends at the keepalive (the broker's sweep)
            ledger = Ledger(self.hub.ledger_url)
            try:
                deadline = time.monotonic() + KEEPALIVE + 15
                while ledger.queue() and time.monotonic() < deadline:
                    time.sleep(0.5)
            finally:
                ledger.close()
        finally:
            self.hub.stop()
            left = left_running(self.hub)
            self.leftover += [f"{pid} {command_line(pid)}" for pid in left]
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def run_checked(self) -> dict:
        """A test's soak: :meth:`run` and :meth:`shutdown`; then no problem, every fault ran
        with something to hit, users got GPUs and a server was killed. Its figures."""
        try:
            self.hub.wait_for_broker()
            for user in self.users:
                self.hub.ensure_user(user)
            self.run()
        finally:
            self.shutdown()
        figures = self.figures()
        print(figures)
        problems = self.problems()
        assert problems == [], "\n".join(problems)
        assert [f.name for f in self.faults] == list(self.schedule)
        assert all("no ready server" not in f.detail for f in self.faults), figures["faults"]
        assert figures["allocations"] > 0 and self.kills, figures
        return figures

    # after it ------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """What the run broke, empty when nothing: the ledger's history and ends, every
        answer, the killed servers' GPUs, and what was still running (after :meth:`shutdown`)."""
        url = self.hub.ledger_url
        out = list(unfinished(url))
        out += check_invariants(*history(url), limits=limits_of(self.lab, self.admin_target))
        out += [f"the researcher's pool: {p}" for p in self.research]
        out += [f"a scripted actor stopped on an error: {c}" for c in self.crashed]
        out += [
            f"{a.who}'s {a.what} answered {a.status}: {a.body[:120]}" for a in self.answers if self.wrong(a)
        ]
        if self.stop_5xx:
            out.append(f"{self.stop_5xx} stops after the run answered 500 or more")
        ledger = Ledger(url)
        try:
            for killed, user, aid in self.kills:
                a = ledger.get(aid)
                if a.ended is None or (a.ended - killed).total_seconds() > KILLED_SERVER_ENDS:
                    out.append(
                        f"{user}'s killed server's allocation {aid} ended at {a.ended} (killed {killed})"
                    )
        finally:
            ledger.close()
        out += [f"still running after the hub stopped: {p}" for p in self.leftover]
        return out

    def wrong(self, a: Answer) -> bool:
        """An answer no user should get: any 500 (but JupyterHub's own while it stops: it
        answers 500 to the requests it cuts short, ``docs/known-issues.md``); a 502-504 or no
        answer at all, except while a fault's service was down (and ``SETTLE`` s after); a
        refusal without its reason."""
        if a.status == 500:
            return a.broker or not any(
                f.name == "hub" and f.start <= a.t <= (f.end or a.t) for f in self.faults
            )
        if 400 <= a.status < 500 and not a.body.strip():
            return True
        if a.status in (0, 502, 503, 504):
            return not any(f.start <= a.t <= (f.end or a.t) + SETTLE for f in self.faults)
        return a.status > 504

    def figures(self) -> dict:
        ledger = Ledger(self.hub.ledger_url)
        try:
            since = datetime(1970, 1, 1)
            allocations, entries = history(self.hub.ledger_url)
            return {
                "answers": len(self.answers),
                "by status": dict(sorted(Counter(a.status for a in self.answers).items())),
                "by request": dict(sorted(Counter(f"{a.what} {a.status}" for a in self.answers).items())),
                "starts": sum(a.what == "start" for a in self.answers),
                "bursts granted": sum(a.what == "burst" and a.status == 201 for a in self.answers),
                "allocations": len({r[0] for r in allocations}),
                "waits": len(entries),
                "preemptions": len(ledger.preemptions(since=since)),
                "reclaims": len(ledger.reclaims(since=since)),
                "training cells": self.cells,
                "interrupted cells": self.interrupts,
                "faults": [
                    f"{f.name}: {f.detail} ({(f.end or f.start) - f.start:.1f} s)" for f in self.faults
                ],
            }
        finally:
            ledger.close()


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "(gone)"


def _pid_or_none(find) -> int | None:
    try:
        return find()
    except AssertionError:  # none now
        return None


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def left_running(hub: Hub) -> list[int]:
    """Processes of this hub still alive (its servers, broker and proxy know its port)."""
    marks = (f":{hub.hub_port}/hub/api", f":{hub.broker_port}", f"127.0.0.1:{hub.proxy_api_port}")
    out = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                env = fh.read().decode(errors="replace")
            with open(f"/proc/{entry.name}/cmdline", "rb") as fh:
                env += fh.read().decode(errors="replace")
        except OSError:
            continue
        if any(m in env for m in marks):
            out.append(int(entry.name))
    return out
