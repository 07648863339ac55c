"""Models and optimizers through ``torch.distributed.checkpoint`` (DCP), inside each rank's
engine (the format: ``common/checkpoint.py``; the orchestration: ``engine/checkpoints.py``).

Every rank calls these together (``dcp.save`` and ``dcp.load`` are collectives over the default
process group; without one, ``no_dist``). A model's state is ``get_model_state_dict`` (the
parameters' names without DDP's ``module.`` prefix; an FSDP2 module's ``DTensor`` shards), an
optimizer's ``get_optimizer_state_dict(model, opt)`` (keyed by those names), so a checkpoint
fits a plain, DDP or FSDP2 model of any world size: ``dcp.load`` reshards into the state dict
of the model as it is here."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os

from gpu_magics.common.checkpoint import MODULES, kind_of

AT_FDCWD = -100
RENAME_EXCHANGE = 2


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def param_ids(obj) -> list[int]:
    """The ids of a module's parameters, or of an optimizer's (to find an optimizer's model)."""
    if kind_of(obj) in MODULES:
        return [id(p) for p in obj.parameters()]
    return [id(p) for g in obj.param_groups for p in g["params"]]


def model_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model)


def optimizer_state(model, opt) -> dict:
    """``get_optimizer_state_dict``: an optimizer without state yet gets it first (torch's
    own zero-lr step), so that ``dcp.load`` has tensors to load into."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt)


def save(state: dict, path: str, solo: bool = False) -> None:
    """Every rank writes its shards of ``state`` into the DCP directory ``path`` (files fsynced;
    a replicated tensor, as DDP's, is written once, by the lowest rank that holds it).
    ``solo``: this process alone, whatever its process group (a state it holds whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

    os.makedirs(path, mode=0o700, exist_ok=True)
    with _quiet():
        dcp.save(
            state,
            storage_writer=FileSystemWriter(path, sync_files=True),
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
            no_dist=solo or not distributed(),
        )


def load(state: dict, path: str) -> None:
    """``dcp.load`` into ``state`` in place (resharded to this pool's world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    with _quiet():
        dcp.load(state, storage_reader=FileSystemReader(path), no_dist=not distributed())


@contextlib.contextmanager
def _quiet():
    """DCP's warning that a process without a process group saves alone: that is the intent."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def saved_keys(path: str) -> dict[str, tuple | None]:
    """The keys of a DCP checkpoint, each with its tensor's global shape (None: not a tensor)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(path).read_metadata()
    return {
        k: (tuple(v.size) if isinstance(v, TensorStorageMetadata) else None)
        for k, v in meta.state_dict_metadata.items()
    }


def shapes(state: dict) -> dict[str, tuple | None]:
    """A model state dict's keys with each tensor's global shape (a DTensor's full shape)."""
    import torch

    return {k: (tuple(v.shape) if isinstance(v, torch.Tensor) else None) for k, v in state.items()}


def restore_model(model, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    state = model_state(model)
    load(state, path)
    set_model_state_dict(model, state)


def restore_optimizer(model, opt, path: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = optimizer_state(model, opt)
    load(state, path)
    set_optimizer_state_dict(model, opt, state)


def restore_full_model(model, state: dict) -> None:
    """A full (unsharded) state dict, as version 1 files hold, into a model of any wrapping:
    each rank keeps its shard of it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def first_os_error(e: BaseException) -> OSError | None:
    """The OSError under a failed ``dcp.save`` (DCP wraps each rank's in a CheckpointException,
    whose ``failures`` map ranks to their exceptions), or None."""
    seen = set()
    todo = [e]
    while todo:
        x = todo.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            return x
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            for v in failures.values():
                todo.append(v[0] if isinstance(v, tuple) else v)
        todo += [x.__cause__, x.__context__]
    return None


def describe(e: BaseException, limit: int = 300) -> str:
    """One line for a failed DCP call: each failed rank's exception, never its traceback."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = []
        for rank, v in sorted(failures.items()):
            x = v[0] if isinstance(v, tuple) else v
            parts.append(f"rank {rank}: {type(x).__name__}: {' '.join(str(x).split())}")
        text = "; ".join(parts)
    else:
        text = f"{type(e).__name__}: {' '.join(str(e).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def everyone_here(key: str, world: int, timeout: float) -> bool:
    """Whether every rank of the process group reached this point within ``timeout`` s (a
    counter in the group's store: no collective, so a rank that never comes costs only the
    wait). False without a process group."""
    import time

    if world <= 1:
        return True
    try:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store.add(key, 1)
        deadline = time.monotonic() + timeout
        while store.add(key, 0) < world:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True
    except Exception:
        return False


def exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (``renameat2(RENAME_EXCHANGE)``); False where this
    system or file system cannot (the caller renames instead)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """The directory entries of a written DCP directory (DCP fsyncs its files, not the
    directory that names them)."""
    for root, dirs, _ in os.walk(path, topdown=False):
        for d in dirs:
            fsync_dir(os.path.join(root, d))
    fsync_dir(path)
