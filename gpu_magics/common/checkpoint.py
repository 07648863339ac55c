"""Save and restore a ``%%distributed`` pool's objects: ``%distributed save|restore NAME...``
and ``--autosave NAME...``.

This module holds the format and the pure parts (names, paths, kinds, messages). Two halves
use it: the engine side (``engine/checkpoints.py``, with ``engine/dcp.py`` for models and
optimizers, inside the ranks' engines, answering plain dicts, never raising for a user's
mistake) and the kernel side (``kernel/checkpoints.py``: ``Checkpointer``, given an
``EnginePool``, checks every rank, has every rank write its part, checks every rank's answer,
then has rank 0 make the save visible; restores into every rank, all or nothing).

The format, version 2 (``docs/checkpoints.md``):

- a model (any ``nn.Module``: plain, DDP, FSDP2's ``fully_shard``) or an optimizer is a
  ``torch.distributed.checkpoint`` (DCP) directory ``DIR/NAME.dcp``: every rank writes its own
  shards (``get_model_state_dict`` / ``get_optimizer_state_dict``, ``dcp.save``), keyed by the
  parameters' names without a wrapper's prefix, so a checkpoint fits a plain, DDP or FSDP2
  model of any world size (``dcp.load`` reshards). Beside DCP's files, ``gpuhub.json`` says
  what it is (``{"format", "version": 2, "name", "kind", "type", "saved", "world_size",
  "save", "model"}``; ``model``: the name of an optimizer's model, saved with it).
- anything else (LR schedulers, tensors, plain values) is one file ``DIR/NAME.pt`` as in
  version 1: ``torch.save`` of ``{"format": "gpuhub-checkpoint", "version": 1, "name", "kind",
  "type", "state", "saved", "rank", "world_size"}``, rank 0's.

Version 1 files of modules and optimizers (``DIR/NAME.pt``, gpuhub before DCP) still restore.

Durable: a save's every part is written into one temporary sibling directory
(``DIR/.gpuhub-save.HOST.PID.ID.tmp``: the kernel's host and pid), each file fsynced; only once
every rank's answer is checked does rank 0 move each name into place with one atomic rename
(``renameat2(RENAME_EXCHANGE)`` for a directory that exists) and fsync ``DIR``. Any failure
removes the temporary directory; the previous checkpoint is untouched.
"""

from __future__ import annotations

import errno
import os

FORMAT = "gpuhub-checkpoint"
VERSION = 1  # the one-file format (values, tensors, schedulers; old modules)
DCP_VERSION = 2  # models and optimizers: a DCP directory
SUFFIX = ".pt"
DCP_SUFFIX = ".dcp"
META_FILE = "gpuhub.json"  # in a NAME.dcp directory: what it holds
TEMP_PREFIX = ".gpuhub-save."
TEMP_SUFFIX = ".tmp"
DEFAULT_DIR = "~/.local/share/gpuhub/checkpoints"
CHECK_TIMEOUT = 30.0  # asking each rank what its names are
SAVE_TIMEOUT = 3600.0  # writing or reading checkpoints: as long as a big model needs

# what each kind is called, and how it is restored
KINDS = {
    "ddp": "DDP module",
    "sharded": "sharded module (FSDP2)",
    "module": "module",
    "optimizer": "optimizer",
    "scheduler": "LR scheduler",
    "tensor": "tensor",
    "value": "value",
}
STATEFUL = ("ddp", "sharded", "module", "optimizer", "scheduler")  # restored in place
MODULES = ("ddp", "sharded", "module")
DCP_KINDS = (*MODULES, "optimizer")  # saved by every rank through torch.distributed.checkpoint


# pure parts ------------------------------------------------------------------------------


def resolve_dir(directory: str | None) -> str:
    """``--dir`` (or the default) as an absolute path: ``~`` expanded, relative to the kernel."""
    return os.path.abspath(os.path.expanduser(directory or DEFAULT_DIR))


def dir_problem(directory: str) -> str | None:
    """Why checkpoints could not be written to ``directory`` (absolute), or None: it is a
    directory this user may write, or one that can be made in the nearest that exists."""
    if os.path.exists(directory):
        if not os.path.isdir(directory):
            return f"{directory} is a file, not a directory"
        if not os.access(directory, os.W_OK | os.X_OK):
            return f"{directory} is not writable by you"
        return None
    parent = os.path.dirname(directory)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{directory} cannot be made: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{directory} cannot be made: {parent} is not writable by you"
    return None


def checkpoint_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + SUFFIX)


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def missing_message(what: str, missing: dict[str, list[int]], world: int) -> str:
    """``save``: which names are not defined on which ranks."""
    parts = []
    for name, ranks in missing.items():
        where = "any rank" if len(ranks) == world else ranks_text(ranks)
        parts.append(f"{name!r} is not defined on {where}")
    return (
        f"{what}: {'; '.join(parts)}. Nothing was written: define "
        + ("it" if len(missing) == 1 else "them")
        + " on every rank (a %%distributed cell without --targets), or leave "
        + ("it" if len(missing) == 1 else "them")
        + " out."
    )


