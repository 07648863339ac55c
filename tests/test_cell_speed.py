"""What a warm ``%%distributed`` cell does once instead of every time, and what it still checks
every time: a rank's process that ended between cells is found by one ``poll`` of the engines'
pidfds (``procs.ExitWatch``), a line's arguments are parsed once and every cell gets its own
copy, and the engines and controller build no log record nobody writes. Speed itself is
measured in ``benchmarks/distributed.py``, against raw ipyparallel on the same engines."""

import logging
import os
import select
import signal
import subprocess
import sys

import pytest
from IPython.core.error import UsageError

from gpu_magics.common import procs
from gpu_magics.engine.main import with_log_level
from gpu_magics.engine.rank import lift_log_levels
from gpu_magics.kernel.pool import EnginePool

from .kerneltools import own_gpus_env, run_notebook


@pytest.fixture
def child():
    procs_ = []

    def start():
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        procs_.append(p)
        return p

    yield start
    for p in procs_:
        p.kill()
        p.wait()


def test_the_watch_tells_a_running_a_killed_unreaped_and_a_reaped_process_apart(child):
    running, zombie, reaped = child(), child(), child()
    reaped.kill()
    reaped.wait()
    watch = procs.ExitWatch([running.pid, zombie.pid, reaped.pid])
    try:
        assert watch.ended() == {reaped.pid}
        zombie.kill()
        os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)  # ended, left unreaped
        assert watch.ended() == {reaped.pid, zombie.pid}
        assert not procs.alive(zombie.pid)  # as alive() says
        running.kill()
        running.wait()
        assert watch.ended() == {reaped.pid, zombie.pid, running.pid}
    finally:
        watch.close()


def test_without_pidfds_the_watch_asks_alive_for_each_pid(child, monkeypatch):
    def no_pidfd(pid):
        raise OSError("pidfd_open unavailable")

    monkeypatch.setattr(procs.os, "pidfd_open", no_pidfd)
    running, dead = child(), child()
    dead.kill()
    dead.wait()
    watch = procs.ExitWatch([running.pid, dead.pid])
    assert watch.ended() == {dead.pid}
    running.kill()
    running.wait()
    assert watch.ended() == {dead.pid, running.pid}


class _Client:
    def __init__(self, ids):
        self.ids = ids


def _pool(pids, ids=None) -> EnginePool:
    pool = EnginePool([], None, 10, n=len(pids))
    pool.engine_ids = list(range(10, 10 + len(pids)))
    pool.client = _Client(pool.engine_ids if ids is None else ids)
    pool.infos = [{"pid": pid, "host": "here"} for pid in pids]
    return pool


def test_a_rank_whose_process_ended_or_that_the_controller_dropped_is_gone(child):
    a, b, c = child(), child(), child()
    pool = _pool([a.pid, b.pid, c.pid])
    assert pool._gone([0, 1, 2]) == []
    os.kill(b.pid, signal.SIGKILL)
    os.waitid(os.P_PID, b.pid, os.WEXITED | os.WNOWAIT)
    assert pool._gone([0, 1, 2]) == [1]
    assert pool._gone([0, 2]) == []  # a cell on other ranks only
    pool.client.ids = [10, 11]  # the controller dropped rank 2's engine
    assert pool._gone([0, 1, 2]) == [1, 2]
    assert [pool._ended_here(r) for r in range(4)] == [False, True, False, False]


def test_the_watch_follows_the_pools_engines_and_is_closed_with_the_pool(child):
    a, b = child(), child()
    pool = _pool([a.pid])
    assert pool._gone([0]) == []
    first = pool._exits
    pool.infos = [{"pid": b.pid, "host": "here"}]  # other engines (as a launcher sets them)
    a.kill()
    a.wait()
    assert pool._gone([0]) == []  # b's process, not a's
    assert pool._exits is not first and first._fds == {}
    fds = list(pool._exits._fds)
    pool.stop(graceful=False)
    assert pool._exits is None
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    select.poll()  # (nothing left registered that could fail)


