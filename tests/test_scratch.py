"""Private temporary places (gpu_magics.common.scratch): what counts as private, and the TMPDIR a
server, kernel or engine ends up with."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from gpu_magics.common import scratch

ME = 1000
DIR = stat.S_IFDIR


@pytest.mark.parametrize(
    "mode, uid, why",
    [
        (DIR | 0o700, ME, None),
        (DIR | 0o500, ME, None),
        (DIR | 0o750, ME, "has mode 0750: others may open it (it must be 0700)"),
        (DIR | 0o777, ME, "has mode 0777: others may open it (it must be 0700)"),
        (DIR | 0o1777, ME, "has mode 1777: others may open it (it must be 0700)"),
        (DIR | 0o700, 1001, "belongs to uid 1001, not to this user (uid 1000)"),
        (DIR | 0o700, 0, "belongs to uid 0, not to this user (uid 1000)"),
        (stat.S_IFLNK | 0o777, ME, "is a symbolic link"),
        (stat.S_IFREG | 0o600, ME, "is not a directory"),
    ],
)
def test_what_is_private(mode, uid, why):
    assert scratch.why_not_private(SimpleNamespace(st_mode=mode, st_uid=uid), ME) == why


def test_a_private_tmpdir_is_inherited_as_it_is(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    env = {"TMPDIR": str(mine)}
    assert scratch.private_tmpdir(env, remove_at_exit=False) == mine
    assert env == {"TMPDIR": str(mine)}


@pytest.mark.parametrize("case", ["missing", "unset", "open to all", "a link to mine", "shared sticky"])
def test_anything_else_gets_a_new_private_one_with_a_random_name(tmp_path, case):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    given = {
        "missing": tmp_path / "gone",
        "unset": None,
        "open to all": tmp_path / "open",
        "a link to mine": tmp_path / "link",
        "shared sticky": tmp_path / "scratch",
    }[case]
    if case == "open to all":
        given.mkdir()
        given.chmod(0o777)
    elif case == "a link to mine":
        given.symlink_to(mine)
    elif case == "shared sticky":
        given.mkdir()
        given.chmod(0o1777)
    env = {} if given is None else {"TMPDIR": str(given)}
    made = scratch.private_tmpdir(env, remove_at_exit=False)
    try:
        assert env["TMPDIR"] == str(made) and made.name.startswith("gpuhub-")
        assert scratch.why_not_private(os.lstat(made), os.geteuid()) is None
        # beside nothing guessable: under the shared sticky place itself, else under /tmp
        assert made.parent == (given if case == "shared sticky" else type(made)("/tmp"))
        again = scratch.private_tmpdir(dict(env), remove_at_exit=False)
        assert again == made  # the processes it starts keep it
    finally:
        made.rmdir()


@pytest.mark.skipif(os.geteuid() != 0, reason="another account's directory needs root to make")
def test_another_accounts_directory_is_refused_and_never_changed(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(scratch.NotPrivate, match=r"belongs to uid 4242.*Remove it"):
        scratch.check_private(theirs)
    env = {"TMPDIR": str(theirs)}
    made = scratch.private_tmpdir(env, remove_at_exit=False)
    try:
        assert made.parent != theirs and env["TMPDIR"] == str(made)
        st = os.lstat(theirs)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (4242, 0o700)  # left as it was
    finally:
        made.rmdir()
