"""The gpuhub demo: a real JupyterHub on simulated GPUs, on any machine.

Started by ``scripts/demo`` in its state directory (``demo-state/`` unless
``$GPUHUB_DEMO_STATE``), where every SQLite file, the passwords and the users' homes live.
Log in at http://127.0.0.1:8000 as one of the users printed below.

The demo's code (passwords, Unix accounts, its spawner) is ``spawner/spawners/demo.py``.

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
- ``scripts/demo -f extra.py`` (or ``--config``, any number of times) loads your own
  ``jupyterhub_config.py`` after this one: what it sets replaces the setting here. scripts/demo
  writes the state directory's ``jupyterhub_config.py``, which loads this file and then yours;
  the hub reads it, and so does ``gpuhub`` run there (``.venv/bin/gpuhub limits show``).

The showcase: 4 GPUs for users with limits of 3 (alice), 2 (bob and carol, group students) and
1 (dave), so each thing gpuhub does is a few clicks away:

- the queue: when the GPUs are all taken a start within its limit waits, its place on the
  spawn page (``slow_spawn_timeout`` 1 s shows that page at once);
- borrowing and preemption: everyone may borrow 2 idle GPUs beyond their limit
  (``default_borrow``; only while nobody waits, docs/borrowing.md); when a request within its
  limit waits for them, they are taken back after a notice of 60 s (``preempt_grace_seconds``,
  300 s unless set) in which a ``%%distributed --autosave`` pool saves;
- idle reclaim: a GPU below 5 % with no kernel activity is warned about after 5 minutes and
  taken back after 10 (``c.GpuReclaim``; 15 and 60 unless set, docs/reclaim.md); write
  ``gpuhub-simulated-utilization.json`` in the state directory to make a simulated GPU busy;
- time limits: a student's session ends after 8 h (``group_max_hours``), with warnings 30 and
  5 minutes before; "Extend by hours" on My GPUs or ``%gpus --extend 1h`` adds up to 2 h in all
  (``extension_max_hours``) when nobody waiting would start later (docs/time-limits.md);
- energy and cost: a simulated GPU draws 60 W idle and up to 300 W busy; kWh, EUR and CO2e
  per session on My GPUs, GPU admin, the JupyterLab panel and ``%gpus`` (docs/energy.md);
- slices: the spawn form also offers a quarter of a GPU (``gpu_slices``); a quarter counts as
  1/4 GPU against the limit, and four users can share one GPU (docs/slices.md). The GPUs are
  simulated, so a slice is counted and not held to its share.
"""

import sys

from spawner.broker import enable_broker
from spawner.spawners.demo import DEMO_ADMIN, DEMO_USERS, DemoSite, DemoUnixSpawner

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

site = DemoSite.here()  # scripts/demo starts the hub in its state directory
passwords = site.prepare()  # none unless JupyterHub itself loads this file: no one logs in

c.JupyterHub.bind_url = "http://127.0.0.1:8000"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = passwords["user_password"]
c.SharedPasswordAuthenticator.admin_password = passwords["admin_password"]
c.Authenticator.allowed_users = set(DEMO_USERS)
c.Authenticator.admin_users = {DEMO_ADMIN}
c.JupyterHub.load_groups = {"students": {"users": ["bob", "carol"]}}
c.JupyterHub.template_vars = {"announcement_login": site.login_announcement()}

# GPUs: 4 simulated ones on this machine, each user's server gets its own
c.GpuHub.inventory = "simulated"
c.GpuHub.simulated_gpus = [{"count": 4, "model": "Simulated A100", "memory_mib": 40960}]
c.GpuHub.simulated_load = "processes"  # a busy cell makes its GPUs busy (docs/reclaim.md)
c.GpuHub.db_url = "sqlite:///gpuhub.sqlite"
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {"students": 2}
c.GpuHub.user_limits = {"alice": 3}
c.GpuHub.gpu_slices = {"Simulated A100": 4}  # a quarter of a GPU on the spawn form (docs/slices.md)
c.GpuHub.group_max_hours = {"students": 8}  # a student's session ends after 8 h (docs/time-limits.md)
c.GpuHub.extension_max_hours = 2  # ... and may be extended by 2 h in all when nobody waits for it
# what the GPUs cost (docs/energy.md): a simulated GPU draws 60 W idle, 300 W busy
c.GpuHub.pue = 1.3
c.GpuHub.energy_price = 0.25
c.GpuHub.energy_currency = "EUR"
c.GpuHub.carbon_intensity = 300
# the showcase (the docstring above): borrowing with a short notice, idle reclaim in minutes
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = 60
c.GpuReclaim.warn_after_seconds = 5 * 60
c.GpuReclaim.reclaim_after_seconds = 10 * 60

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
if site.as_root:
    c.JupyterHub.spawner_class = DemoUnixSpawner
    c.DemoUnixSpawner.state_dir = str(site.state)
    c.DemoUnixSpawner.account_prefix = site.prefix
else:
    c.JupyterHub.spawner_class = "gpu-local-simple"
    c.SimpleLocalProcessSpawner.home_dir_template = f"{site.homes}/{{username}}"

# the broker service: REST API, "My GPUs" and "GPU admin" pages, metrics (keep it last:
# it passes the settings above to the service)
enable_broker(c)

site.welcome(passwords, c)