def os_error_message(
    what: str, err: int | None, strerror: str, directory: str, name: str | None, suffix: str = SUFFIX
) -> str:
    """A failed write or directory, said with what to do about it (``suffix``: of the name's
    file, ``.pt``, or directory, ``.dcp``)."""
    where = os.path.join(directory, name + suffix) if name else directory
    if err in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"{what}: no space left for {where} ({strerror}). Nothing was written: free some space, "
            "or choose a directory with room: --dir DIR."
        )
    if err in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"{what}: cannot write to {directory} ({strerror}). Nothing was written: choose a "
            "directory of your own that every rank reaches: --dir DIR (default "
            f"{DEFAULT_DIR})."
        )
    if err in (errno.ENOTDIR, errno.EEXIST):
        return f"{what}: {directory} is not a directory ({strerror}). Nothing was written: --dir DIR."
    return f"{what}: could not write {where}: {strerror}. Nothing was written."


def unsaveable_message(what: str, name: str, type_name: str, detail: str) -> str:
    return (
        f"{what}: cannot save {name!r} (a {type_name}): {detail}. Nothing was written. Save what it "
        "holds instead (a state_dict, tensors, lists, numbers), or leave it out and re-create it by "
        "re-running the cell that defines it."
    )


def restore_problem_message(problems: dict[tuple[str, str], list[int]], world: int) -> str:
    """``restore``: each (name, problem) with the ranks it was found on."""
    parts = []
    for (name, text), ranks in problems.items():
        where = "" if len(ranks) == world else f" (on {ranks_text(ranks)})"
        parts.append(f"{name!r}{where}: {text}")
    return "restore: " + "\n  ".join(parts) + "\nNothing was restored."


def kind_of(obj) -> str:
    """What a rank's object is, for saving: see ``KINDS`` (imports torch: engine side)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if isinstance(obj, DistributedDataParallel):
        return "ddp"
    if isinstance(obj, torch.nn.Module):
        return "sharded" if _sharded(obj) else "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
        return "scheduler"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    return "value"


def _sharded(module) -> bool:
    """A module with DTensor parameters (FSDP2's ``fully_shard``, tensor parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in module.parameters())


def type_name(obj) -> str:
    t = type(obj)
    return t.__name__ if t.__module__ in ("builtins", "__main__") else f"{t.__module__}.{t.__qualname__}"


def state_of(obj, kind: str):
    if kind == "ddp":
        return obj.module.state_dict()
    if kind in STATEFUL:
        return obj.state_dict()
    if kind == "tensor" and not obj.is_leaf:
        return obj.detach()
    return obj


def fits(kind: str, saved_type: str, state, target) -> str | None:
    """Why a checkpoint of ``kind`` cannot be loaded into ``target`` (None: it can)."""
    what = KINDS[kind] if kind not in MODULES else "module (same layers as saved)"
    rerun = f"re-run the cell that defines the {what} first, then restore"
    if target is _MISSING:
        return f"is not defined: {rerun}"
    have = kind_of(target)
    if kind in MODULES:
        if have not in MODULES:
            return f"is a {type_name(target)}, not a module: {rerun}"
        if have == "sharded":
            return None  # a full state dict: checked against the full shapes when loaded
        module = target.module if have == "ddp" else target
        mine = module.state_dict()
        missing = [k for k in mine if k not in state]
        extra = [k for k in state if k not in mine]
        shapes = [
            f"{k} saved {tuple(state[k].shape)}, here {tuple(mine[k].shape)}"
            for k in mine
            if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(mine[k].shape)
        ]
        if missing or extra or shapes:
            said = []
            if missing:
                said.append("not in the checkpoint: " + ", ".join(missing[:5]))
            if extra:
                said.append("not in the module: " + ", ".join(extra[:5]))
            if shapes:
                said.append("; ".join(shapes[:5]))
            return f"the checkpoint does not fit this module ({'; '.join(said)}): {rerun} as it was saved"
        return None
    if have != kind:
        return f"is a {type_name(target)}, not an {KINDS[kind]} ({saved_type}): {rerun}"
    if type_name(target) != saved_type:
        return f"is a {type_name(target)}; the checkpoint is of a {saved_type}: {rerun} as it was saved"
    if kind == "optimizer":
        groups = target.state_dict()["param_groups"]
        saved = state.get("param_groups", [])
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in saved]:
            return (
                f"its parameter groups ({[len(g['params']) for g in groups]} parameters) differ from the "
                f"checkpoint's ({[len(g['params']) for g in saved]}): {rerun} over the same model"
            )
    return None


# version 2: models and optimizers as DCP directories -------------------------------------


def dcp_path(directory: str, name: str) -> str:
    return os.path.join(directory, name + DCP_SUFFIX)


def temp_name(host: str, pid: int, token: str) -> str:
    """The temporary sibling directory of one save, named by the kernel that makes it."""
    return f"{TEMP_PREFIX}{host}.{pid}.{token}{TEMP_SUFFIX}"


