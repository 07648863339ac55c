"""An ipyparallel engine whose every thread blocks SIGUSR1 from the start, so that the signal
reaches only ``gpu_magics.recovery``'s waiting thread (which frees a rank stuck in a
collective) and never ends the process. ``python -m gpu_magics.enginemain`` takes
``ipyparallel.engine``'s arguments."""

import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})  # before any thread exists
# and should a thread that predates this take it anyway: ignored, never the default (exit)
signal.signal(signal.SIGUSR1, lambda signum, frame: None)

if __name__ == "__main__":
    from ipyparallel.engine.app import main

    main()
