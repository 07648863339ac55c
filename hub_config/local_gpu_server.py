"""gpuhub on one shared multi-GPU server: real Unix users, the GPUs NVML reports.

Copy to the hub's directory as ``jupyterhub_config.py`` and adjust. Run the hub as root
(it starts each user's server as that user). ``gpuhub`` in the same directory reads this
file, so ``gpuhub limits set --group students 2`` and ``gpuhub gpus`` work there.
"""

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

c.JupyterHub.bind_url = "http://0.0.0.0:8000"  # put TLS in front, or set ssl_cert/ssl_key

# Each user's server on an origin of its own, over HTTPS (docs/security.md, production
# settings): a page one user's server serves can then neither send another user's cookies nor
# script another user's server. It needs a wildcard DNS name and certificate (*.hub.example.org);
# put in your names and uncomment:
# c.JupyterHub.subdomain_host = "https://hub.example.org"
# c.JupyterHub.ssl_cert = "/etc/jupyterhub/ssl/hub.example.org.crt"
# c.JupyterHub.ssl_key = "/etc/jupyterhub/ssl/hub.example.org.key"
c.JupyterHub.authenticator_class = "pam"  # Unix accounts of this machine
c.Authenticator.admin_users = {"gpuadmin"}
c.Authenticator.allow_all = True  # or allowed_users / allowed_groups

# servers survive a hub restart; gpuhub reconciles the ledger with them when it starts
c.JupyterHub.cleanup_servers = False

c.JupyterHub.spawner_class = "gpu-local"  # LocalProcessSpawner + exclusive GPUs
c.GpuHub.inventory = "nvml"  # every GPU the driver sees; indices in PCI bus order
c.GpuHub.db_url = "sqlite:////srv/jupyterhub/gpuhub.sqlite"  # readable by root only
c.Spawner.default_gpus = 1

# limits: the ledger's own rows (``gpuhub limits set``) win over these
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {"students": 2, "staff": {"max_gpus": 4, "gpu_hours": 500}}
c.GpuHub.user_limits = {}
c.Spawner.default_url = "/lab"
# when the GPUs are all taken a start waits in gpuhub's queue (docs/queue.md): show the
# spawn page with its place at once, and let queued starts not count against new ones
c.JupyterHub.tornado_settings = {"slow_spawn_timeout": 1}
c.JupyterHub.concurrent_spawn_limit = 0

# the broker service: REST API, "My GPUs" / "GPU admin" pages at /services/gpuhub/, metrics.
# Keep it last: it hands the settings above to the service.
from spawner.broker import enable_broker  # noqa: E402

enable_broker(c)
