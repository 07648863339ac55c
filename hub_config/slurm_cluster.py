"""gpuhub on a Slurm cluster: notebook servers as Slurm jobs with GPUs (``gpu-slurm``).

Copy to the hub's directory as ``jupyterhub_config.py`` and adapt. The hub runs as root
(``sudo -E -u USER sbatch``) on a machine with Slurm's client commands and config; users are
real Unix users who exist on every node; the user-side environment (jupyterhub-singleuser,
batchspawner, ipyparallel, torch, gpuhub) must be installed where every node can read it.
See docs/slurm.md.
"""

import socket
import sys
from pathlib import Path

from spawner.broker import enable_broker

c = get_config()  # noqa: F821 - provided by JupyterHub when it loads this file

USER_ENV = Path(sys.executable).parent  # the users' environment; a shared path on a cluster

c.JupyterHub.bind_url = "http://:8000"
c.JupyterHub.hub_ip = "0.0.0.0"  # servers on compute nodes call the hub back
c.JupyterHub.cleanup_servers = False  # a hub restart leaves the jobs (and their GPUs) alone

# Each user's server on an origin of its own, over HTTPS (docs/security.md, production
# settings): a page one user's server serves can then neither send another user's cookies nor
# script another user's server. It needs a wildcard DNS name and certificate (*.hub.example.org);
# put in your names and uncomment:
# c.JupyterHub.subdomain_host = "https://hub.example.org"
# c.JupyterHub.ssl_cert = "/etc/jupyterhub/ssl/hub.example.org.crt"
# c.JupyterHub.ssl_key = "/etc/jupyterhub/ssl/hub.example.org.key"
# and TLS between the hub, the proxy and the servers on compute nodes (JupyterHub's
# internal_ssl; its certificates must reach each server's node):
# c.JupyterHub.internal_ssl = True
# c.JupyterHub.authenticator_class = "pam"   (or your site's authenticator)

c.JupyterHub.spawner_class = "gpu-slurm"
c.Spawner.cmd = [str(USER_ENV / "gpuhub-singleuser")]  # jupyterhub-singleuser, started faster
# batchspawner-singleuser's port report, without its import of the hub's API handlers
c.GpuSlurmSpawner.batchspawner_singleuser_cmd = str(USER_ENV / "gpuhub-singleuser")
c.GpuSlurmSpawner.default_partition = "gpu"
c.GpuSlurmSpawner.cpus_per_gpu = 8
c.GpuSlurmSpawner.req_runtime = "8:00:00"
# c.GpuSlurmSpawner.extra_directives = ["--qos=interactive"]

c.GpuHub.inventory = "slurm"  # the GPUs every node has, from sinfo
c.GpuHub.db_url = "sqlite:///gpuhub.sqlite"  # PostgreSQL for a larger site
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {"students": 2}

# limits written to Slurm's accounting too, so a plain sbatch is bounded (needs slurmdbd)
c.SlurmAccounting.enabled = True
c.SlurmAccounting.account = "gpuhub"

# keep it last: it passes the settings above to the broker service. Kernels on compute nodes
# ask it for burst GPUs, so it listens on an address they reach.
enable_broker(c, url=f"http://{socket.getfqdn()}:10101")
