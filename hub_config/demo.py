"""The gpuhub demo: a real JupyterHub on simulated GPUs, on any machine.

Started by ``scripts/demo`` in its state directory (``demo-state/`` unless
``$GPUHUB_DEMO_STATE``), where every SQLite file, the passwords and the users' homes live.
Log in at http://127.0.0.1:8000 as one of the users printed below.

- Passwords: made at random for each state directory on its first start, kept in
  ``demo-passwords.json`` there (readable only by the account running the hub), the same
  on every restart; delete that file for new ones. One password for the four users, one for
  admin (JupyterHub's shared-password login): never expose the demo beyond this machine.
- Started as root: each user's server runs as a Unix account of its own, ``gpuhub-demo-alice``
  for alice and so on (prefixed, so that no real ``alice`` on the machine is ever used), made
  by the demo when that user's server first starts, with its home in ``homes/`` of the state
  directory (the state directory and ``homes/`` root:root 0755, each home its user's, 0700).
  The state directory and every directory above it must be root's and writable by no one
  else. The accounts are system accounts with no password (no login but through the hub).
  They belong to one state directory: a demo started in another one, while the first is still
  there, stops at once and names them. ``$GPUHUB_DEMO_ACCOUNT_PREFIX`` (``gpuhub-demo-`` unless
  set) gives a second demo on the machine accounts of its own.
- Started as any other user: every server runs as that user, homes in ``homes/`` too.
"""

import json
import os
import pwd
import re
import secrets
import stat
import subprocess
import sys
from pathlib import Path

from spawner.broker import enable_broker
from spawner.spawners.local import GpuLocalProcessSpawner

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

STATE = Path.cwd()  # scripts/demo starts the hub in its state directory
HOMES = STATE / "homes"
PASSWORDS_FILE = STATE / "demo-passwords.json"
DEMO_USERS = ("alice", "bob", "carol", "dave")
DEMO_ADMIN = "admin"
# hub user alice runs as Unix account gpuhub-demo-alice (as root)
UNIX_PREFIX = os.environ.get("GPUHUB_DEMO_ACCOUNT_PREFIX", "gpuhub-demo-")
UNIX_MARK = "gpuhub demo user"  # the accounts' GECOS field: made by the demo
AS_ROOT = os.geteuid() == 0
# JupyterHub itself loads this file (not, say, the gpuhub CLI reading c.GpuHub through a
# config that includes it, in any directory): only then the state directory is touched
_app = sys.modules.get("jupyterhub.app")
BY_THE_HUB = _app is not None and _app.JupyterHub.initialized()
HUB_ACCOUNT = pwd.getpwuid(os.geteuid()).pw_name


class DemoError(RuntimeError):
    """What is wrong with the demo's state directory or accounts (the hub stops, or the spawn fails)."""


def _fail(message: str):
    raise DemoError(f"gpuhub demo: {message}")


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
            _fail(f"{path} must be a file of {HUB_ACCOUNT} that only it can read (chmod 600 {path})")
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


def existing_account(hub_name: str) -> tuple[pwd.struct_passwd | None, str | None]:
    """``hub_name``'s Unix account as it is now (None: not made yet), and why this demo cannot use it."""
    name = unix_account(hub_name)
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        return None, None
    return account, account_conflict(name, account, HOMES / hub_name, os.path.lexists(account.pw_dir))


def check_unix_accounts() -> None:
    """At the start, as root: every demo user's account is this state directory's or can be made."""
    check_prefix(UNIX_PREFIX)
    problems = [why for user in (*DEMO_USERS, DEMO_ADMIN) if (why := existing_account(user)[1])]
    if problems:
        _fail("; ".join(problems))


def unix_account(hub_name: str) -> str:
    if hub_name not in (*DEMO_USERS, DEMO_ADMIN):
        _fail(f"{hub_name!r} is not a demo user: the demo has Unix accounts only for its own")
    return UNIX_PREFIX + hub_name


def ensure_unix_account(hub_name: str) -> pwd.struct_passwd:
    """The demo's Unix account for ``hub_name``, made if missing, with its private home."""
    name = unix_account(hub_name)
    home = HOMES / hub_name
    check_root_state(STATE, reachable=True)
    private_dir(HOMES, 0, 0, 0o755)
    account, why = existing_account(hub_name)
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


