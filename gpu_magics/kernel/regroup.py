"""After a failed or interrupted cell, what happens to the pool's process groups: pure
decisions on what the ranks report (``engine.recovery.group_state``, ``recover``, ``holders``),
and the cell's words for them. No I/O.

- ``keep_groups``: every group goes on untouched where each of its members has run as many
  collectives on it as every other, and no rank was freed from one.
- ``plan``: otherwise every gpuhub group is reconnected in place, by all its members; a group
  that not every member still has, or that was made with another backend (gpuhub cannot
  reconnect a plain gloo or NCCL group), is named as lost instead.
- ``report``: one short block that names only what each member checked with a collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpu_magics.common.words import count

WORLD = "0"  # c10d's name for the default (world) group


def keep_groups(states: list[dict]) -> bool:
    if not states or not all(st["initialized"] and not st["freed"] for st in states):
        return False
    seqs: dict[str, set[int]] = {}
    for st in states:
        for name, g in st["groups"].items():
            seqs.setdefault(name, set()).add(g["seq"])
    return all(len(s) == 1 and -1 not in s for s in seqs.values())


@dataclass
class Plan:
    names: list[list[str]]  # per rank (the order of ``states``): the groups it reconnects
    lost: dict[str, str] = field(default_factory=dict)  # group -> why it cannot be reconnected
    ranks: dict[str, list[int]] = field(default_factory=dict)  # group -> its members

    @property
    def broken(self) -> bool:
        """Without the world group, nothing goes on."""
        return WORLD in self.lost


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


def plan(states: list[dict]) -> Plan:
    """``states[i]`` is rank ``i``'s ``group_state``."""
    seen: dict[str, dict] = {}
    have: dict[str, set[int]] = {}
    for rank, st in enumerate(states):
        for name, g in st["groups"].items():
            seen.setdefault(name, g)
            have.setdefault(name, set()).add(rank)
            if not g["reconfigurable"]:
                seen[name] = g
    result = Plan(names=[[] for _ in states])
    for name, g in seen.items():
        members = list(g["ranks"])
        result.ranks[name] = members
        missing = sorted(set(members) - have[name])
        if not g["reconfigurable"]:
            result.lost[name] = (
                f"made with backend '{g['backend']}', which gpuhub cannot reconnect: make it again "
                f"with dist.new_group(ranks={members}) (gpuhub's backend) and rebuild what uses it"
            )
        elif missing:
            result.lost[name] = (
                f"{_ranks_text(missing)} no longer {'has' if len(missing) == 1 else 'have'} it (a cell "
                f"failed there before making it): make it again with dist.new_group(ranks={members})"
            )
        else:
            for rank in members:
                if rank < len(states):
                    result.names[rank].append(name)
    return result


def reset_notes(resets: list[dict]) -> list[str]:
    """What could not be made ready for a new step (``recovery.reset_holders`` of each rank)."""
    failed = sorted({f for r in resets for f in r.get("failed", [])})
    return (
        ["Could not be made ready for the next step (rebuild them): " + "; ".join(failed) + "."]
        if failed
        else []
    )


def diverged(digests: list[dict]) -> list[str]:
    """The DDP modules (by name, held on every rank) whose replicas differ between ranks
    (``recovery.ddp_digests`` of each rank)."""
    if not digests:
        return []
    common = set.intersection(*(set(d) for d in digests))
    return sorted(name for name in common if len({tuple(d[name]) for d in digests}) > 1)


def resync_note(synced: dict | None) -> list[str]:
    """The cell's words for replicas (and their optimizers) made equal again after the ranks
    stopped apart (``recovery.sync_ddp`` of rank 0)."""
    if not synced or not synced.get("modules"):
        return []
    optimizers = synced.get("optimizers") or []
    also = f", and the state of their optimizers: {', '.join(optimizers)}" if optimizers else ""
    return [
        "The ranks had stopped at different points of a step; made equal to rank 0's on every "
        f"rank (parameters and buffers): {', '.join(synced['modules'])}{also}."
    ]


def group_label(name: str, ranks: list[int], bound: dict[str, list[str]]) -> str:
    if name == WORLD:
        return f"the world group ({count(len(ranks), 'rank')})"
    names = bound.get(name)
    where = _ranks_text(ranks)
    return f"{', '.join(names)} ({where})" if names else f"group {name} ({where})"


def checked_groups(the_plan: Plan, results: list[dict]) -> tuple[list[str], dict[str, str]]:
    """The groups every member reconnected and checked with a collective, and what went wrong
    with each of the others (first member's words)."""
    good, bad = [], {}
    for name in sorted({n for names in the_plan.names for n in names}, key=_order):
        problem = ""
        for rank in the_plan.ranks[name]:
            r = results[rank] if rank < len(results) else None
            if r is None:
                problem = f"rank {rank} did not answer"
            elif name in r["failed"]:
                problem = f"rank {rank}: {r['failed'][name]}"
            elif r["checked"].get(name, "not checked") != "":
                problem = f"rank {rank}: {r['checked'].get(name, 'not checked')}"
            if problem:
                break
        if problem:
            bad[name] = problem
        else:
            good.append(name)
    return good, bad


def _order(name: str) -> tuple:
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def report(the_plan: Plan, results: list[dict], found: dict) -> tuple[list[str], bool]:
    """The cell's notes after a reconnection, and whether the pool can go on (the world group
    answered on every rank). ``found`` is rank 0's ``holders``."""
    bound = found.get("group", {})
    good, bad = checked_groups(the_plan, results)
    label = {n: group_label(n, the_plan.ranks[n], bound) for n in the_plan.ranks}
    notes = []
    if good:
        notes.append(
            "The process groups were reconnected in place (a fresh rendezvous), and each answered "
            "a collective on every member: " + "; ".join(label[n] for n in good) + "."
        )
    kept = [f"{n} (FSDP2)" for n in found.get("fsdp", [])] + [f"{n} (DDP)" for n in found.get("ddp", [])]
    kept += [f"{n} (DeviceMesh)" for n in found.get("mesh", [])]
    if (
        kept
        and WORLD in good
        and not bad
        and not the_plan.lost
        and not any(r and r.get("reset", {}).get("failed") for r in results)
    ):
        notes.append("They hold the same group objects as before, so these go on: " + ", ".join(kept) + ".")
    synced = results[0]["synced"] if results and results[0] else []
    if synced:
        notes.append(
            "Made equal to rank 0's on every rank (parameters and buffers): " + ", ".join(synced) + "."
        )
    notes += reset_notes([r.get("reset", {}) for r in results if r])
    for name, why in the_plan.lost.items():
        notes.append(f"Not reconnected: {label[name]}, {why}.")
    for name, why in bad.items():
        notes.append(f"Not working after the reconnection: {label[name]} ({why}).")
    ok = WORLD in good
    if not ok:
        notes.append("The world group did not answer on every rank; the next cell starts fresh engines.")
    return notes, ok
