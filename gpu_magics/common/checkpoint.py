"""Save and restore a ``%%distributed`` pool's objects: ``%distributed save|restore NAME...``
and ``--autosave NAME...``.

This module holds the format and the pure parts (names, paths, kinds, messages). Two halves
use it, as ``engine.py`` and ``pool.py`` do: ``checkpoint_engine`` (inside the ranks' engines,
answering plain dicts, never raising for a user's mistake) and ``checkpointer`` (the kernel
side: ``Checkpointer``, given an ``EnginePool``, checks every rank, saves from rank 0, since DDP
keeps the ranks identical, and restores into every rank, all or nothing; and the magic's part).

The format: one file per name, ``DIR/NAME.pt``, written by ``torch.save`` as a dict
``{"format": "gpuhub-checkpoint", "version": 1, "name", "kind", "type", "state", "saved",
"rank", "world_size"}``. ``state`` is the object's ``state_dict()`` for modules (a DDP model:
its ``.module``'s, so a checkpoint fits a wrapped or unwrapped model alike), optimizers and LR
schedulers, else the tensor or value itself. Durable: each file is written to a temporary file
in the same directory (``.NAME.pt.HOST.PID.*.tmp``, mode 0600), flushed and fsynced, and only
when every name of the save is written are they renamed into place (``os.replace``) and the
directory fsynced; any failure removes every temporary file of that save.
"""

from __future__ import annotations

import errno
import os

FORMAT = "gpuhub-checkpoint"
VERSION = 1
SUFFIX = ".pt"
DEFAULT_DIR = "~/.local/share/gpuhub/checkpoints"
CHECK_TIMEOUT = 30.0  # asking each rank what its names are
SAVE_TIMEOUT = 3600.0  # writing or reading checkpoints: as long as a big model needs

# what each kind is called, and how it is restored
KINDS = {
    "ddp": "DDP module",
    "module": "module",
    "optimizer": "optimizer",
    "scheduler": "LR scheduler",
    "tensor": "tensor",
    "value": "value",
}
STATEFUL = ("ddp", "module", "optimizer", "scheduler")  # restored by load_state_dict in place


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


def os_error_message(what: str, err: int | None, strerror: str, directory: str, name: str | None) -> str:
    """A failed write or directory, said with what to do about it."""
    where = checkpoint_path(directory, name) if name else directory
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
        return "module"
    if isinstance(obj, torch.optim.Optimizer):
        return "optimizer"
    if isinstance(obj, (LRScheduler, ReduceLROnPlateau)):
        return "scheduler"
    if isinstance(obj, torch.Tensor):
        return "tensor"
    return "value"


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
    what = KINDS[kind] if kind != "ddp" else "module"
    rerun = f"re-run the cell that defines the {what} first, then restore"
    if target is _MISSING:
        return f"is not defined: {rerun}"
    have = kind_of(target)
    if kind in ("ddp", "module"):
        if have not in ("ddp", "module"):
            return f"is a {type_name(target)}, not a module: {rerun}"
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


class _Missing:
    def __repr__(self):
        return "<missing>"


_MISSING = _Missing()
