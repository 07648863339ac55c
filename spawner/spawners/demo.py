"""The demo hub's code (``hub_config/demo.py`` holds only its configuration, and says what the
demo does): its users, the passwords kept in its state directory (``demo_passwords``), the
checks on that directory and on its Unix accounts, and, started as root, the spawner that runs
each user's server as an account of its own (:class:`DemoUnixSpawner`, made by
``DemoSite.ensure_unix_account`` on the first start).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import stat
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from traitlets import Unicode

from gpu_magics.common import words
from spawner.spawners.local import GpuLocalProcessSpawner

DEMO_USERS = ("alice", "bob", "carol", "dave")
DEMO_ADMIN = "admin"
# hub user alice runs as Unix account gpuhub-demo-alice (as root); $GPUHUB_DEMO_ACCOUNT_PREFIX
# gives a second demo on the machine accounts of its own
DEFAULT_PREFIX = "gpuhub-demo-"
UNIX_MARK = "gpuhub demo user"  # the accounts' GECOS field: made by the demo


class DemoError(RuntimeError):
    """What is wrong with the demo's state directory or accounts (the hub stops, or the spawn fails)."""


def _fail(message: str):
    raise DemoError(f"gpuhub demo: {message}")


def hub_account() -> str:
    """The Unix account running the hub."""
    return pwd.getpwuid(os.geteuid()).pw_name


def loaded_by_the_hub() -> bool:
    """Whether JupyterHub itself loads the configuration (not, say, the gpuhub CLI reading
    c.GpuHub through a config that includes it, in any directory): only then the state
    directory is touched."""
    app = sys.modules.get("jupyterhub.app")
    return app is not None and app.JupyterHub.initialized()


def demo_passwords(path: Path) -> dict[str, str]:
    """This state directory's passwords: made once (mode 0600), then read back on restarts."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        pass
    else:
        made = {"user_password": secrets.token_urlsafe(12), "admin_password": secrets.token_urlsafe(30)}
        with os.fdopen(fd, "w") as f:
            json.dump(made, f, indent=1)
            f.write("\n")
        return made
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        _fail(f"cannot read {path} ({e}); delete it for new passwords")
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            _fail(f"{path} must be a file of {hub_account()} that only it can read (chmod 600 {path})")
        try:
            stored = json.load(f)
            user, admin = stored["user_password"], stored["admin_password"]
            if not (isinstance(user, str) and isinstance(admin, str) and len(user) >= 8 and len(admin) >= 32):
                raise ValueError("too short")
        except (ValueError, KeyError, TypeError) as e:
            _fail(f"{path} is not the demo's passwords ({e}); delete it for new passwords")
    return {"user_password": user, "admin_password": admin}


def check_root_state(state: Path, reachable: bool = False) -> None:
    """As root: the state directory, and every directory above it, is root's and writable by no
    one else (a sticky directory such as /tmp above it is fine): otherwise another account could
    swap a home or plant files in it. ``reachable``: and others can pass through to their homes."""
    for d in (state, *state.parents):
        st = os.lstat(d)
        if st.st_uid != 0:
            _fail(
                f"started as root, the state directory {state} must be root's all the way up, but {d} "
                f"belongs to uid {st.st_uid}: set GPUHUB_DEMO_STATE to a new directory such as "
                "/var/lib/gpuhub-demo"
            )
        if st.st_mode & 0o022 and (d == state or not st.st_mode & stat.S_ISVTX):
            _fail(f"started as root, {d} must be writable by root only (chmod go-w {d})")
        if reachable and not st.st_mode & 0o001:
            _fail(f"the demo's users cannot reach their homes in {state}: {d} is closed (chmod o+x {d})")


def private_dir(path: Path, uid: int, gid: int, mode: int) -> None:
    """``path`` is a real directory (no link) of ``uid``, with ``mode``."""
    try:
        path.mkdir(mode=mode)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        _fail(f"{path} must be a directory")
    if st.st_uid not in (0, uid):  # only root (who made it) or its user may have made it
        _fail(f"{path} belongs to uid {st.st_uid}, not {uid}: remove it")
    os.chown(path, uid, gid, follow_symlinks=False)
    os.chmod(path, mode, follow_symlinks=False)


def check_prefix(prefix: str) -> None:
    """A prefix that makes valid Unix names for every demo user (at most 32 characters)."""
    longest = max(len(u) for u in (*DEMO_USERS, DEMO_ADMIN))
    if not re.fullmatch(r"[a-z_][a-z0-9_-]*-", prefix) or len(prefix) + longest > 32:
        _fail(
            f"GPUHUB_DEMO_ACCOUNT_PREFIX={prefix!r} makes no Unix account names: use lowercase letters,"
            f" digits, '_' and '-', ending in '-', at most {32 - longest} characters (such as gpuhub-demo2-)"
        )


def account_conflict(name: str, account: pwd.struct_passwd, home: Path, home_exists: bool) -> str | None:
    """Why the demo whose home for this user is ``home`` cannot use the existing Unix account
    ``name`` (None: it can). ``home_exists``: the account's current home is still there."""
    own = "give this demo accounts of its own (GPUHUB_DEMO_ACCOUNT_PREFIX=gpuhub-demo2- scripts/demo)"
    if not account.pw_gecos.startswith(UNIX_MARK) or account.pw_uid == 0:
        return f"the Unix account {name} exists and is not the demo's: not using it; {own}"
    if account.pw_dir != str(home) and home_exists:  # another state directory, still there, uses it
        return (
            f"the Unix account {name} belongs to the demo in {Path(account.pw_dir).parent.parent}: "
            f"start that one, remove the account (userdel {name}), or {own}"
        )
    return None


