"""gpuhub's hub side: the GPU ledger, its allocation policy, and the GPU spawners.

Spawners are registered as ``jupyterhub.spawners`` entry points:
``c.JupyterHub.spawner_class = "gpu-local"`` (or ``"gpu-local-simple"`` for the demo).
"""

__version__ = "0.1.0"