def parse_temp(basename: str) -> tuple[str, int, str] | None:
    """(host, pid, token) of a save's temporary directory's name, or None: not one."""
    if not (basename.startswith(TEMP_PREFIX) and basename.endswith(TEMP_SUFFIX)):
        return None
    parts = basename[len(TEMP_PREFIX) : -len(TEMP_SUFFIX)].rsplit(".", 2)  # a host may hold dots
    if len(parts) != 3 or not parts[1].isdigit() or not parts[0] or not parts[2]:
        return None
    return parts[0], int(parts[1]), parts[2]


def stale_temps(listing: list[str], host: str, live, current: str | None = None) -> list[str]:
    """The temporary directories in ``listing`` left by saves that can no longer finish:
    made on ``host`` by a process that ``live(pid)`` says is gone, or by a live one that is
    saving ``current`` now (one save at a time: its others are over). Another host's are left
    alone (its processes cannot be checked from here)."""
    out = []
    for b in listing:
        parsed = parse_temp(b)
        if parsed is None or parsed[0] != host or b == current:
            continue
        if not live(parsed[1]) or (current is not None and parse_temp(current)[:2] == parsed[:2]):
            out.append(b)
    return out


def match_optimizers(
    optimizers: dict[str, list[int]], modules: dict[str, list[int]]
) -> dict[str, str | None]:
    """Each optimizer's model: the first module (in the order given) that holds every one of
    the optimizer's parameters (ids), or None."""
    held = {m: set(ids) for m, ids in modules.items()}
    return {o: next((m for m, ids in held.items() if set(p) <= ids), None) for o, p in optimizers.items()}


def no_model_message(what: str, opt: str, model: str | None) -> str:
    """An optimizer saved without its model (DCP keys its state by the model's parameter names)."""
    if model:
        how = f"save the model with it: %distributed {what} {model} {opt}"
    else:
        how = f"save the model with it: %distributed {what} model {opt} (your model's name for model)"
    return (
        f"{what}: {opt!r} is an optimizer whose model is not saved with it, and its state is kept by "
        f"the model's parameter names. Nothing was written: {how}."
    )


def _listed(keys: list[str], limit: int = 5) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def module_fit(name: str, saved: dict[str, tuple | None], mine: dict[str, tuple | None]) -> str | None:
    """Why a model checkpoint with keys (and global shapes) ``saved`` does not fit a model whose
    state dict has ``mine``; None: it fits."""
    missing = [k for k in saved if k not in mine]
    extra = [k for k in mine if k not in saved]
    shapes = [
        f"{k} saved {saved[k]}, yours {mine[k]}"
        for k in mine
        if k in saved and saved[k] is not None and mine[k] is not None and saved[k] != mine[k]
    ]
    if not (missing or extra or shapes):
        return None
    said = []
    if missing:
        said.append(f"the checkpoint has {_listed(missing)}, missing in yours")
    if extra:
        said.append(f"yours has {_listed(extra)}, not in the checkpoint")
    if shapes:
        said.append("; ".join(shapes[:5]))
    return (
        f"the checkpoint does not fit this module ({'; '.join(said)}): define {name} as it was saved "
        "(same layers) in a cell, then restore"
    )


def optimizer_fqns(keys) -> set[str]:
    """The parameter names an optimizer checkpoint has state for (``state.FQN.exp_avg``)."""
    return {
        k[len("state.") :].rsplit(".", 1)[0] for k in keys if k.startswith("state.") and k.count(".") >= 2
    }


def optimizer_groups(keys) -> int:
    return len({k.split(".")[1] for k in keys if k.startswith("param_groups.") and k.count(".") >= 2})


def optimizer_fit(name: str, saved_keys, model_name: str, model_fqns, groups: int) -> str | None:
    """Why an optimizer checkpoint does not fit this optimizer over ``model_name``, or None."""
    unknown = sorted(optimizer_fqns(saved_keys) - set(model_fqns))
    if unknown:
        return (
            f"the checkpoint has state for parameters {model_name} does not have ({_listed(unknown)}): "
            f"define {model_name} and {name} as they were saved, then restore"
        )
    if optimizer_groups(saved_keys) != groups:
        return (
            f"it has {groups} parameter groups, the checkpoint {optimizer_groups(saved_keys)}: "
            f"define {name} as it was saved, then restore"
        )
    return None


def no_model_here(name: str, saved_model: str | None) -> str:
    which = f" ({saved_model}, when saved)" if saved_model else ""
    return (
        f"none of your modules holds its parameters: define the model it optimizes{which} and {name} "
        "over its parameters, then restore"
    )


def save_error_text(what: str, result: dict, directory: str, world: int) -> str:
    """A rank's failed write (``engine_write``'s answer) said with what to do."""
    if result["error"] == "missing":
        return missing_message(what, {result["name"]: [result.get("rank", 0)]}, world)
    if result["error"] == "unsaveable":
        return unsaveable_message(what, result["name"], result["type"], result["detail"])
    if result["error"] == "os":
        suffix = result.get("suffix", SUFFIX)
        return os_error_message(what, result["errno"], result["strerror"], directory, result["name"], suffix)
    return f"{what}: {result.get('name') or 'the save'}: {result.get('detail')}. Nothing was written."


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()
