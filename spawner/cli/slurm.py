"""``gpuhub slurm``: the Slurm backend as an admin sees it.

- ``script``: the batch script a user's server would be submitted with (:func:`preview_script`);
- ``sync``: every known user's GPU limit and fair share written to Slurm's accounting;
- ``priority``: the ``slurm.conf`` lines that make Slurm order jobs by gpuhub's fair share.
"""

from __future__ import annotations

from gpu_magics.common import words
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import UsageError, parse_name
from spawner.cli.parsers import actions, command
from spawner.policy import values
from spawner.policy.limits import MAX_COUNT


def register(sub) -> None:
    slurm = actions(sub, "slurm", "the Slurm backend")
    sscript = command(slurm, "script", script, help="preview the batch script of a user's server")
    sscript.add_argument("--user", required=True)
    sscript.add_argument(
        "--gpus", type=values.argparse_type(values.parse_count, "--gpus", lo=0, hi=MAX_COUNT), default=1
    )
    sscript.add_argument("--gpu-model")
    sscript.add_argument("--partition", default="")
    command(
        slurm, "sync", sync, help="write every known user's GPU limit and fair share to Slurm's accounting"
    )
    command(slurm, "priority", priority, help="slurm.conf lines: Slurm orders jobs by gpuhub's fair share")


def script(args, out) -> int:
    settings = load_settings(args)
    parse_name(args.user, "--user")
    try:
        text = preview_script(settings.config, args.user, args.gpus, args.gpu_model, args.partition)
    except ValueError as e:  # a value that cannot go on an #SBATCH line
        raise UsageError(str(e)) from None
    print(text, end="", file=out)
    return 0


def priority(args, out) -> int:
    settings = load_settings(args)
    from spawner.slurm.priority import render_priority_conf

    try:
        print(render_priority_conf(settings.queue_weights()), end="", file=out)
    except ValueError as e:  # a bad c.GpuHub weight, named
        raise UsageError(str(e)) from None
    return 0


def sync(args, out) -> int:
    settings = load_settings(args)
    ledger = open_ledger(settings)
    from spawner.slurm.accounting import SlurmAccounting

    accounting = SlurmAccounting(config=settings.config)
    if not accounting.enabled:
        raise UsageError("Slurm accounting is off: set c.SlurmAccounting.enabled = True in the hub's config")
    try:
        commands = accounting.sync(ledger)
    except ValueError as e:  # a bad c.GpuHub share, named
        raise UsageError(str(e)) from None
    for argv in commands:
        print("slurm: " + " ".join(argv[2:]), file=out)
    print(f"{words.count(len(commands), 'change')} written to Slurm's accounting", file=out)
    return 0


def preview_script(config, user: str, gpus: int, model: str | None = None, partition: str = "") -> str:
    """The batch script a server of ``user`` would be submitted with, for admins to check
    a template: the hub's real settings, the standard variables' names (their values, such
    as the server's token, exist only at spawn time)."""
    from spawner.slurm import SlurmError
    from spawner.slurm.cluster import read_cluster
    from spawner.slurm.spawner import GpuSlurmSpawner
    from spawner.spawners import form

    sp = GpuSlurmSpawner(config=config)
    names = [
        "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES", "GPUHUB_ALLOCATION_ID", "GPUHUB_BACKEND", "HOME",
        "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL", "JUPYTERHUB_CLIENT_ID", "JUPYTERHUB_HOST",
        "JUPYTERHUB_OAUTH_CALLBACK_URL", "JUPYTERHUB_SERVER_NAME", "JUPYTERHUB_SERVICE_PREFIX",
        "JUPYTERHUB_SERVICE_URL", "JUPYTERHUB_USER", "PATH", "SHELL", "USER",
    ]  # fmt: skip
    try:
        import pwd

        home = pwd.getpwnam(user).pw_dir
    except KeyError:
        home = f"/home/{user}"
    if not partition:
        try:
            cluster = read_cluster()
            partition = sp.default_partition or cluster.default_partition or ""
        except SlurmError:
            partition = sp.default_partition
    if gpus:
        names.remove("CUDA_VISIBLE_DEVICES")  # Slurm sets it inside the job
    opts = form.GpuOptions(count=gpus, model=model, partition=partition or None)
    return sp.script_for(
        user, home, names, [sp.batchspawner_singleuser_cmd, *sp.cmd, *sp.args], opts, partition
    )
