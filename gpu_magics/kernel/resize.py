"""A pool that shrinks in place: some ranks leave (their borrowed GPUs are taken back), the
others keep their processes and every variable, and the world group is re-formed at the new
size in the same processes (``engine.resize.join_world``). DDP models go on from their
replicated parameters; FSDP2 models are gathered before the departure and resharded onto the
survivors after it (``engine.reshard``). The decisions and the words are ``kernel.resizing``'s.
"""

from __future__ import annotations

import os
import time

from gpu_magics.common.ranks import RankSpec, make_rank_specs
from gpu_magics.kernel import resizing
from gpu_magics.launch.reaper import kill_trees


class ShrinkFailed(Exception):
    """The pool could not shrink in place; the message says why. ``stage`` says whether the
    departing ranks were already gone (then the pool cannot go on as it was)."""

    def __init__(self, message: str, stage: str):
        super().__init__(message)
        self.stage = stage


def shrink(pool, leaving: list[int], timeout: float = 60, planned: bool = True) -> resizing.Shrunk:
    """Shrink ``pool`` (an ``EnginePool`` that holds its engines here) by the ranks
    ``leaving``: still running (``planned``, a preemption's notice: sharded models are gathered
    first) or already gone. Raises :class:`ShrinkFailed` where it cannot; before the departure,
    the pool is left as it was."""
    from gpu_magics.engine.recovery import holders
    from gpu_magics.engine.resize import ddp_digests, join_world, world_check

    problem = resizing.shrink_problem(pool.specs, leaving, remote=pool._remote)
    if problem:
        raise ShrinkFailed(problem, "before")
    keep = [i for i, spec in enumerate(pool.specs) if spec.rank not in leaving]
    gone = [i for i in range(len(pool.specs)) if i not in keep]
    try:
        found = pool.client[pool.engine_ids[0]].apply_async(holders).get(timeout)
    except Exception as e:
        raise ShrinkFailed(f"rank 0 did not say what it holds ({e})", "before") from None
    sharded = resharder(pool, found.get("fsdp", []), timeout, planned)
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
        checked = pool.view.apply_async(world_check).get(timeout)
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
        checked=all(checked),
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
    def __init__(self, names: list[str], planned: bool):
        self.names, self.planned = names, planned

    def gather(self) -> None:
        return None

    def rebuild(self) -> dict:
        why = (
            "resharding FSDP2 models in place is not built yet"
            if self.planned
            else "its shards on the lost rank are gone"
        )
        return {
            "refused": {name: f"{why}: define it again, then %distributed restore it" for name in self.names}
        }


def resharder(pool, names: list[str], timeout: float, planned: bool = True):
    """What moves the FSDP2 models ``names`` from the old world to the new one."""
    return _NoSharded(names, planned)


class GrowFailed(ShrinkFailed):
    """The pool could not grow in place (``stage``: "before", the pool is as it was; "after",
    the old ranks had left their group and the pool cannot go on)."""


def grow(pool, new_slots: list, report_id: int = 0, timeout: float = 120) -> resizing.Grown:
    """Grow ``pool`` by one rank on each of ``new_slots`` without restarting its ranks: new
    engines start, every rank joins a new world of the new size, and the new ranks get a copy
    of rank 0's names (``engine.resize.snapshot``)."""
    from gpu_magics.engine.rank import setup_rank
    from gpu_magics.engine.resize import adopt, ddp_digests, join_world, snapshot, world_check

    problem = resizing.grow_problem(pool.broken, pool._remote, len(new_slots))
    if problem:
        raise GrowFailed(problem, "before")
    old_ids, old_n = list(pool.engine_ids), pool.size
    before = set(pool.client.ids)
    try:
        pool.launcher.launch(pool.cluster, len(new_slots))
        deadline = time.monotonic() + timeout
        while len(set(pool.client.ids) - before) < len(new_slots):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the new engines did not start in {timeout:.0f} s")
            time.sleep(0.1)
    except Exception as e:
        new = sorted(set(pool.client.ids) - before)
        if new:
            pool._ask_engines_to_shut_down(new)
        raise GrowFailed(f"the new engines did not start ({e})", "before") from None
    new_ids = sorted(set(pool.client.ids) - before)[: len(new_slots)]
    specs = resizing.extended_specs(pool.specs, new_slots)
    envs = [spec.env() for spec in specs]
    if report_id:
        envs[old_n:] = [dict(env, GPUHUB_REPORT_ALLOCATION=str(report_id)) for env in envs[old_n:]]
    pool.engine_ids = old_ids + new_ids
    try:
        envs, rendezvous = pool._open_rendezvous(envs, timeout)
        old_rendezvous = pool.rendezvous if pool.rendezvous is not rendezvous else {}
        kernel_pid = os.getpid()
        calls = [
            pool.client[eid].apply_async(join_world, rendezvous, env, pool.timeout_s, True)
            for eid, env in zip(old_ids, envs[:old_n], strict=True)
        ] + [
            pool.client[eid].apply_async(
                setup_rank, env, pool.backend, pool.timeout_s, kernel_pid, rendezvous
            )
            for eid, env in zip(new_ids, envs[old_n:], strict=True)
        ]
        pool.client.wait(calls, timeout=timeout)
        answers = [ar.get(0) for ar in calls]
    except Exception as e:
        pool.broken = True
        raise GrowFailed(
            f"the ranks could not form the new group ({type(e).__name__}: {e})", "after"
        ) from None
    joined, setups = answers[:old_n], answers[old_n:]
    pool.infos = [dict(info, rank=i) for i, info in enumerate(pool.infos)] + setups
    pool.specs, pool.n = specs, len(specs)
    pool.view = pool.client[pool.engine_ids]
    pool._start_reaper([pool.controller_pid, *pool.pids, *pool.launcher.local_pids])
    if old_rendezvous:
        pool._remove_rendezvous(old_rendezvous)
    try:
        checked = pool.view.apply_async(world_check).get(timeout)
        copy = pool.client[old_ids[0]].apply_async(snapshot).get(timeout)
        adopted = [pool.client[eid].apply_async(adopt, copy).get(timeout) for eid in new_ids]
        digests = pool.view.apply_async(ddp_digests, joined[0]["ddp"]).get(timeout)
    except Exception as e:
        raise GrowFailed(
            f"the new ranks could not take a copy of rank 0's names ({type(e).__name__}: {e}); "
            "they run, without them",
            "copy",
        ) from None
    return resizing.Grown(
        old_size=old_n,
        new=[(spec.rank, spec.slot.label) for spec in specs[old_n:]],
        pids=pool.pids,
        checked=all(checked),
        copied=copy["copied"] + sorted(copy["modules"]),
        failed=copy["failed"],
        ddp=joined[0]["ddp"],
        ddp_equal=all(d == digests[0] for d in digests),
        adopted_everywhere=all(sorted(a) == sorted(adopted[0]) for a in adopted),
        lost_groups=joined[0]["lost_groups"],
        lost_meshes=joined[0]["lost_meshes"],
    )
