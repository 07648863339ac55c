"""The gpuhub demo: a real JupyterHub on simulated GPUs, on any machine.

Started by ``scripts/demo`` (from ``demo-state/``, where every SQLite file lives).
Log in at http://127.0.0.1:8000 as one of the users printed below.
Insecure on purpose (one shared password, every server as the hub's Unix user):
never expose it beyond this machine.
"""

import sys

from spawner.broker import enable_broker

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

DEMO_PASSWORD = "gpuhub-demo"
DEMO_ADMIN_PASSWORD = "gpuhub-demo-admin-password-change-me"

c.JupyterHub.bind_url = "http://127.0.0.1:8000"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = DEMO_PASSWORD
c.SharedPasswordAuthenticator.admin_password = DEMO_ADMIN_PASSWORD
c.Authenticator.allowed_users = {"alice", "bob", "carol", "dave"}
c.Authenticator.admin_users = {"admin"}
c.JupyterHub.load_groups = {"students": {"users": ["bob", "carol"]}}

# GPUs: 4 simulated ones on this machine, each user's server gets its own
c.JupyterHub.spawner_class = "gpu-local-simple"
c.GpuHub.inventory = "simulated"
c.GpuHub.simulated_gpus = [{"count": 4, "model": "Simulated A100", "memory_mib": 40960}]
c.GpuHub.db_url = "sqlite:///gpuhub.sqlite"
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {"students": 2}
c.GpuHub.user_limits = {"alice": 3}

# single-user servers: the hub's own Python, as the hub's user (root allowed for the demo)
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.args = ["--allow-root"]
c.Spawner.default_url = "/lab"
c.SimpleLocalProcessSpawner.home_dir_template = "/tmp/gpuhub-demo/{username}"

# the broker service: REST API, "My GPUs" and "GPU admin" pages, metrics (keep it last:
# it passes the settings above to the service)
enable_broker(c)

print(
    "gpuhub demo: open http://127.0.0.1:8000 and log in as\n"
    f"  alice (up to 3 GPUs), bob or carol (group students, 2), dave (default, 1)"
    f" with the password {DEMO_PASSWORD!r},\n"
    f"  or admin with {DEMO_ADMIN_PASSWORD!r}.\n"
    "  4 simulated GPUs; `gpuhub gpus` in demo-state/ shows who holds them;\n"
    "  pages: http://127.0.0.1:8000/services/gpuhub/ (and /services/gpuhub/admin for admin).",
    file=sys.stderr,
    flush=True,
)
