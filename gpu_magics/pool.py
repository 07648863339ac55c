"""A warm pool of ipyparallel engines, one per rank, for ``%%distributed``.

Engines are separate long-lived processes started by ipyparallel (never forks of the
kernel). Each is set up once (``engine.setup_rank``: its GPU, torchrun's variables, the
process group) and then runs cell after cell, so imports, variables and models persist.

Running a cell streams every rank's output as it arrives, prefixed by rank. When a rank
fails, the others get ``grace`` seconds to finish, then SIGINT, then SIGKILL; a pool that
lost a rank, had a rank killed, or saw a distributed error is marked broken and rebuilt
before the next cell. A kernel interrupt is passed to every rank the same way.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .procs import alive
from .ranks import RankSpec
from .reaper import kill_trees

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
HEARTBEAT_MS = 500


@dataclass
class RankOutcome:
    rank: int
    status: str  # "ok", "error", "died", "killed", "interrupted"
    ename: str = ""
    evalue: str = ""
    traceback: str = ""


@dataclass
class CellOutcome:
    ranks: list[RankOutcome]
    result: dict | None = None  # rank 0's execute_result mimebundle
    broken: bool = False
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def failed(self) -> list[RankOutcome]:
        return [r for r in self.ranks if r.status != "ok"]


def is_distributed_error(ename: str, evalue: str) -> bool:
    """Errors that leave the process group unusable (a peer gone, a collective timed out)."""
    text = f"{ename} {evalue}".lower()
    return ename.startswith("Dist") or any(
        k in text for k in ("gloo", "nccl", "connection closed by peer", "timed out", "connection reset")
    )


class EnginePool:
    def __init__(
        self, specs: list[RankSpec], backend: str | None, timeout_s: float, launcher=None, n: int = 0
    ):
        self.specs = specs
        self.launcher = launcher  # a SlurmLauncher: engines as Slurm tasks, ranks from where they land
        self.n = n or len(specs)
        self.backend = backend
        self.timeout_s = timeout_s
        self.cluster = None
        self.client = None
        self.view = None
        self.engine_ids: list[int] = []
        self.infos: list[dict] = []
        self.broken = False
        self.controller_pid = 0
        self.reaper: subprocess.Popen | None = None
        self.report_allocation = 0  # the burst whose GPUs the engines hold (0: the server's own)
        self.multi_host = False  # ranks on several hosts: a TCPStore rendezvous, else a FileStore
        self.rendezvous: dict = {}

    @property
    def size(self) -> int:
        return len(self.specs) or self.n

    @property
    def pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def start(self, progress: Callable[[int, int], None], timeout: float = 120) -> None:
        import ipyparallel as ipp

        from .engine import setup_rank

        n = self.size
        if self.launcher is None:
            self.cluster = ipp.Cluster(n=0, controller_ip="127.0.0.1", log=_quiet_log())
        else:  # engines on Slurm nodes connect to this node
            self.cluster = ipp.Cluster(
                n=0, controller_ip="0.0.0.0", controller_location=self.launcher.location, log=_quiet_log()
            )
        # detect a dead engine in ~1.5 s rather than ~10 s
        self.cluster.controller_args = [f"--HeartMonitor.period={HEARTBEAT_MS}"]
        self.cluster.start_controller_sync()
        self.controller_pid = self.cluster.controller.pid
        self._start_reaper([self.controller_pid])  # from now on a killed kernel leaves nothing
        if self.launcher is None:
            self.cluster.start_engines_sync(n=n)
        else:
            from .slurmengines import engine_argv

            self.launcher.start(engine_argv(self.cluster))
            self._start_reaper([self.controller_pid, *self.launcher.local_pids])
        self.client = self.cluster.connect_client_sync()
        deadline = time.monotonic() + timeout
        up = -1
        while len(self.client.ids) < n:
            if len(self.client.ids) != up:
                up = len(self.client.ids)
                progress(up, n)
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.client.ids)} of {n} engines started in {timeout:.0f} s")
            self.client.spin()
            time.sleep(0.1)
        progress(n, n)
        self.engine_ids = sorted(self.client.ids)[:n]
        envs = [spec.env() for spec in self.specs]
        kernel_pid = os.getpid()
        if self.launcher is not None:
            envs, kernel_pid = self._slurm_ranks(timeout)
        if self.report_allocation:  # a burst's engines report their GPUs' use themselves
            envs = [dict(env, GPUHUB_REPORT_ALLOCATION=str(self.report_allocation)) for env in envs]
        envs, rendezvous = self._open_rendezvous(envs, timeout)
        setups = [
            self.client[eid].apply_async(
                setup_rank, env, self.backend, self.timeout_s, kernel_pid, rendezvous
            )
            for eid, env in zip(self.engine_ids, envs, strict=True)
        ]
        # wait for all together: rank 0 blocks in init_process_group until every rank is in,
        # so a rank that fails fast must be reported as itself, not as rank 0's timeout
        self.client.wait(setups, timeout=timeout)
        errors = [
            f"rank {spec.rank}: {ar.exception()}"
            for spec, ar in zip(self.specs, setups, strict=True)
            if ar.ready() and not ar.successful()
        ]
        if errors or not all(ar.ready() for ar in setups):
            raise RuntimeError(
                "engine setup failed: " + ("; ".join(errors) or f"timed out after {timeout:.0f} s")
            )
        self.infos = [ar.get() for ar in setups]
        self.view = self.client[self.engine_ids]
        mine = [] if getattr(self, "_remote", False) else self.pids  # only pids of this machine
        self._start_reaper([self.controller_pid, *mine, *(self.launcher.local_pids if self.launcher else [])])

    def _open_rendezvous(self, envs: list[dict], timeout: float) -> tuple[list[dict], dict]:
        """The process group's meeting place, made by rank 0's engine (``engine.open_rendezvous``):
        a private FileStore when every rank is on one node, else a TCPStore whose own port
        becomes MASTER_PORT (as torchrun's agent store is)."""
        from .engine import open_rendezvous

        kind = "tcp" if self.multi_host else "file"
        first = next(eid for eid, env in zip(self.engine_ids, envs, strict=True) if env["RANK"] == "0")
        rendezvous = (
            self.client[first].apply_async(open_rendezvous, kind, len(envs), self.timeout_s).get(timeout)
        )
        self.rendezvous = rendezvous
        if rendezvous["kind"] == "tcp":
            envs = [dict(env, MASTER_PORT=str(rendezvous["port"])) for env in envs]
        return envs, rendezvous

    def _slurm_ranks(self, timeout: float) -> tuple[list[dict], int]:
        """Ranks from where Slurm put each engine; a free port on rank 0's node."""
        import socket

        from .slurmengines import EngineFacts, assign_ranks, cuda_device, engine_facts

        raw = {eid: self.client[eid].apply_async(engine_facts) for eid in self.engine_ids}
        facts = {}
        for eid, ar in raw.items():
            d = ar.get(timeout=timeout)
            facts[eid] = EngineFacts(
                eid, d["node"], d["local_id"], tuple(d["gpus"]), tuple(d["cuda"]), d["host"], d["pid"]
            )
            self.launcher.step = self.launcher.step or d["step"]
        first = assign_ranks(list(facts.values()), 0, "gpuhub")[0][0]
        port = self.client[first].apply_async(_free_port).get(timeout=timeout)
        pairs = assign_ranks(list(facts.values()), port, f"gpuhub-{self.launcher.job_id}")
        self.engine_ids = [eid for eid, _ in pairs]
        self.specs = [spec for _, spec in pairs]
        envs = [dict(spec.env(), CUDA_VISIBLE_DEVICES=cuda_device(facts[eid])) for eid, spec in pairs]
        here = socket.gethostname()
        self._remote = any(f.host != here for f in facts.values())
        self.multi_host = len({f.host for f in facts.values()}) > 1
        return envs, 0 if self._remote else os.getpid()

    def _start_reaper(self, pids: list[int]) -> None:
        """(Re)start the reaper: a process of its own session that outlives a killed kernel
        and then ends the controller and the engines."""
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait()
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "gpu_magics.reaper", str(os.getpid()), *map(str, pids)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    # running a cell ---------------------------------------------------------------------

    def run(
        self, code: str, *, output: str = "all", grace: float = 10.0, ranks: list[int] | None = None
    ) -> CellOutcome:
        targets = ranks if ranks is not None else list(range(self.size))
        view = self.client[[self.engine_ids[r] for r in targets]]
        ar = view.execute(code, silent=False, block=False)
        stream = _Streamer(targets, show=lambda rank, name: output == "all" or rank == 0 or name == "stderr")
        failed_at = None
        signalled = killed = interrupted = False
        try:
            while True:
                ar.wait(0.1)
                stream.feed(ar.metadata)
                done = [md["status"] is not None for md in ar.metadata]
                if all(done):
                    break
                errors = [i for i, md in enumerate(ar.metadata) if done[i] and md["status"] != "ok"]
                if errors and failed_at is None:
                    failed_at = time.monotonic()
                if not alive(self.controller_pid):
                    self.kill(targets)  # no controller, no replies: nothing left to wait for
                    killed = True
                    break
                if failed_at is not None:
                    waited = time.monotonic() - failed_at
                    running = [targets[i] for i, d in enumerate(done) if not d]
                    if waited > grace and not signalled:
                        self.signal(signal.SIGINT, running)
                        signalled = True
                    elif waited > grace + 5 and not killed:
                        self.kill(running)
                        killed = True
                    elif waited > grace + 10:
                        break  # the controller will notice the dead engines; do not wait for it
        except KeyboardInterrupt:
            interrupted = True
            try:
                self.signal(signal.SIGINT, targets)
                deadline = time.monotonic() + 5
                while not ar.ready() and time.monotonic() < deadline:
                    ar.wait(0.1)
            finally:  # a second Ctrl-C lands here too: never leave ranks running unmarked
                if not ar.ready():
                    self.kill(targets)
                    killed = True
                    self.broken = True
        ar.wait(1)  # let the last replies of ranks that did finish arrive
        if ar.ready():
            # a reply can overtake the output printed just before it: wait for the output too
            ar.wait_for_output(timeout=5)
        stream.feed(ar.metadata)
        stream.close()
        outcome = self._outcome(targets, ar.metadata, killed)
        outcome.interrupted = interrupted
        # a killed or lost rank, an interrupt, or a distributed error leaves the group unusable
        self.broken = (
            killed
            or signalled  # a rank stopped mid-way may still have collectives in flight
            or interrupted
            or any(r.status in ("died", "killed") for r in outcome.ranks)
            or any(r.status == "error" and is_distributed_error(r.ename, r.evalue) for r in outcome.ranks)
        )
        outcome.broken = self.broken
        return outcome

    def _outcome(self, targets: list[int], metadata: list[dict], killed: bool) -> CellOutcome:
        ranks = []
        result = None
        for rank, md in zip(targets, metadata, strict=True):
            if md["status"] is None:
                ranks.append(RankOutcome(rank, "killed" if killed else "died", "Stopped", "did not finish"))
                continue
            res = md.get("error")
            if md["status"] == "ok":
                ranks.append(RankOutcome(rank, "ok"))
                if rank == 0 and md.get("execute_result"):
                    result = md["execute_result"]
                continue
            ename = getattr(res, "ename", type(res).__name__)
            evalue = str(getattr(res, "evalue", res))
            tb = getattr(res, "traceback", "") or ""
            tb = ANSI.sub("", "\n".join(tb) if isinstance(tb, list) else str(tb))
            gone = rank < len(self.infos) and not alive(self.infos[rank]["pid"])
            if res is None or ename == "EngineError" or gone:
                status = "killed" if killed else "died"
            elif ename == "KeyboardInterrupt":
                status = "interrupted"
            else:
                status = "error"
            ranks.append(RankOutcome(rank, status, ename, evalue, tb))
        return CellOutcome(ranks, result)

    # signals and shutdown ----------------------------------------------------------------

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        if self.launcher is not None and getattr(self, "_remote", False):
            # pids on other machines mean nothing here: Slurm signals every engine task
            self.launcher.signal(sig)
            return
        for r in ranks if ranks is not None else range(self.size):
            try:
                os.kill(self.infos[r]["pid"], sig)
            except (ProcessLookupError, IndexError):
                pass

    def kill(self, ranks: list[int] | None = None) -> None:
        self.signal(signal.SIGKILL, ranks)

    def stop(self) -> None:
        """Stop engines and controller. A broken pool's engines are killed outright (a rank
        stuck in a collective ignores polite requests); ipyparallel's own chatter about
        engines it did not stop itself is kept out of the notebook."""
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                if self.broken:
                    self.kill()
                if self.client is not None:
                    self.client.close()
                if self.cluster is not None:
                    self.cluster.stop_cluster_sync()
                if self.launcher is not None:
                    self.launcher.stop()
        except Exception as e:  # stopping must not fail the caller; the processes are ended below
            print(f"gpuhub: while stopping the engines: {e}", file=sys.stderr)
        finally:
            # whatever ipyparallel managed (at interpreter exit it often cannot), end them all
            local = [] if getattr(self, "_remote", False) else self.pids
            if self.launcher is not None:
                local = [*local, *self.launcher.local_pids]
            kill_trees([pid for pid in (self.controller_pid, *local) if pid])
            if self.rendezvous.get("kind") == "file" and not getattr(self, "_remote", False):
                shutil.rmtree(os.path.dirname(self.rendezvous["path"]), ignore_errors=True)
            if self.reaper is not None:
                self.reaper.kill()
                self.reaper.wait()
            self.cluster = self.client = self.view = self.reaper = None
            self.infos = []  # these pids are not ours any more: never signal them again


def _free_port() -> int:
    """Runs on rank 0's engine: a port free on its node for the process group."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _quiet_log() -> logging.Logger:
    """ipyparallel logs each engine's whole output when it stops one; keep that out of cells."""
    log = logging.getLogger("gpuhub.engines")
    log.propagate = False
    log.setLevel(logging.ERROR)
    if not log.handlers:
        log.addHandler(logging.StreamHandler(sys.__stderr__))
    return log


class _Streamer:
    """Prints new output of each rank as whole lines, prefixed ``[rank N]``."""

    def __init__(self, ranks: list[int], show: Callable[[int, str], bool]):
        self.ranks = ranks
        self.show = show
        self.seen = {(r, s): 0 for r in ranks for s in ("stdout", "stderr")}
        self.partial = {(r, s): "" for r in ranks for s in ("stdout", "stderr")}

    def feed(self, metadata: list[dict]) -> None:
        for rank, md in zip(self.ranks, metadata, strict=True):
            for name in ("stdout", "stderr"):
                text = md.get(name) or ""
                key = (rank, name)
                new, self.seen[key] = text[self.seen[key] :], len(text)
                if not new:
                    continue
                lines = (self.partial[key] + new).split("\n")
                self.partial[key] = lines.pop()
                self._emit(rank, name, lines)

    def close(self) -> None:
        for (rank, name), rest in self.partial.items():
            if rest:
                self._emit(rank, name, [rest])
            self.partial[(rank, name)] = ""

    def _emit(self, rank: int, name: str, lines: list[str]) -> None:
        if not lines or not self.show(rank, name):
            return
        out = sys.stdout if name == "stdout" else sys.stderr
        out.write("".join(f"[rank {rank}] {line}\n" for line in lines))
        out.flush()