@dataclass(frozen=True)
class DemoSite:
    """One demo: its state directory (every SQLite file, the passwords and the users' homes),
    the prefix of its Unix accounts, and whether the hub runs as root (then servers run as
    those accounts)."""

    state: Path
    prefix: str = DEFAULT_PREFIX
    as_root: bool = False

    @classmethod
    def here(cls, environ: Mapping[str, str] | None = None) -> DemoSite:
        """The demo ``scripts/demo`` starts: in the working directory (its state directory)."""
        env = os.environ if environ is None else environ
        return cls(Path.cwd(), env.get("GPUHUB_DEMO_ACCOUNT_PREFIX", DEFAULT_PREFIX), os.geteuid() == 0)

    @property
    def homes(self) -> Path:
        return self.state / "homes"

    @property
    def passwords_file(self) -> Path:
        return self.state / "demo-passwords.json"

    @property
    def servers_as(self) -> str:
        if self.as_root:
            return f"Unix accounts {self.prefix}<user> (homes in {self.homes})"
        return f"{hub_account()}, the hub's own account (homes in {self.homes})"

    def unix_account(self, hub_name: str) -> str:
        if hub_name not in (*DEMO_USERS, DEMO_ADMIN):
            _fail(f"{hub_name!r} is not a demo user: the demo has Unix accounts only for its own")
        return self.prefix + hub_name

    def existing_account(self, hub_name: str) -> tuple[pwd.struct_passwd | None, str | None]:
        """``hub_name``'s Unix account as it is now (None: not made yet), and why this demo cannot use it."""
        name = self.unix_account(hub_name)
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            return None, None
        home_exists = os.path.lexists(account.pw_dir)
        return account, account_conflict(name, account, self.homes / hub_name, home_exists)

    def check_unix_accounts(self) -> None:
        """At the start, as root: every demo user's account is this state directory's or can be made."""
        check_prefix(self.prefix)
        problems = [why for user in (*DEMO_USERS, DEMO_ADMIN) if (why := self.existing_account(user)[1])]
        if problems:
            _fail("; ".join(problems))

    def ensure_unix_account(self, hub_name: str) -> pwd.struct_passwd:
        """The demo's Unix account for ``hub_name``, made if missing, with its private home."""
        name = self.unix_account(hub_name)
        home = self.homes / hub_name
        check_root_state(self.state, reachable=True)
        private_dir(self.homes, 0, 0, 0o755)
        account, why = self.existing_account(hub_name)
        if why:
            _fail(why)
        if account is None:
            subprocess.run(
                ["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", str(home),
                 "--shell", "/bin/bash", "--comment", f"{UNIX_MARK} {hub_name}", name],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            account = pwd.getpwnam(name)
        if account.pw_dir != str(home):  # its old state directory is gone: this one takes it
            subprocess.run(["usermod", "--home", str(home), name], check=True, capture_output=True, text=True)
            account = pwd.getpwnam(name)
        private_dir(home, account.pw_uid, account.pw_gid, 0o700)
        return account

    def prepare_root_state(self) -> None:
        check_root_state(self.state)
        self.check_unix_accounts()
        private_dir(self.homes, 0, 0, 0o755)
        # the state directory is open to the demo's users (their homes are in it): the hub's own
        # database is not (the ledger and the cookie secret are made 0600 by gpuhub and JupyterHub)
        fd = os.open(self.state / "jupyterhub.sqlite", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        os.fchmod(fd, 0o600)
        os.close(fd)

    def prepare(self) -> dict[str, str]:
        """The passwords, with the state directory made ready, when JupyterHub loads the
        configuration; none otherwise (no one logs in). A state directory or accounts the demo
        cannot use stop the hub, with why."""
        if not loaded_by_the_hub():
            return {"user_password": "", "admin_password": ""}
        try:
            passwords = demo_passwords(self.passwords_file)
            if self.as_root:
                self.prepare_root_state()
            else:
                self.homes.mkdir(mode=0o700, exist_ok=True)
        except DemoError as e:
            raise SystemExit(str(e)) from None
        return passwords

    def login_announcement(self) -> str:
        return (
            "gpuhub demo: log in as alice, bob, carol or dave with the users' password, or as admin with"
            " the admin password. Both were printed where the demo was started, and are kept in"
            f" {self.passwords_file} (readable by {hub_account()} only)."
        )

    def welcome(self, passwords: Mapping[str, str], c=None) -> None:
        """Where to log in and with which passwords, on the hub's stderr (only when JupyterHub
        loads the configuration). ``c``: the demo's config, for the borrowing and reclaim times."""
        if not loaded_by_the_hub():
            return
        print(welcome_text(self, passwords, gpuhub_command(), c), file=sys.stderr, flush=True)


def gpuhub_command() -> str:
    """The ``gpuhub`` command beside the hub's Python (the checkout's ``.venv/bin/gpuhub``),
    which need not be on anyone's PATH."""
    beside = Path(sys.executable).with_name("gpuhub")
    return str(beside) if beside.exists() else "gpuhub"


def _minutes(seconds: float) -> str:
    return (
        words.count(round(seconds / 60), "minute") if seconds >= 60 else words.count(round(seconds), "second")
    )


def showcase_text(c) -> str:
    """What the demo's config lends and takes back, in a line (nothing when it says nothing)."""
    if c is None:
        return ""
    hub, reclaim = c.GpuHub, c.GpuReclaim
    borrow = hub.get("default_borrow", 0)
    parts = []
    if borrow:
        grace = _minutes(hub.get("preempt_grace_seconds", 300.0))
        parts.append(
            f"each user may borrow {words.count(borrow, 'idle GPU')} beyond their limit"
            f" ({grace} of notice before they are taken back for someone who waits)"
        )
    if "warn_after_seconds" in reclaim or "reclaim_after_seconds" in reclaim:
        warn = _minutes(reclaim.get("warn_after_seconds", 900.0))
        take = _minutes(reclaim.get("reclaim_after_seconds", 3600.0))
        parts.append(f"idle GPUs are warned about after {warn} and taken back after {take}")
    return f"  The demo's config: {'; '.join(parts)}.\n" if parts else ""


def welcome_text(site: DemoSite, passwords: Mapping[str, str], gpuhub: str, c=None) -> str:
    """The demo's banner: the passwords bare, each on a line of its own (nothing around them is
    part of them), the CLI's exact path, and how to remove what the demo leaves behind."""
    if site.as_root:
        leftovers = (
            f"  Stopped, it leaves the Unix accounts {site.prefix}<user> (made as their servers"
            " first start):\n"
            "    scripts/demo --remove-accounts   removes them (the same GPUHUB_DEMO_STATE and prefix)\n"
        )
    else:
        leftovers = "  Stopped, it leaves only its state directory: delete it for a fresh demo.\n"
    return (
        "gpuhub demo: open http://127.0.0.1:8000 and log in as\n"
        "  alice (up to 3 GPUs), bob or carol (group students, 2), dave (default, 1)"
        " with the users' password, or as admin with the admin password:\n"
        f"    users' password: {passwords['user_password']}\n"
        f"    admin password:  {passwords['admin_password']}\n"
        f"  The passwords are this state directory's, in {site.passwords_file} (readable by"
        f" {hub_account()} only).\n"
        f"  Servers run as {site.servers_as}.\n"
        + showcase_text(c)
        + f"  The admin's command line reads the demo's config in {site.state}:\n"
        f"    cd {site.state} && {gpuhub} limits show   (also gpus, queue show, usage)\n"
        "  My GPUs: http://127.0.0.1:8000/services/gpuhub/ (GPU admin, for admin: /services/gpuhub/admin).\n"
        + leftovers
    )


class DemoUnixSpawner(GpuLocalProcessSpawner):
    """``gpu-local`` (JupyterHub's LocalProcessSpawner setuid) where hub user ``alice`` runs as
    Unix account ``gpuhub-demo-alice``, made on the first start."""

    state_dir = Unicode("", config=True, help="The demo's state directory (its users' homes are in it).")
    account_prefix = Unicode(DEFAULT_PREFIX, config=True, help="The prefix of the demo's Unix accounts.")

    @property
    def site(self) -> DemoSite:
        return DemoSite(Path(self.state_dir), self.account_prefix, as_root=True)

    async def start(self):
        self.site.ensure_unix_account(self.user.name)
        return await super().start()

    def make_preexec_fn(self, name):
        return super().make_preexec_fn(self.site.unix_account(name))

    def user_env(self, env):
        account = pwd.getpwnam(self.site.unix_account(self.user.name))
        env.update(USER=account.pw_name, HOME=account.pw_dir, SHELL=account.pw_shell)
        return env


# the state directory's own jupyterhub_config.py -------------------------------------------

STATE_CONFIG = "jupyterhub_config.py"


def state_config_text(state: Path, demo_config: Path, extras: list[Path]) -> str:
    """What ``scripts/demo`` writes as ``jupyterhub_config.py`` in the state directory: the hub
    reads it, and so does ``gpuhub`` run there, so both see the same settings."""
    files = [str(demo_config), *(str(e) for e in extras)]
    return (
        '"""Written by scripts/demo at each start; edits here are lost. The demo hub reads it, and so\n'
        "does `gpuhub` run in this directory: the demo's own config, then the files given to\n"
        'scripts/demo with -f/--config, in order (a setting in a later file replaces an earlier one)."""\n\n'
        "from spawner.spawners.demo import load_demo_configs\n\n"
        "c = get_config()  # noqa: F821 - provided by JupyterHub (and gpuhub) when they load this file\n"
        f"load_demo_configs(c, load_subconfig, {str(state)!r}, {files!r})  # noqa: F821\n"
    )


def load_demo_configs(c, load_subconfig, state: str, files: list[str]) -> None:
    """Load the demo's config and then each extra file into ``c``, then pass the result to
    the broker once more (what an extra file sets reaches it too). The demo's ledger is named
    by its full path (``gpuhub --config`` from anywhere reads the same one)."""
    from spawner.broker import enable_broker
    from spawner.spawners.notices import ReclaimNotice

    for i, path in enumerate(files):
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"gpuhub demo: no config file at {path}: give scripts/demo a file that exists"
            )
        load_subconfig(path)
        if i == 0:
            c.GpuHub.db_url = f"sqlite:///{Path(state) / 'gpuhub.sqlite'}"
        elif loaded_by_the_hub():
            print(f"gpuhub demo: also read {path} (its settings replace the demo's)", file=sys.stderr)
    notice = dict(c.JupyterHub.get("template_vars", {})).get("announcement_home")
    if isinstance(notice, ReclaimNotice):
        notice.config = c  # the home page's notices read the ledger the settings name now
    enable_broker(c)


def write_state_config(state: Path, demo_config: Path, extras: list[Path]) -> Path:
    """Write the state directory's ``jupyterhub_config.py`` (mode 0644, replacing any link
    or file there, never following one)."""
    for e in extras:
        if not e.is_file():
            _fail(
                f"no config file at {e}: scripts/demo -f takes a jupyterhub_config.py to load"
                " after the demo's"
            )
    target = state / STATE_CONFIG
    tmp = state / f".{STATE_CONFIG}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(state_config_text(state, demo_config, extras))
    os.replace(tmp, target)
    return target


def remove_unix_accounts(site: DemoSite) -> list[str]:
    """``userdel`` every Unix account of this demo (its prefix, made by the demo, its home in
    this state directory or gone), and say what was done with each; run as root, the demo stopped."""
    lines = []
    for user in (*DEMO_USERS, DEMO_ADMIN):
        name = site.unix_account(user)
        try:
            account = pwd.getpwnam(name)
        except KeyError:
            continue
        home = Path(account.pw_dir)
        if not account.pw_gecos.startswith(UNIX_MARK) or account.pw_uid == 0:
            lines.append(f"kept {name}: not made by the demo")
            continue
        if home != site.homes / user and os.path.lexists(home):
            lines.append(f"kept {name}: it belongs to the demo in {home.parent.parent}")
            continue
        r = subprocess.run(["userdel", name], capture_output=True, text=True)
        if r.returncode:
            why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
            lines.append(f"could not remove {name} ({why}): stop the demo first, then run this again")
        else:
            lines.append(f"removed {name}")
    if not lines:
        lines.append(f"no Unix accounts {site.prefix}<user> to remove")
    return lines


def main(argv: list[str]) -> int:
    """``scripts/demo``'s helpers, run in the state directory: ``config DEMO [EXTRA...]``
    writes its ``jupyterhub_config.py``; ``remove-accounts`` removes the demo's Unix accounts."""
    site = DemoSite.here()
    try:
        if argv[:1] == ["config"] and len(argv) >= 2:
            write_state_config(site.state, Path(argv[1]).resolve(), [Path(a).resolve() for a in argv[2:]])
            return 0
        if argv == ["remove-accounts"]:
            if not site.as_root:
                print("gpuhub demo: not started as root, the demo makes no Unix accounts: nothing to remove")
                return 0
            check_prefix(site.prefix)
            lines = remove_unix_accounts(site)
            print("\n".join(f"gpuhub demo: {line}" for line in lines))
            print(f"gpuhub demo: their homes stay in {site.homes}: delete {site.state} for a fresh demo")
            return 1 if any(line.startswith("could not") for line in lines) else 0
    except DemoError as e:
        print(e, file=sys.stderr)
        return 2
    print(
        "usage: python -m spawner.spawners.demo config DEMO_CONFIG [EXTRA...] | remove-accounts",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
