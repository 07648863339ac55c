"""Batch scripts, rendered from one Jinja2 template each; a pure function of their inputs.

Every ``#SBATCH`` value is checked to be one word (a value with a space or a newline
would smuggle in another directive or a shell line), and the command is ``shlex``-quoted.
Admins can replace the template (``c.GpuSlurmSpawner.batch_script``) and preview the
result with ``gpuhub slurm script``; the golden files in ``tests/golden/`` lock the
defaults.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence

from jinja2 import Environment, StrictUndefined

WORD = re.compile(r"[^\s'\"\\;`$]+")

SERVER_TEMPLATE = """\
#!/bin/bash
# gpuhub notebook server of {{ user }} (rendered by gpuhub; preview: gpuhub slurm script)
#SBATCH --job-name={{ job_name }}
#SBATCH --output={{ output }}
#SBATCH --chdir={{ homedir }}
#SBATCH --export={{ export }}
#SBATCH --nodes=1
#SBATCH --ntasks=1
{% if gres %}#SBATCH --gres={{ gres }}
{% endif %}{% if partition %}#SBATCH --partition={{ partition }}
{% endif %}{% if cpus %}#SBATCH --cpus-per-task={{ cpus }}
{% endif %}{% if memory %}#SBATCH --mem={{ memory }}
{% endif %}{% if runtime %}#SBATCH --time={{ runtime }}
{% endif %}{% if account %}#SBATCH --account={{ account }}
{% endif %}{% for line in directives %}#SBATCH {{ line }}
{% endfor %}
set -euo pipefail
{% if not gres %}export CUDA_VISIBLE_DEVICES=  # no GPUs asked for: hide any the node has
{% endif %}{{ prologue }}
# the batch step itself runs the server: %%distributed may add srun steps beside it
exec {{ command }}
"""

ENGINES_TEMPLATE = """\
#!/bin/bash
# gpuhub %%distributed engines of {{ user }}: one ipyparallel engine per GPU
#SBATCH --job-name={{ job_name }}
#SBATCH --output={{ output }}
#SBATCH --chdir={{ workdir }}
#SBATCH --nodes={{ nodes }}
#SBATCH --ntasks-per-node={{ per_node }}
#SBATCH --gres={{ gres }}
{% if partition %}#SBATCH --partition={{ partition }}
{% endif %}{% if cpus %}#SBATCH --cpus-per-task={{ cpus }}
{% endif %}{% if memory %}#SBATCH --mem={{ memory }}
{% endif %}{% if account %}#SBATCH --account={{ account }}
{% endif %}{% if runtime %}#SBATCH --time={{ runtime }}
{% endif %}{% for line in directives %}#SBATCH {{ line }}
{% endfor %}
set -euo pipefail
# one task per GPU; each engine pins itself to the GPU of its local rank
exec srun --kill-on-bad-exit=0 --export=ALL {{ command }}
"""

_ENV = Environment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)


def check_word(name: str, value: object) -> str:
    text = str(value)
    if not WORD.fullmatch(text):
        raise ValueError(
            f"{name} must be one word without spaces, quotes, '$', '\\\\' or ';' "
            f"(it goes on an #SBATCH line); got {text!r}"
        )
    return text


def render(template: str, *, command: Sequence[str], directives: Sequence[str] = (), **values) -> str:
    """Render ``template``: ``values`` become one-word directive values (empty ones are
    left out by the template), ``command`` is quoted for the shell, ``directives`` are
    extra ``#SBATCH`` lines (``--qos=high``), each checked to be one option."""
    checked: dict[str, object] = {}
    for key, value in values.items():
        if key == "prologue":
            checked[key] = str(value)
        elif value in (None, ""):
            checked[key] = ""
        else:
            checked[key] = check_word(key, value)
    for line in directives:
        if not re.fullmatch(r"--[A-Za-z][A-Za-z0-9\-]*(=[^\s'\"\\;`$]+)?", line):
            raise ValueError(f"an extra #SBATCH line must be one option like --qos=high; got {line!r}")
    checked.setdefault("prologue", "")
    return _ENV.from_string(template).render(
        command=shlex.join(command), directives=list(directives), **checked
    )


def export_list(env: Mapping[str, str]) -> str:
    """``--export`` value: the names to pass from sbatch's environment (values stay out of
    the script, so tokens are not written into Slurm's saved copy of it)."""
    names = sorted(env)
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"not an environment variable name: {name!r}")
    return ",".join(names)
