"""The README's first command: the demo hub starts, a user logs in and gets a GPU server.

As root the demo runs every server as a Unix account of its own (``gpuhub-demo-<user>``),
never as root; its passwords are made for its state directory and kept there. The tests' demos
get accounts of their own (``$GPUHUB_DEMO_ACCOUNT_PREFIX``): a demo someone runs on this
machine keeps its ``gpuhub-demo-`` accounts, and the tests never touch them.
"""

import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from .hubtools import REPO, free_port, process_environ, wait_for, xsrf_from

pytestmark = pytest.mark.hub

AS_ROOT = os.geteuid() == 0
UNIX_PREFIX = f"gpuhub-t{os.getpid()}-"  # this run's demos' accounts
OLD_PASSWORDS = ("gpuhub-demo", "gpuhub-demo-admin-password-change-me")  # the repo's, before


@pytest.fixture
def demo_state(tmp_path):
    """A state directory for the demo. As root: in a root-owned 0755 directory (the demo's
    users must reach their homes there: pytest's own is 0700); afterwards the demo's Unix
    accounts whose homes were in it are removed, once nothing of theirs runs."""
    if not AS_ROOT:
        yield tmp_path / "state"
        return
    base = Path(tempfile.mkdtemp(prefix="gpuhub-demo-test-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base / "state"
    finally:
        ours = [a for a in pwd.getpwall() if a.pw_name.startswith(UNIX_PREFIX)]
        assert all(a.pw_dir.startswith(f"{base}/") for a in ours), ours
        wait_for(
            lambda: not any(uids_of_processes() & {a.pw_uid for a in ours}), 60, "the demo's servers to end"
        )
        for a in ours:
            subprocess.run(["userdel", a.pw_name], check=True, capture_output=True)
        shutil.rmtree(base)


class Demo:
    """``scripts/demo`` in ``state``, on free ports, its output in ``log``."""

    def __init__(
        self, state: Path, log: Path, refused: bool = False, prefix: str = UNIX_PREFIX, args: tuple = ()
    ):
        """``refused``: the demo is expected to stop before it serves (then ``printed`` says why).
        ``args``: more of scripts/demo's arguments (``-f extra.py``)."""
        self.state, self.log_path = state, log
        self.url = f"http://127.0.0.1:{free_port()}"
        self.hub_port, api_port = free_port(), free_port()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(REPO / "scripts" / "demo"),
                    f"--JupyterHub.bind_url={self.url}",
                    f"--JupyterHub.hub_port={self.hub_port}",
                    f"--ConfigurableHTTPProxy.api_url=http://127.0.0.1:{api_port}",
                    *args,
                ],
                env=dict(os.environ, GPUHUB_DEMO_STATE=str(state), GPUHUB_DEMO_ACCOUNT_PREFIX=prefix),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        if refused:
            assert self.proc.wait(120) != 0, self.printed()[-4000:]
            return
        import requests

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"the demo exited ({self.proc.returncode}):\n{self.printed()[-4000:]}")
            return requests.get(f"{self.url}/hub/login", timeout=2).status_code == 200

        wait_for(up, 120, "the demo hub")

    def printed(self) -> str:
        return self.log_path.read_text(errors="replace")

    def printed_passwords(self) -> tuple[str, str]:
        out = self.printed()
        # each bare on a line of its own: nothing around it is part of it
        user = re.search(r"^    users' password: (\S+)$", out, re.M).group(1)
        admin = re.search(r"^    admin password:  (\S+)$", out, re.M).group(1)
        return user, admin

    def login(self, user: str, password: str):
        """A session after logging in (``ok``: the login was accepted), and the last response."""
        import requests

        s = requests.Session()
        page = s.get(f"{self.url}/hub/login", timeout=30)
        r = s.post(
            f"{self.url}/hub/login",
            data={"username": user, "password": password, "_xsrf": xsrf_from(page.text)},
            timeout=30,
        )
        ok = r.status_code == 200 and not r.url.split("?")[0].endswith("/hub/login")
        return s, r, ok

    def start_server(self, user: str, password: str, gpus: int):
        s, r, ok = self.login(user, password)
        assert ok and r.url.endswith("/hub/spawn"), (r.status_code, r.url)
        r = s.post(f"{self.url}/hub/spawn", data={"gpus": str(gpus), "_xsrf": xsrf_from(r.text)}, timeout=60)
        assert r.status_code == 200, r.status_code

        def ready():
            r = s.get(
                f"{self.url}/hub/api/users/{user}",
                headers={"X-XSRFToken": s.cookies.get("_xsrf", path="/hub/")},
            )
            r.raise_for_status()
            server = r.json()["servers"].get("")
            return server if server and server["ready"] else None

        wait_for(ready, 90, f"{user}'s demo server")
        return s

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(60)


def pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def status_uids(pid: int) -> list[int]:
    """The process's real, effective, saved and filesystem uids."""
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("Uid:"))
    return [int(u) for u in line.split()[1:]]


def uids_of_processes() -> set[int]:
    uids = set()
    for pid in pids():
        try:
            uids.add(status_uids(pid)[0])
        except (OSError, StopIteration):
            continue
    return uids


def server_processes(demo: Demo, user: str) -> list[tuple[int, dict[str, str]]]:
    """The processes of ``user``'s server on ``demo`` (and their environments), read from /proc
    (other hubs may run on this machine, with users of the same names)."""
    api = f"http://127.0.0.1:{demo.hub_port}/hub/api"
    found = []
    for pid in pids():
        try:
            env = process_environ(pid)
        except OSError:
            continue
        if env.get("JUPYTERHUB_USER") == user and env.get("JUPYTERHUB_API_URL") == api:
            found.append((pid, env))
    return found


def test_demo_command_starts_a_hub_where_a_user_gets_gpus(tmp_path, demo_state):
    extra = tmp_path / "extra.py"  # the admin's own file, loaded after the demo's
    extra.write_text('c = get_config()\nc.GpuHub.user_limits = {"alice": 3, "dave": 2}\n')
    demo = Demo(demo_state, tmp_path / "demo.log", args=("-f", str(extra)))
    try:
        printed = demo.printed()
        assert "log in as" in printed and "alice (up to 3 GPUs)" in printed
        password, admin_password = demo.printed_passwords()
        assert f"'{password}'" not in printed and f"'{admin_password}'" not in printed
        gpuhub = REPO / ".venv" / "bin" / "gpuhub"
        assert f"cd {demo_state} && {gpuhub.resolve()} limits show" in printed  # the CLI's exact path
        assert f"gpuhub demo: also read {extra}" in printed
        assert "each user may borrow 2 idle GPUs beyond their limit (1 minute of notice" in printed

        s, r, ok = demo.login("alice", password)
        assert ok and r.url.endswith("/hub/spawn"), r.url  # the GPU form
        assert 'data-gpuhub="free">4<' in r.text and 'data-gpuhub="fits">3<' in r.text
        assert 'data-gpuhub="may-borrow">1<' in r.text  # the demo lends idle GPUs beyond the limit
        _, r, ok = demo.login("dave", password)  # the extra file's limit, on the hub
        assert ok and 'data-gpuhub="fits">2<' in r.text
        # the CLI in the state directory reads the same config as the hub, and says so
        shown = subprocess.run(
            [str(gpuhub), "limits", "show"], cwd=demo_state, capture_output=True, text=True, check=True
        )
        rows = [line.split() for line in shown.stdout.splitlines()[2:]]
        assert ["group", "students", "2", "-", "config"] in rows and [
            "user",
            "dave",
            "2",
            "-",
            "config",
        ] in rows
        assert shown.stderr == f"gpuhub: read {demo_state / 'jupyterhub_config.py'}\n"
        s = demo.start_server("alice", password, 3)
        # the server answers through the proxy, behind the hub's login
        lab = s.get(f"{demo.url}/user/alice/lab")
        assert lab.status_code == 200 and "JupyterLab" in lab.text

        # the admin's view: `gpuhub gpus` in the demo's directory shows alice's 3 GPUs
        out = subprocess.run(
            [str(REPO / ".venv" / "bin" / "gpuhub"), "gpus"],
            cwd=demo_state,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        rows = [line for line in out.splitlines() if " alice " in f" {line} "]
        assert len(rows) == 3, out
        jobs = {re.search(r"#(\d+)", line).group(1) for line in rows}
        assert len(jobs) == 1
        # and the server process has exactly those GPUs
        envs = [e for _, e in server_processes(demo, "alice") if e.get("GPUHUB_ALLOCATION_ID") in jobs]
        assert envs and {e["CUDA_VISIBLE_DEVICES"] for e in envs} == {"0,1,2"}
    finally:
        demo.stop()


def test_an_extra_config_that_is_not_there_stops_the_demo_at_once(tmp_path):
    r = subprocess.run(
        [str(REPO / "scripts" / "demo"), "-f", str(tmp_path / "nope.py")], capture_output=True, text=True
    )
    assert r.returncode == 2 and f"no config file at {tmp_path / 'nope.py'}" in r.stderr
    r = subprocess.run([str(REPO / "scripts" / "demo"), "--config"], capture_output=True, text=True)
    assert r.returncode == 2 and "--config needs a file" in r.stderr


def test_demo_passwords_are_the_state_directorys_own_and_survive_a_restart(tmp_path, demo_state):
    demo = Demo(demo_state, tmp_path / "demo.log")
    try:
        stored_file = demo_state / "demo-passwords.json"
        st = os.lstat(stored_file)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o600
        stored = json.loads(stored_file.read_text())
        user_password, admin_password = demo.printed_passwords()
        assert (user_password, admin_password) == (stored["user_password"], stored["admin_password"])
        assert not {user_password, admin_password} & set(OLD_PASSWORDS)
        # the login page says where the passwords are, and the repo's old ones let no one in
        assert str(stored_file) in demo.login("alice", "x" * 8)[1].text
        for user, wrong in [
            ("alice", OLD_PASSWORDS[0]),
            ("admin", OLD_PASSWORDS[1]),
            ("alice", admin_password),
        ]:
            _, r, ok = demo.login(user, wrong)
            assert not ok and r.status_code == 403, (user, r.status_code, r.url)
        assert demo.login("bob", user_password)[2] and demo.login("admin", admin_password)[2]
    finally:
        demo.stop()

    again = Demo(demo_state, tmp_path / "demo-again.log")
    try:
        assert again.printed_passwords() == (user_password, admin_password)
        assert json.loads(stored_file.read_text()) == stored
        assert again.login("carol", user_password)[2] and again.login("admin", admin_password)[2]
        assert not again.login("carol", OLD_PASSWORDS[0])[2]
    finally:
        again.stop()


def assert_runs_as_its_own_account(demo: Demo, user: str) -> pwd.struct_passwd:
    state = demo.state
    account = pwd.getpwnam(UNIX_PREFIX + user)
    assert account.pw_uid != 0 and account.pw_gid != 0
    assert account.pw_dir == str(state / "homes" / user)
    procs = server_processes(demo, user)
    assert procs, f"no process of {user}'s server"
    for pid, _ in procs:
        assert status_uids(pid) == [account.pw_uid] * 4, (pid, status_uids(pid))
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"--allow-root" not in argv
    home = os.lstat(account.pw_dir)
    assert stat.S_ISDIR(home.st_mode) and home.st_uid == account.pw_uid
    assert stat.S_IMODE(home.st_mode) == 0o700  # not writable (nor readable) by anyone else
    return account


@pytest.mark.skipif(not AS_ROOT, reason="as root only: the demo then runs servers as accounts of its own")
def test_demo_as_root_runs_every_server_as_its_users_own_account(tmp_path, demo_state):
    demo = Demo(demo_state, tmp_path / "demo.log")
    try:
        password, _ = demo.printed_passwords()
        assert f"Servers run as Unix accounts {UNIX_PREFIX}<user>" in demo.printed()
        for d in (demo_state, demo_state / "homes"):
            st = os.lstat(d)
            assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o755), d
        # the ledger is made by whichever opens it first, the broker service at its start or a
        # spawn: the login page may answer before either did
        wait_for(lambda: (demo_state / "gpuhub.sqlite").exists(), 60, "the ledger's file")
        for private in (
            "demo-passwords.json",
            "jupyterhub.sqlite",
            "gpuhub.sqlite",
            "jupyterhub_cookie_secret",
        ):
            assert not os.stat(demo_state / private).st_mode & 0o077, private  # the hub's only
        alice_session = demo.start_server("alice", password, 1)
        demo.start_server("bob", password, 2)
        alice = assert_runs_as_its_own_account(demo, "alice")
        bob = assert_runs_as_its_own_account(demo, "bob")
        assert alice.pw_uid != bob.pw_uid
        # no server of the demo runs as root, and alice's own code runs as alice's account
        demo_pids = {pid for user in ("alice", "bob") for pid, _ in server_processes(demo, user)}
        assert all(status_uids(pid)[0] != 0 for pid in demo_pids)
        lab = alice_session.get(f"{demo.url}/user/alice/lab")  # sets the server's _xsrf cookie
        assert lab.status_code == 200
        xsrf = {"X-XSRFToken": alice_session.cookies.get("_xsrf", path="/user/alice/")}
        r = alice_session.put(
            f"{demo.url}/user/alice/api/contents/probe.txt",
            json={"type": "file", "format": "text", "content": "mine"},
            headers=xsrf,
        )
        assert r.status_code in (200, 201), r.text
        assert os.stat(Path(alice.pw_dir) / "probe.txt").st_uid == alice.pw_uid
    finally:
        demo.stop()
    # a restart reuses the accounts and their homes
    again = Demo(demo_state, tmp_path / "demo-again.log")
    try:
        again.start_server("alice", password, 1)
        assert assert_runs_as_its_own_account(again, "alice").pw_uid == alice.pw_uid
        assert (Path(alice.pw_dir) / "probe.txt").read_text() == "mine"
    finally:
        again.stop()
    # a demo in another state directory while this one is still there: stopped at once, naming
    # the accounts that are this one's (not a failed spawn later)
    other_state = demo_state.parent / "other"
    # and an account of that name that is not the demo's at all (another admin's): not used
    foreign = f"{UNIX_PREFIX}dave"
    subprocess.run(
        ["useradd", "--system", "--no-create-home", "--home-dir", str(demo_state.parent / "dave"), foreign],
        check=True,
        capture_output=True,
    )
    try:
        other = Demo(other_state, tmp_path / "other.log", refused=True)
    finally:
        subprocess.run(["userdel", foreign], check=True, capture_output=True)
    assert (
        f"the Unix account {foreign} exists and is not the demo's: not using it; give this demo"
        in other.printed()
    )
    for user in ("alice", "bob"):
        assert f"the Unix account {UNIX_PREFIX}{user} belongs to the demo in {demo_state}" in other.printed()
    assert (
        f"userdel {UNIX_PREFIX}alice" in other.printed() and "GPUHUB_DEMO_ACCOUNT_PREFIX=" in other.printed()
    )
    assert f"{UNIX_PREFIX}carol" not in other.printed()  # never made: free
    bad = Demo(other_state, tmp_path / "bad.log", refused=True, prefix="Not A Prefix")
    assert "GPUHUB_DEMO_ACCOUNT_PREFIX='Not A Prefix' makes no Unix account names" in bad.printed()
    # once the first state directory is gone, the other demo takes its accounts over
    shutil.rmtree(demo_state)
    other = Demo(other_state, tmp_path / "other-again.log")
    try:
        other.start_server("alice", other.printed_passwords()[0], 1)
        taken = assert_runs_as_its_own_account(other, "alice")
        assert taken.pw_uid == alice.pw_uid and taken.pw_dir == str(other_state / "homes" / "alice")
        assert not (Path(taken.pw_dir) / "probe.txt").exists()
        assert "scripts/demo --remove-accounts   removes them" in other.printed()
    finally:
        other.stop()
    # the command the banner names removes the accounts the demo leaves
    env = dict(os.environ, GPUHUB_DEMO_STATE=str(other_state), GPUHUB_DEMO_ACCOUNT_PREFIX=UNIX_PREFIX)
    wait_for(lambda: not any(uids_of_processes() & {taken.pw_uid}), 60, "the demo's servers to end")
    removed = subprocess.run(
        [str(REPO / "scripts" / "demo"), "--remove-accounts"], env=env, capture_output=True, text=True
    )
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert f"gpuhub demo: removed {UNIX_PREFIX}alice" in removed.stdout
    assert not [a for a in pwd.getpwall() if a.pw_name.startswith(UNIX_PREFIX)]
