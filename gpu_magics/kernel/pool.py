"""A warm pool of ipyparallel engines, one per rank, for ``%%distributed``.

Engines are separate long-lived processes started by ipyparallel (never forks of the
kernel). Each is set up once (``engine.rank.setup_rank``: its GPU, torchrun's variables, the
process group) and then runs cell after cell, so imports, variables and models persist.

Running a cell streams every rank's output as it arrives, prefixed by rank. When a rank
fails, the others get ``grace`` seconds to finish, then SIGINT; an interrupt of the kernel
sends SIGINT to every rank. A rank still running after that is stuck in a collective and is
freed by SIGUSR1 (``recovery``), without losing its process; only a rank that still does not
stop is killed. Then the process groups are kept where they are still consistent, or
reconnected in place (the same group objects, ``engine.groups``). Only a lost process
(killed, died) breaks the pool: its next cell starts fresh engines. Where the engines run is
the launcher's (``gpu_magics.launch``); the pool takes the ranks' placement from it
(``launch.base.Placement``).

About 570 lines: one object's lifecycle (start, run a cell, settle the group, stop) around one
ipyparallel client; the pure steps of a stop (``next_step``) and the output streamer are its
own and tested as such (tests/test_magics_rules.py); what becomes of the groups is
``kernel.regroup``'s (tests/test_regroup.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpu_magics.common import guard
from gpu_magics.common.procs import ExitWatch, alive
from gpu_magics.common.ranks import RankSpec
from gpu_magics.engine.recovery import FREE_SIGNAL
from gpu_magics.kernel import regroup
from gpu_magics.launch.base import Launcher
from gpu_magics.launch.local import LocalLauncher
from gpu_magics.launch.reaper import kill_trees

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
    freed: list[int] = field(default_factory=list)  # ranks freed from a stuck collective
    places: dict[int, str] = field(default_factory=dict)  # where failed ranks ran, before a shrink
    shrunk: list[str] = field(default_factory=list)  # the pool shrank in place without the lost ranks

    @property
    def failed(self) -> list[RankOutcome]:
        return [r for r in self.ranks if r.status != "ok"]


FREE_AFTER = 1.0  # s after SIGINT: a rank still running is stuck in a collective, and freed
KILL_AFTER = 5.0  # s after freeing: a rank still running is killed (its state is lost)
SHUTDOWN_WAIT = 2.0  # s a graceful stop waits for the engines' replies to a shutdown request


def next_step(elapsed: float, taken: frozenset[str]) -> str | None:
    """What to do next to the ranks still running ``elapsed`` seconds after their stop began
    (a failure's grace period over, or an interrupt), given the steps ``taken``."""
    if "interrupt" not in taken:
        return "interrupt"
    if elapsed >= FREE_AFTER and "free" not in taken:
        return "free"
    if elapsed >= FREE_AFTER + KILL_AFTER and "kill" not in taken:
        return "kill"
    if elapsed >= FREE_AFTER + KILL_AFTER + 5:
        return "give up"
    return None


@dataclass
class _Escalation:
    started: float | None = None
    taken: frozenset[str] = frozenset()
    freed: set[int] = field(default_factory=set)
    killed: bool = False

    def start(self, at: float) -> None:
        if self.started is None:
            self.started = at

    def step(self, now: float, running: list[int], pool: EnginePool) -> str | None:
        if self.started is None or now < self.started or not running:
            return None
        action = next_step(now - self.started, self.taken)
        if action is None:
            return None
        self.taken |= {action}
        if action == "interrupt":
            pool.signal(signal.SIGINT, running)
        elif action == "free":
            stuck = [r for r in running if pool.can_free(r)]
            if stuck:
                pool.signal(FREE_SIGNAL, stuck)
            self.freed |= set(stuck)
        elif action == "kill":
            pool.kill(running)
            self.killed = True
        return action


class EnginePool:
    # a graceful stop asks the engines to shut down before the launcher's signals (off: the
    # signals alone, as before; benchmarks/pool_stop.py measures both)
    ask_engines_first = True

    def __init__(
        self,
        specs: list[RankSpec],
        backend: str | None,
        timeout_s: float,
        launcher: Launcher | None = None,
        n: int = 0,
    ):
        self.specs = specs
        # where the engines run (launch.local.LocalLauncher, launch.slurm.SlurmLauncher)
        self.launcher: Launcher = launcher if launcher is not None else LocalLauncher(specs)
        self._remote = False  # ranks on other machines than the kernel's (the launcher's placement)
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
        self._exits: ExitWatch | None = None  # the engines' processes here (``_ended``)

    @property
    def size(self) -> int:
        return len(self.specs) or self.n

    @property
    def pids(self) -> list[int]:
        return [info["pid"] for info in self.infos]

    def start(self, progress: Callable[[int, int], None], timeout: float = 120) -> None:
        import ipyparallel as ipp

        from gpu_magics.engine.rank import setup_rank

        n = self.size
        self.cluster = ipp.Cluster(n=0, log=_quiet_log(), **self.launcher.cluster_options())
        # detect a dead engine in ~1.5 s rather than ~10 s; log warnings only (at its default,
        # INFO, the controller writes two lines per request and engine: every rank, every cell);
        # its channels as the launcher says (channels: Unix sockets here, CurveZMQ everywhere)
        self.cluster.controller_args = [
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            "--log-level=WARN",
            *self.launcher.controller_args,
        ]
        self.cluster.start_controller_sync()
        self.controller_pid = self.cluster.controller.pid
        self._start_reaper([self.controller_pid])  # from now on a killed kernel leaves nothing
        self.launcher.launch(self.cluster, n)
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
            time.sleep(0.1)
        progress(n, n)
        self.engine_ids = sorted(self.client.ids)[:n]
        placement = self.launcher.place(self.client, self.engine_ids, timeout)
        self.engine_ids, self.specs = list(placement.engine_ids), list(placement.specs)
        self._remote, self.multi_host = placement.remote, placement.multi_host
        envs = list(placement.envs)
        kernel_pid = 0 if self._remote else os.getpid()  # each engine's watchdog, where it can see it
        if self.report_allocation:  # a burst's engines report their GPUs' use themselves
            ids = self.report_allocation  # one allocation, or each rank's (a split burst)
            ids = [ids] * len(envs) if isinstance(ids, int) else list(ids)
            envs = [dict(env, GPUHUB_REPORT_ALLOCATION=str(ids[int(env["RANK"])])) for env in envs]
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
        mine = [] if self._remote else self.pids  # only pids of this machine
        self._start_reaper([self.controller_pid, *mine, *self.launcher.local_pids])

    def _open_rendezvous(self, envs: list[dict], timeout: float) -> tuple[list[dict], dict]:
        """The process group's meeting place, made by rank 0's engine (``engine.rendezvous.open_rendezvous``):
        a private FileStore when every rank is on one node, else a TCPStore whose own port
        becomes MASTER_PORT (as torchrun's agent store is)."""
        from gpu_magics.engine.rendezvous import open_rendezvous

        kind = "tcp" if self.multi_host else "file"
        first = next(eid for eid, env in zip(self.engine_ids, envs, strict=True) if env["RANK"] == "0")
        rendezvous = (
            self.client[first].apply_async(open_rendezvous, kind, len(envs), self.timeout_s).get(timeout)
        )
        self.rendezvous = rendezvous
        if rendezvous["kind"] == "tcp":
            envs = [dict(env, MASTER_PORT=str(rendezvous["port"])) for env in envs]
        return envs, rendezvous

    def _start_reaper(self, pids: list[int]) -> None:
        """(Re)start the reaper: a process of its own session that outlives a killed kernel
        and then ends the controller and the engines."""
        if self.reaper is not None:
            self.reaper.kill()
            self.reaper.wait()
        sockets = getattr(self.launcher, "socket_dir", None)  # removed too, should the kernel die
        held = guard.current_path()  # the kernel's bursts: given back at its death
        self.reaper = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpu_magics.launch.reaper",
                str(os.getpid()),
                *map(str, pids),
                *([f"--remove={sockets}"] if sockets else []),
                *([f"--guard={held}"] if held else []),
            ],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    # running a cell ---------------------------------------------------------------------

    def run(
        self,
        code: str,
        *,
        output: str = "all",
        grace: float = 10.0,
        ranks: list[int] | None = None,
        tick: Callable[[], None] | None = None,
    ) -> CellOutcome:
        """Run ``code`` on the ranks. After a rank fails, the others get ``grace`` seconds, then
        SIGINT; after an interrupt every rank gets SIGINT. A rank still running ``FREE_AFTER``
        seconds later is stuck (in a collective): SIGUSR1 frees it (``recovery``); only one
        still running ``KILL_AFTER`` seconds after that is killed, and only a lost process costs
        state. A failed or interrupted cell then settles the process group (``settle``).

        ``tick()`` is called in this thread every 0.1 s while the cell runs (it may print into
        the cell's output); a KeyboardInterrupt it raises interrupts the cell as the stop
        button does (every rank keeps its state)."""
        targets = ranks if ranks is not None else list(range(self.size))
        gone = self._gone(targets)
        if gone:  # killed between cells: the cell cannot run, the pool cannot go on
            self.broken = True
            return CellOutcome([RankOutcome(r, "gone", "EngineError", "gone") for r in gone], broken=True)
        every = ranks is None and self.view is not None
        view = self.view if every else self.client[[self.engine_ids[r] for r in targets]]
        ar = view.execute(code, silent=False, block=False)
        metadata = replies(ar)  # each rank's, filled in as its messages arrive
        stream = _Streamer(targets, show=lambda rank, name: output == "all" or rank == 0 or name == "stderr")
        stop = _Escalation()
        interrupted = False
        try:
            while True:
                ar.wait_for_output(0.1)  # every reply and every rank's last output: one wake-up
                stream.feed(metadata)
                if tick is not None:
                    tick()
                done = [md["status"] is not None for md in metadata]
                if all(done):
                    break
                if not alive(self.controller_pid):
                    self.kill(targets)  # no controller, no replies: nothing left to wait for
                    stop.killed = True
                    break
                if stop.started is None and any(
                    d and md["status"] != "ok" for d, md in zip(done, metadata, strict=True)
                ):
                    stop.start(time.monotonic() + grace)  # the others get the grace period
                running = [targets[i] for i, d in enumerate(done) if not d]
                if stop.step(time.monotonic(), running, self) == "give up":
                    break  # the controller will notice the dead engines; do not wait for it
        except KeyboardInterrupt:
            interrupted = True
            try:
                stop.start(time.monotonic())
                while not ar.ready():
                    ar.wait(0.1)
                    running = [targets[i] for i, md in enumerate(metadata) if md["status"] is None]
                    if stop.step(time.monotonic(), running, self) == "give up":
                        break
            finally:  # a second Ctrl-C lands here too: never leave ranks running unmarked
                if not ar.ready():
                    self.kill(targets)
                    stop.killed = True
        ar.wait(1)  # let the last replies of ranks that did finish arrive
        if ar.ready():
            # a reply can overtake the output printed just before it: wait for the output too
            ar.wait_for_output(timeout=5)
        stream.feed(metadata)
        stream.close()
        outcome = self._outcome(targets, metadata, stop.killed)
        outcome.interrupted = interrupted
        outcome.freed = sorted(stop.freed)
        # only a lost process (killed, died) costs the pool; anything else keeps every rank
        self.broken = stop.killed or any(r.status in ("died", "killed") for r in outcome.ranks)
        if not self.broken and (interrupted or outcome.failed or stop.freed):
            outcome.notes += self.settle()
        outcome.broken = self.broken
        return outcome

    def _ask_engines_to_shut_down(self, engines: list[int] | None = None) -> None:
        """A shutdown request to every engine (or those of ``engines``), waiting up to
        ``SHUTDOWN_WAIT`` s for the replies; one that does not answer is ended by the
        launcher's signals as before. Never raises: the stop goes on whatever the engines do."""
        registered = set(self.client.ids)
        ids = [i for i in (self.engine_ids if engines is None else engines) if i in registered]
        if not ids:
            return
        try:
            futures = [
                self.client._send(
                    self.client._control_stream, "shutdown_request", content={"restart": False}, ident=t
                )
                for t in self.client._build_targets(ids)[0]
            ]  # ipyparallel's Client.shutdown, less its wait without a timeout
        except Exception:  # the controller or an engine already gone
            return
        deadline = time.monotonic() + SHUTDOWN_WAIT
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # no reply in time, or the engine is already gone
                break

    def _gone(self, ranks: list[int]) -> list[int]:
        """Ranks whose engine the controller dropped, or whose process here has ended (checked
        before every cell: one ``poll`` of the engines' pidfds, ``ExitWatch``)."""
        known = set(self.client.ids)
        ended = self._ended()
        return [r for r in ranks if self.engine_ids[r] not in known or r in ended]

    def _ended_here(self, rank: int) -> bool:
        """The rank's engine runs on this machine and its process has ended (a pid of another
        host means nothing here: there the controller's heartbeat tells)."""
        return rank < len(self.infos) and rank in self._ended()

    def ended_for_sure(self) -> set[int]:
        """The ranks here whose engine has ended, by its pidfd (:meth:`_ended`) or by the
        process table (no such process, or a zombie): the checks that decide whether anything
        is left to save or keep ask both, so that a pidfd that missed an end never makes them
        wait on a dead engine."""
        if self._remote:
            return self._ended()
        gone = {r for r, info in enumerate(self.infos) if info.get("pid") and not alive(info["pid"])}
        return self._ended() | gone

    def _ended(self) -> set[int]:
        """The ranks whose engine runs on this machine and whose process has ended."""
        host = socket.gethostname() if self._remote else None
        here = tuple(info["pid"] if host is None or info.get("host") == host else 0 for info in self.infos)
        watch = self._exits
        if watch is None or watch.pids != here:  # the pool's engines changed: watch the new ones
            if watch is not None:
                watch.close()
            watch = self._exits = ExitWatch(here)
        ended = watch.ended()
        return {r for r, pid in enumerate(here) if pid and pid in ended}

    def settle(self, timeout: float = 60) -> list[str]:
        """After a failed or interrupted cell: keep the process groups where every member of
        each has run the same collectives on it and none was freed, else reconnect them in
        place on a fresh rendezvous (``engine.recovery.recover``, decided by ``regroup``), and
        check each with a collective. Notes for the cell."""
        from gpu_magics.engine.recovery import (
            ddp_digests,
            ddp_names,
            group_state,
            holders,
            recover,
            reset_holders,
            sync_ddp,
        )

        try:
            states = [self.client[eid].apply_async(group_state).get(timeout) for eid in self.engine_ids]
        except Exception as e:  # an engine that cannot answer cannot go on
            self.broken = True
            return [f"The ranks did not answer after the cell ({e}); the next cell starts fresh engines."]
        if regroup.keep_groups(states):
            # the groups go on; what holds them may have stopped mid-step (an interrupt between
            # two collectives): every DDP and FSDP2 model made ready for a new step, locally
            # and DDP replicas that the interrupt left apart (one rank stepped, another not)
            # made equal to rank 0's again
            try:
                resets = [self.client[eid].apply_async(reset_holders).get(timeout) for eid in self.engine_ids]
                apart = regroup.diverged(
                    [self.client[eid].apply_async(ddp_digests).get(timeout) for eid in self.engine_ids]
                )
                synced = None
                if apart:
                    replies = [self.client[eid].apply_async(sync_ddp, apart) for eid in self.engine_ids]
                    self.client.wait(replies, timeout=timeout)
                    synced = replies[0].get(0)
            except Exception as e:
                self.broken = True
                return [f"The ranks did not answer after the cell ({e}); the next cell starts fresh engines."]
            return regroup.reset_notes(resets) + regroup.resync_note(synced)
        order = sorted(range(len(states)), key=lambda i: states[i].get("rank", i))
        engines = [self.engine_ids[i] for i in order]
        states = [states[i] for i in order]
        the_plan = regroup.plan(states)
        if the_plan.broken:
            self.broken = True
            return [
                f"The world group cannot be reconnected ({the_plan.lost[regroup.WORLD]}); "
                "the next cell starts fresh engines."
            ]
        try:
            names = [self.client[eid].apply_async(ddp_names).get(timeout) for eid in engines]
            sync = sorted(set.intersection(*map(set, names)))
            found = self.client[engines[0]].apply_async(holders).get(timeout)
            old = self.rendezvous
            _, rendezvous = self._open_rendezvous([spec.env() for spec in self.specs], timeout)
            env = {"MASTER_PORT": str(rendezvous["port"])} if rendezvous["kind"] == "tcp" else {}
            replies = [
                self.client[eid].apply_async(
                    recover, rendezvous, env, self.timeout_s, the_plan.names[i], sync
                )
                for i, eid in enumerate(engines)
            ]
            self.client.wait(replies, timeout=timeout)
            results = [ar.get(0) for ar in replies]
        except Exception as e:
            self.broken = True
            return [
                f"The process groups could not be reconnected ({type(e).__name__}: {e}); "
                "the next cell starts fresh engines."
            ]
        self._remove_rendezvous(old)
        notes, ok = regroup.report(the_plan, results, found)
        if not ok:
            self.broken = True
        return notes

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
            if res is None or ename == "EngineError" or self._ended_here(rank):
                status = "killed" if killed else "died"
            elif ename == "KeyboardInterrupt":
                status = "interrupted"
            else:
                status = "error"
            ranks.append(RankOutcome(rank, status, ename, evalue, tb))
        return CellOutcome(ranks, result)

    # signals and shutdown ----------------------------------------------------------------

    def signal(self, sig: int, ranks: list[int] | None = None) -> None:
        self.launcher.signal(self, sig, ranks)

    def can_free(self, rank: int) -> bool:
        """Whether SIGUSR1 frees this rank from a stuck collective (``recovery.start_freer``)."""
        return rank < len(self.infos) and bool(self.infos[rank].get("freer"))

    def _remove_rendezvous(self, rendezvous: dict) -> None:
        if rendezvous.get("kind") == "file" and not self._remote:
            shutil.rmtree(os.path.dirname(rendezvous["path"]), ignore_errors=True)

    def kill(self, ranks: list[int] | None = None) -> None:
        self.signal(signal.SIGKILL, ranks)

    def stop(self, graceful: bool = True) -> None:
        """Stop engines and controller. A broken pool's engines are killed outright (a rank
        stuck in a collective ignores polite requests); ipyparallel's own chatter about
        engines it did not stop itself is kept out of the notebook. ``graceful=False`` (the
        kernel is exiting): no ipyparallel shutdown round (about 2 s), the processes are
        ended at once below (SIGTERM, SIGKILL 0.3 s later: the controller and engines ignore
        SIGTERM for the 3 s of a graceful stop, and nothing of theirs is kept at exit).

        A graceful stop of a sound pool first asks each engine to shut down, as Jupyter asks a
        kernel (a shutdown request on its control channel): each ends its own way, at once,
        and the launcher's SIGTERM and wait below find them gone (about 3 s before)."""
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                if self.broken:
                    self.kill()
                elif graceful and self.client is not None and self.ask_engines_first:
                    self._ask_engines_to_shut_down()
                if self.client is not None:
                    self.client.close()
                if self.cluster is not None and graceful:
                    self.cluster.stop_cluster_sync()
                self.launcher.stop()
        except Exception as e:  # stopping must not fail the caller; the processes are ended below
            print(f"gpuhub: while stopping the engines: {e}", file=sys.stderr)
        finally:
            # whatever ipyparallel managed (at interpreter exit it often cannot), end them all
            local = [*([] if self._remote else self.pids), *self.launcher.local_pids]
            kill_trees([pid for pid in (self.controller_pid, *local) if pid], grace=3.0 if graceful else 0.3)
            self._remove_rendezvous(self.rendezvous)
            if self.reaper is not None:
                self.reaper.kill()
                self.reaper.wait()
            self.cluster = self.client = self.view = self.reaper = None
            self.infos = []  # these pids are not ours any more: never signal them again
            if self._exits is not None:
                self._exits.close()
                self._exits = None


def replies(ar) -> list[dict]:
    """Each target's reply metadata (status, stdout, stderr, error, execute_result), the dicts
    ipyparallel fills in as messages arrive. ``AsyncResult.metadata`` is the same list, but
    parses its timestamps with dateutil on every access (about 1 ms a cell on 4 ranks,
    measured); nothing here reads them."""
    raw = getattr(ar, "_metadata", None)
    return raw if isinstance(raw, list) else ar.metadata


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
