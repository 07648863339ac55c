"""The Slurm backend: GPU servers and ``%%distributed`` engines as Slurm jobs.

- :mod:`.sinfo`, :mod:`.squeue`: pure parsing of what Slurm prints (``sinfo``,
  ``squeue --json`` and its text fallback).
- :mod:`.commands`: the argument lists of the commands gpuhub runs, and the checks made
  on Slurm's answers before acting (``parse_sbatch``, ``cancel_refusal``).
- :mod:`.script`: the batch scripts, rendered from one template (admins may override it).
- :mod:`.watcher`: one poller per hub process for every gpuhub job, with back-off; the
  ledger is reconciled from its answers.
- :mod:`.reconcile`: what the watcher decides from one answer (pure).
- :mod:`.accounting`: limits written to Slurm associations (``GrpTRES=gres/gpu=N``).
- :mod:`.spawner`: ``gpu-slurm``, batchspawner's ``SlurmSpawner`` with the ledger.

:class:`SlurmError` is here, since every one of them raises it.
"""


class SlurmError(RuntimeError):
    """A Slurm command failed or printed something gpuhub cannot read."""
