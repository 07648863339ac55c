"""Private temporary places for a user's processes (standard library only: the server's
launcher, the kernel and every engine import it).

A place another account could have made first is never used: a shared ``/tmp`` name that can
be guessed (``/tmp/dask-scratch-space-<uid>``, say) may already be a directory of someone else's,
or one of the user's own that others can write to, with a module planted in it. So:

- :func:`check_private` accepts a directory only if it is a real directory (not a link), owned
  by this process's user, and closed to everyone else (no group or other permission bits); it
  never widens or narrows what it finds, it refuses it and says what to do.
- :func:`private_tmpdir` gives the process a ``TMPDIR`` that passes that check: the inherited
  one if it does, else a new directory with a random name (``tempfile.mkdtemp``, mode 0700)
  under the inherited one's parent place or ``/tmp``. Everything started from the process
  (kernels, engines, Dask, ``tempfile``) inherits it.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
from pathlib import Path

ENV = "TMPDIR"
PREFIX = "gpuhub-"


class NotPrivate(PermissionError):
    """A temporary place that others own, or can open."""


def why_not_private(st: os.stat_result, uid: int) -> str | None:
    """Why a directory with this ``lstat`` is not private to ``uid``; None if it is (pure)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != uid:
        return f"belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & 0o077:
        return f"has mode {stat.S_IMODE(st.st_mode):04o}: others may open it (it must be 0700)"
    return None


def check_private(path: str | os.PathLike, uid: int | None = None) -> Path:
    """``path`` if it is a directory of this user closed to everyone else; else :class:`NotPrivate`,
    saying what to do. Nothing is changed."""
    path = Path(path)
    why = why_not_private(os.lstat(path), os.geteuid() if uid is None else uid)
    if why is not None:
        raise NotPrivate(
            f"{path} {why}; gpuhub keeps temporary files only in a directory of your own that no one "
            "else can open. Remove it (or point TMPDIR elsewhere) and try again."
        )
    return path


def make_private(parent: str | os.PathLike | None = None, prefix: str = PREFIX) -> Path:
    """A new directory with a random name (mode 0700) under ``parent`` (default: the temporary
    place), checked before it is returned."""
    return check_private(tempfile.mkdtemp(prefix=prefix, dir=parent))


def private_tmpdir(environ=os.environ, remove_at_exit: bool = True) -> Path:
    """Make ``environ["TMPDIR"]`` private to this user (see the module's docstring) and return it.

    An inherited ``TMPDIR`` that is private already is kept (a kernel under a server, an
    engine under its kernel); one that is missing, shared or someone else's is replaced by a
    new one beside it (under it where it is the shared place itself, e.g. a 1777 ``/scratch``),
    else under ``/tmp``. A directory made here is removed when the process ends."""
    inherited = environ.get(ENV) or ""
    if inherited:
        try:
            path = check_private(inherited)
        except (NotPrivate, OSError):
            pass
        else:
            tempfile.tempdir = None
            return path
    parent = "/tmp"
    if inherited and os.path.isdir(inherited) and _is_shared_sticky(inherited):
        parent = inherited
    path = make_private(parent)
    environ[ENV] = str(path)
    tempfile.tempdir = None  # tempfile asks again: the new TMPDIR
    if remove_at_exit:
        atexit.register(shutil.rmtree, path, True)
    return path


def _is_shared_sticky(path: str) -> bool:
    """A world-writable directory with the sticky bit (like /tmp): others cannot replace what we
    make in it."""
    st = os.stat(path)
    return bool(st.st_mode & stat.S_ISVTX) and bool(st.st_mode & stat.S_IWOTH)