@pytest.fixture
def magics():
    from IPython.core.interactiveshell import InteractiveShell

    from gpu_magics.kernel.distributed import DistributedMagics

    shell = InteractiveShell.instance()
    m = DistributedMagics(shell=shell)
    yield m
    m.shutdown()


def test_a_lines_arguments_are_parsed_once_and_each_cell_gets_its_own(magics, monkeypatch):
    from gpu_magics.kernel import distributed

    calls = []
    real = distributed.parse_line
    monkeypatch.setattr(
        distributed, "parse_line", lambda f, line, usage: calls.append(line) or real(f, line, usage)
    )
    line = "--gpus 2 --timeout 30 --autosave model opt --targets 0"
    first = magics._arguments(line)
    assert (first.gpus, first.timeout, first.autosave, first.targets) == (2, 30.0, ["model", "opt"], "0")
    first.gpus = 7  # the magic fills in what the line left out: never seen by a later cell
    first.autosave.append("x")
    second = magics._arguments(line)
    assert (second.gpus, second.autosave) == (2, ["model", "opt"])
    assert second is not first and calls == [line]
    other = magics._arguments("--gpus 3")
    assert other.gpus == 3 and other.autosave is None and calls == [line, "--gpus 3"]


def test_a_bad_line_is_refused_every_time(magics):
    for _ in range(2):
        with pytest.raises(UsageError, match="usage: %%distributed --gpus N"):
            magics._arguments("--gpus 0")
    with pytest.raises(UsageError):
        magics._arguments("--output everyone")


def test_engines_log_at_warning_unless_told_otherwise():
    assert with_log_level(["ipengine", "--profile-dir=p"]) == [
        "ipengine",
        "--profile-dir=p",
        "--log-level=WARN",
    ]
    for given in ("--log-level=DEBUG", "--log_level=10", "--Application.log_level=10"):
        assert with_log_level(["ipengine", given]) == ["ipengine", given]


def test_a_logger_is_lifted_to_its_handlers_lowest_level():
    log = logging.getLogger("gpuhub-test-lift")
    log.setLevel(logging.DEBUG)
    handlers = [logging.NullHandler(logging.WARNING), logging.NullHandler(logging.ERROR)]
    for h in handlers:
        log.addHandler(h)
    bare = logging.getLogger("gpuhub-test-lift-bare")
    bare.setLevel(logging.DEBUG)
    try:
        lift_log_levels(log, bare, None)
        assert log.level == logging.WARNING  # what a handler writes is still written
        assert bare.level == logging.DEBUG  # no handlers of its own: its records go elsewhere
        handlers[0].setLevel(logging.DEBUG)
        log.setLevel(logging.INFO)
        lift_log_levels(log)
        assert log.level == logging.INFO  # never lowered
    finally:
        for h in handlers:
            log.removeHandler(h)


# the controller's and the engines' log files while the pool runs (ipyparallel removes them
# when it stops): how many there are, and their lines per request
LOG_LINES = """import glob, os
logs = glob.glob(os.path.join(os.environ["IPYTHONDIR"], "profile_default", "log", "ip*.log"))
text = "".join(open(f).read() for f in logs)
(sorted({os.path.basename(f).split("-")[0] for f in logs}), text.count("queue::"),
 text.count("Handling execute_request"))"""


def test_real_engines_build_no_log_record_below_warning(tmp_path):
    head = "%%distributed --gpus 2 --timeout 30\n"
    cells = run_notebook(
        [
            head + "x = rank",
            head + "import logging\n(get_ipython().kernel.log.getEffectiveLevel(), "
            "logging.getLogger('IPEngine').getEffectiveLevel(), x)",
            LOG_LINES,
            "%distributed shutdown",
        ],
        own_gpus_env(tmp_path, "t:0,t:1"),
    )
    for i, c in enumerate(cells):
        assert c.error is None, (i, c)
    assert cells[1].result == (logging.WARNING, logging.WARNING, 0)
    # no line per request: neither the controller's (two per rank and request at INFO) nor an
    # engine's ("Handling execute_request")
    assert cells[2].result == (["ipcontroller", "ipengine"], 0, 0)
