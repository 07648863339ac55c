"""The Slurm backend: GPU servers and ``%%distributed`` engines as Slurm jobs.

- :mod:`.jobs`: pure parsing of what Slurm prints (``sinfo``, ``squeue --json``)
  and the argument lists of the commands gpuhub runs.
- :mod:`.script`: the batch scripts, rendered from one template (admins may override it).
- :mod:`.watcher`: one poller per hub process for every gpuhub job, with back-off; the
  ledger is reconciled from its answers.
- :mod:`.accounting`: limits written to Slurm associations (``GrpTRES=gres/gpu=N``).
- :mod:`.spawner`: ``gpu-slurm``, batchspawner's ``SlurmSpawner`` with the ledger.
"""
