"""``gpuhub gpus``: every GPU of the ledger's inventory, its holder, since when and for what; a
GPU held in slices (``c.GpuHub.gpu_slices``) with a row per slice held."""

from __future__ import annotations

from gpu_magics.common import words
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import format_table, iso, print_json
from spawner.cli.parsers import command


def register(sub) -> None:
    command(
        sub, "gpus", run, json_output=True, help="every GPU: node, index, model, holder, since when, for what"
    )


def holder_json(h) -> dict | None:
    if h is None:
        return None
    return {
        "user": h.user,
        "allocation_id": h.id,
        "purpose": h.purpose,
        "server_name": h.server_name,
        "since": iso(h.started or h.created),
    }


def gpu_json(st) -> dict:
    """One row of ``gpuhub gpus --json``: a GPU and its holder (or ``null``), and the slices
    held of it with theirs."""
    g = st.gpu
    slices = [
        {
            "part": s.part,
            "parts": s.parts,
            "label": s.label,
            "memory_mib": s.memory_mib,
            "holder": holder_json(h),
        }
        for s, h in st.slices
    ]
    return {
        "node": g.node,
        "index": g.index,
        "model": g.model,
        "present": st.present,
        "holder": holder_json(st.holder),
        "slices": slices,
    }


def _held(h) -> tuple[str, str, str]:
    return h.user, words.stamp(h.started or h.created), f"{h.purpose} {h.server_name}".strip() + f" (#{h.id})"


def run(args, out) -> int:
    ledger = open_ledger(load_settings(args))
    table = ledger.gpu_table()
    if args.json:
        return print_json([gpu_json(st) for st in table], out)
    rows = []
    for st in table:
        g, h, gone = st.gpu, st.holder, "" if st.present else "gone"
        if st.slices:
            parts = st.slices[0][0].parts
            rows.append((g.node, g.index, g.model, gone, f"{len(st.slices)} of {parts} slices held", "", ""))
            rows += [
                (g.node, s.label.rpartition(":")[2], f"1/{s.parts}", "", *_held(sh)) for s, sh in st.slices
            ]
            continue
        rows.append((g.node, g.index, g.model, gone, *(_held(h) if h else ("free", "", ""))))
    print(format_table(("NODE", "GPU", "MODEL", "", "HOLDER", "SINCE", "FOR"), rows), file=out)
    return 0
