"""An ipyparallel engine whose every thread blocks SIGUSR1 from the start, so that the signal
reaches only ``gpu_magics.engine.recovery``'s waiting thread (which frees a rank stuck in a
collective) and never ends the process. ``python -m gpu_magics.engine.main`` takes
``ipyparallel.engine``'s arguments.

Preemption: Slurm sends a preempted job's tasks SIGCONT and SIGTERM, and SIGKILL once the
borrow QOS's ``GraceTime`` is over. Where the engines' job carries ``GPUHUB_AUTOSAVE_NAMES``
(space-separated names) and ``GPUHUB_AUTOSAVE_DIR`` (set by ``launch.slurm.SlurmLauncher`` from
the pool's ``--autosave``), SIGTERM first saves those names from the engine's namespace
(rank 0 writes, as ``%distributed save`` does; the other ranks write nothing), records what it
saved for the kernel (:func:`gpu_magics.engine.checkpoints.preempt_report_path`), says so on
the job's output, and ends the engine at once.

Logging: the engine logs at WARNING unless its arguments say otherwise (``--log-level``).
ipyparallel's engine logs at DEBUG by default, so every message builds a few log records that
its INFO handler then drops, and writes one line per request ("Handling execute_request") to
its log file: 0.4 to 0.7 ms of a trivial 4-rank cell's 8 to 10 ms on 2 cores (measured, the
level switched in blocks on the same engines)."""

import os
import signal
import sys

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before any thread exists
# and should a thread that predates this take it anyway: ignored, never the default (exit)
signal.signal(signal.SIGUSR1, lambda signum, frame: None)


def autosave_request(environ) -> tuple[list[str], str] | None:
    """(names, directory) the engines save at SIGTERM, or None (pure)."""
    from gpu_magics.engine.checkpoints import AUTOSAVE_DIR, AUTOSAVE_NAMES

    names = [n for n in environ.get(AUTOSAVE_NAMES, "").split() if n.isidentifier()]
    directory = environ.get(AUTOSAVE_DIR, "")
    if not names or not os.path.isabs(directory):
        return None
    return names, directory


def on_sigterm(names: list[str], directory: str, ns_getter, exit=os._exit):
    """The SIGTERM handler: save, report, end (``exit(0)``; the engine must be gone before
    Slurm's SIGKILL, whatever its cell was doing)."""
    done = []

    def handler(signum, frame):
        if done:  # srun forwards the signal too: save once
            return
        done.append(signum)
        from gpu_magics.engine.checkpoints import engine_preempt_save

        try:
            result = engine_preempt_save(names, directory, ns_getter(), os.environ)
            line = result["text"]
        except BaseException as e:  # never keep the engine alive past its grace period
            line = f"gpuhub: engine preempted; autosave failed: {type(e).__name__}: {e}"
        print(line, file=sys.stderr, flush=True)
        exit(0)

    return handler


def _install_preempt_handler() -> None:
    request = autosave_request(os.environ)
    if request is None:
        return

    from ipyparallel.engine.app import IPEngine

    original = IPEngine.init_signal

    def init_signal(self):
        original(self)  # SIGINT ignored as before; SIGTERM: save first

        def namespace():
            from IPython import get_ipython

            shell = get_ipython()
            return shell.user_ns if shell is not None else {}

        signal.signal(signal.SIGTERM, on_sigterm(*request, namespace))

    IPEngine.init_signal = init_signal


def with_log_level(argv: list[str], level: str = "WARN") -> list[str]:
    """``argv`` with ``--log-level=level`` added where it names no log level itself (pure)."""
    if any(a.startswith(("--log-level", "--log_level", "--Application.log_level")) for a in argv):
        return list(argv)
    return [*argv, f"--log-level={level}"]


if __name__ == "__main__":
    from ipyparallel.engine.app import main

    from gpu_magics.common.scratch import private_tmpdir

    # the engine's temporary files: its kernel's private TMPDIR where that is on this node,
    # else one of its own (an engine on another Slurm node)
    private_tmpdir()
    _install_preempt_handler()
    sys.argv = with_log_level(sys.argv)
    main()
