"""Whether a process runs: the one check every watcher here needs (stdlib only)."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie does not: a killed kernel or server whose parent has
    not reaped it yet is gone all the same (containers whose init never reaps keep them)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no procfs: trust kill()


class ExitWatch:
    """Processes watched for their end, all told apart in one ``poll`` call: where Linux gives
    pidfds (5.3 and later) each process's pidfd is readable once it has ended and refers to
    that process only, never to a later one with the same pid. "Ended" is the last thread's
    end: a process whose main thread is already a zombie while others still tear down (a
    killed torch engine, under load) is not yet readable, where :func:`alive` already says
    gone (``EnginePool.ended_for_sure`` asks both). Where a pidfd cannot be had, :func:`alive`
    answers for that pid."""

    def __init__(self, pids) -> None:
        import select

        self.pids = tuple(pids)
        self._fds: dict[int, int] = {}  # fd -> pid
        self._gone: set[int] = set()  # ended before they could be watched
        self._unwatched: list[int] = []  # no pidfd: asked with alive() each time
        self._poll = select.poll()
        for pid in dict.fromkeys(p for p in self.pids if p):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._gone.add(pid)
                continue
            except (AttributeError, OSError):  # no pidfd_open here
                self._unwatched.append(pid)
                continue
            self._fds[fd] = pid
            self._poll.register(fd, select.POLLIN)

    def ended(self) -> set[int]:
        """The watched pids whose process has ended."""
        out = set(self._gone)
        if self._fds:
            out.update(self._fds[fd] for fd, _ in self._poll.poll(0))
        out.update(pid for pid in self._unwatched if not alive(pid))
        return out

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()