class DemoUnixSpawner(GpuLocalProcessSpawner):
    """``gpu-local`` (JupyterHub's LocalProcessSpawner setuid) where hub user ``alice`` runs as
    Unix account ``gpuhub-demo-alice``, made on the first start."""

    async def start(self):
        ensure_unix_account(self.user.name)
        return await super().start()

    def make_preexec_fn(self, name):
        return super().make_preexec_fn(unix_account(name))

    def user_env(self, env):
        account = pwd.getpwnam(unix_account(self.user.name))
        env.update(USER=account.pw_name, HOME=account.pw_dir, SHELL=account.pw_shell)
        return env


def prepare_root_state() -> None:
    check_root_state(STATE)
    check_unix_accounts()
    private_dir(HOMES, 0, 0, 0o755)
    # the state directory is open to the demo's users (their homes are in it): the hub's own
    # database is not (the ledger and the cookie secret are made 0600 by gpuhub and JupyterHub)
    fd = os.open(STATE / "jupyterhub.sqlite", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    os.close(fd)


passwords = {"user_password": "", "admin_password": ""}  # none: no one logs in
if BY_THE_HUB:
    try:
        passwords = demo_passwords(PASSWORDS_FILE)
        if AS_ROOT:
            prepare_root_state()
        else:
            HOMES.mkdir(mode=0o700, exist_ok=True)
    except DemoError as e:
        raise SystemExit(str(e)) from None

c.JupyterHub.bind_url = "http://127.0.0.1:8000"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = passwords["user_password"]
c.SharedPasswordAuthenticator.admin_password = passwords["admin_password"]
c.Authenticator.allowed_users = set(DEMO_USERS)
c.Authenticator.admin_users = {DEMO_ADMIN}
c.JupyterHub.load_groups = {"students": {"users": ["bob", "carol"]}}
c.JupyterHub.template_vars = {
    "announcement_login": (
        "gpuhub demo: log in as alice, bob, carol or dave with the users' password, or as admin with"
        " the admin password. Both were printed where the demo was started, and are kept in"
        f" {PASSWORDS_FILE} (readable by {HUB_ACCOUNT} only)."
    )
}

# GPUs: 4 simulated ones on this machine, each user's server gets its own
c.GpuHub.inventory = "simulated"
c.GpuHub.simulated_gpus = [{"count": 4, "model": "Simulated A100", "memory_mib": 40960}]
c.GpuHub.db_url = "sqlite:///gpuhub.sqlite"
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {"students": 2}
c.GpuHub.user_limits = {"alice": 3}

# single-user servers: the hub's own Python (scripts/setup makes it readable by other users),
# jupyterhub-singleuser started by gpuhub's launcher, which spares it a parser import that
# takes seconds (spawner/singleuser.py)
c.Spawner.cmd = [sys.executable, "-m", "spawner.singleuser"]
c.Spawner.args = []  # never --allow-root: as root, servers run as the demo's accounts
c.Spawner.default_url = "/lab"
# when the GPUs are all taken a start waits in gpuhub's queue (docs/queue.md): show the
# spawn page with its place at once, and let queued starts not count against new ones
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 1}
c.JupyterHub.concurrent_spawn_limit = 0
if AS_ROOT:
    c.JupyterHub.spawner_class = DemoUnixSpawner
    servers_as = f"Unix accounts {UNIX_PREFIX}<user> (homes in {HOMES})"
else:
    c.JupyterHub.spawner_class = "gpu-local-simple"
    c.SimpleLocalProcessSpawner.home_dir_template = f"{HOMES}/{{username}}"
    servers_as = f"{HUB_ACCOUNT}, the hub's own account (homes in {HOMES})"

# the broker service: REST API, "My GPUs" and "GPU admin" pages, metrics (keep it last:
# it passes the settings above to the service)
enable_broker(c)

if BY_THE_HUB:
    print(
        "gpuhub demo: open http://127.0.0.1:8000 and log in as\n"
        f"  alice (up to 3 GPUs), bob or carol (group students, 2), dave (default, 1)"
        f" with the password {passwords['user_password']!r},\n"
        f"  or admin with {passwords['admin_password']!r}.\n"
        f"  The passwords are this state directory's, in {PASSWORDS_FILE} (readable by {HUB_ACCOUNT} only).\n"
        f"  Servers run as {servers_as}.\n"
        "  4 simulated GPUs; `gpuhub gpus` in the state directory shows who holds them;\n"
        "  pages: http://127.0.0.1:8000/services/gpuhub/ (and /services/gpuhub/admin for admin).",
        file=sys.stderr,
        flush=True,
    )
