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

    # a lost rank of a pool on other machines (Slurm) is gone already; a planned departure
    # there is Slurm's (it preempts whole jobs)
    problem = resizing.shrink_problem(pool.specs, leaving, remote=pool._remote and planned)
    if problem:
        raise ShrinkFailed(problem, "before")
    keep = [i for i, spec in enumerate(pool.specs) if spec.rank not in leaving]
    gone = [i for i in range(len(pool.specs)) if i not in keep]
    dead = pool.ended_for_sure()
    ended = sorted(pool.specs[i].rank for i in keep if i in dead)
    if ended:  # nothing to ask them: the pool cannot go on in place
        which = "the engine of " if len(ended) == 1 else "the engines of "
        has = "has" if len(ended) == 1 else "have"
        raise ShrinkFailed(f"{which}{resizing.ranks_text(ended)}, which would stay, {has} ended", "before")
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
    if pool._remote:
        pool.kill([pool.specs[i].rank for i in gone])  # through Slurm on other nodes, by pid here
    else:
        kill_trees(leaving_pids, grace=3.0)
    old_rendezvous = pool.rendezvous
    survivors = [pool.specs[i] for i in keep]
    new_specs = renumbered(survivors)
    pool.engine_ids = [pool.engine_ids[i] for i in keep]
    pool.infos = [dict(pool.infos[i], rank=new.rank) for i, new in zip(keep, new_specs, strict=True)]
    pool.specs = new_specs
    pool.n = len(new_specs)
    pool.view = pool.client[pool.engine_ids]
    pool._start_reaper([pool.controller_pid, *([] if pool._remote else pool.pids), *pool.launcher.local_pids])
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
        lost_meshes=[m for m in joined[0]["lost_meshes"] if m not in sharded.skip()],
    )


def renumbered(survivors: list[RankSpec]) -> list[RankSpec]:
    """The survivors' torchrun variables at the new size: ranks in the old order, from 0."""
    first = survivors[0]
    specs = make_rank_specs([s.slot for s in survivors], first.master_addr, first.master_port, first.run_id)
    return specs


class Sharded:
    """The FSDP2 models of a pool moved to its new size (``engine.reshard``): gathered to rank 0
    on the old world, rebuilt and resharded on the new one, then dropped. ``planned``: the
    departing ranks are still there to give their shards; else nothing can be gathered, and
    each sharded model is named with what to do."""

    def __init__(self, pool, names: list[str], timeout: float, planned: bool):
        self.pool, self.names, self.timeout, self.planned = pool, names, timeout, planned
        self.gathered: dict = {}

    def gather(self) -> None:
        from gpu_magics.engine import reshard

        if not self.names or not self.planned:
            return
        answers = self.pool.view.apply_async(reshard.gather).get(self.timeout)
        failed = {k: v for a in answers for k, v in a.get("failed", {}).items()}
        if failed:
            raise RuntimeError("; ".join(f"{k}: {v}" for k, v in sorted(failed.items())))
        self.gathered = answers[0]

    def skeleton(self) -> bytes | None:
        """Rank 0's models and optimizers for the ranks a pool grows by (after ``gather``)."""
        from gpu_magics.engine import reshard

        if not self.gathered.get("models"):
            return None
        return self.pool.client[self.pool.engine_ids[0]].apply_async(reshard.skeleton).get(self.timeout)

    def skip(self) -> list[str]:
        """The names the models' move takes care of (the models, their optimizers, their parts)."""
        g = self.gathered
        return sorted({*g.get("models", {}), *g.get("optimizers", {}), *g.get("inside", {})})

    def rebuild(self) -> dict:
        from gpu_magics.engine import reshard

        if not self.names:
            return {}
        if not self.planned:
            why = "its shards on the lost rank are gone: define it again, then %distributed restore it"
            return {"refused": {name: why for name in self.names}}
        g = self.gathered
        refused = dict(g.get("refused", {}))
        if not g.get("models"):
            return {"refused": refused}
        from gpu_magics.engine.resize import check_resharded

        try:
            answers = self.pool.view.apply_async(reshard.rebuild).get(self.timeout)
            first = answers[0]
            failed = {k: v for a in answers for k, v in a.get("failed", {}).items()}
            owned = {
                name: sorted(o for o, m in first.get("optimizers", {}).items() if m == name)
                for name in first.get("models", {})
                if name not in failed
            }
            checks = self.pool.view.apply_async(check_resharded, owned).get(self.timeout)
        finally:
            self.pool.view.apply_async(reshard.drop).get(self.timeout)
        models = {}
        for name, optimizers in owned.items():
            differs = next((c[name] for c in checks if c.get(name)), "")
            if not differs:
                models[name] = {"optimizers": optimizers}
            else:
                failed[name] = f"its state after the move differs from the state before it at {differs}"
        for name, why in failed.items():
            refused[name] = f"could not be resharded ({why})"
        for name in first.get("not_rebuilt", []):
            refused.setdefault(name, "not resharded: a model before it failed")
        return {"models": models, "refused": refused, "meshes": [], "notes": first.get("notes", [])}


def resharder(pool, names: list[str], timeout: float, planned: bool = True) -> Sharded:
    """What moves the FSDP2 models ``names`` from the old world to the new one."""
    return Sharded(pool, names, timeout, planned)


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
    from gpu_magics.engine import reshard
    from gpu_magics.engine.recovery import holders

    old_ids, old_n = list(pool.engine_ids), pool.size
    found = pool.client[old_ids[0]].apply_async(holders).get(timeout)
    sharded = resharder(pool, found.get("fsdp", []), timeout)
    try:
        sharded.gather()  # the old world: the sharded models' full state to rank 0
        blob = sharded.skeleton()
    except Exception as e:
        raise GrowFailed(f"the sharded models could not be gathered ({e})", "before") from None
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
    pool._start_reaper([pool.controller_pid, *([] if pool._remote else pool.pids), *pool.launcher.local_pids])
    if old_rendezvous:
        pool._remove_rendezvous(old_rendezvous)
    try:
        checked = pool.view.apply_async(world_check).get(timeout)
        if blob is not None:
            for eid in new_ids:
                pool.client[eid].apply_async(reshard.adopt, blob).get(timeout)
        resharded = sharded.rebuild()
        copy = pool.client[old_ids[0]].apply_async(snapshot, sharded.skip()).get(timeout)
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
        resharded=resharded,
        lost_groups=joined[0]["lost_groups"],
        lost_meshes=[m for m in joined[0]["lost_meshes"] if m not in sharded.skip()],
    )
