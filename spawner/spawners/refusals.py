"""A refused start as JupyterHub shows and logs it.

gpuhub refuses a start (over the limit, malformed options, no such model) with a
``SpawnException`` carrying the policy's message. Two things JupyterHub does with it are not
what a refusal deserves:

- the spawn form shows ``str(exc)``, ``"409 SpawnException(reason=gpuhub_no_capacity): ..."``,
  unless the exception has a ``jupyterhub_message``: :func:`make_refusal` sets it, so the
  user reads the message alone (the reason code stays in the REST body and the log);
- a refused form start is logged as an ERROR with a full traceback that ends in the refusal,
  and twice more as ERROR lines: :class:`RefusalLogFilter` turns each into one WARNING line.
  A start that failed (a 5xx, e.g. a Slurm job that ended) stays an ERROR.
"""

from __future__ import annotations

import logging
import re

from jupyterhub.spawner import SpawnException

PREFIX = "gpuhub_"
_LOGGED = re.compile(rf"\b([1-4][0-9][0-9]) SpawnException\(reason={PREFIX}")


def make_refusal(message: str, reason: str, status_code: int) -> SpawnException:
    exc = SpawnException(message, reason=f"{PREFIX}{reason}", status_code=status_code)
    exc.jupyterhub_message = message
    return exc


def is_refusal(exc: BaseException | None) -> bool:
    """A start gpuhub turned down (4xx); a server that failed (5xx) stays an error."""
    return isinstance(exc, SpawnException) and str(exc.reason).startswith(PREFIX) and exc.status_code < 500


class RefusalLogFilter(logging.Filter):
    """One WARNING line, no traceback, for every record about a gpuhub refusal."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        try:
            exc = record.exc_info[1] if record.exc_info else None
            if is_refusal(exc):
                record.msg, record.args = f"{record.getMessage()}: {exc}", ()
                record.exc_info = record.exc_text = None
            elif exc is not None or not _LOGGED.search(record.getMessage()):
                return True  # another exception's record, or not about a refusal: as it is
        except Exception:  # a record that cannot format: logging reports it, not the caller
            return True
        record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


_FILTER = RefusalLogFilter()


def install_log_filter(*loggers: logging.Logger | logging.LoggerAdapter | None) -> None:
    """Add the filter (once) to JupyterHub's own logger, to each of ``loggers`` and to their
    handlers: the hub configures its logging after it loads its config and may again later,
    so the refusal path calls this too, where the handlers are the ones in use."""
    for log in (logging.getLogger("JupyterHub"), *loggers):
        log = getattr(log, "logger", log)  # a LoggerAdapter's logger
        if not isinstance(log, logging.Logger):
            continue
        for target in (log, *log.handlers):
            if _FILTER not in target.filters:
                target.addFilter(_FILTER)
