"""``gpuhub gpus``: every GPU of the ledger's inventory, its holder, since when and for what."""

from __future__ import annotations

from gpu_magics.common import words
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import format_table, iso, print_json
from spawner.cli.parsers import command


def register(sub) -> None:
    command(
        sub, "gpus", run, json_output=True, help="every GPU: node, index, model, holder, since when, for what"
    )


def gpu_json(st) -> dict:
    """One row of ``gpuhub gpus --json``: a GPU and its holder (or ``null``)."""
    h = st.holder
    holder = None
    if h is not None:
        holder = {
            "user": h.user,
            "allocation_id": h.id,
            "purpose": h.purpose,
            "server_name": h.server_name,
            "since": iso(h.started or h.created),
        }
    g = st.gpu
    return {"node": g.node, "index": g.index, "model": g.model, "present": st.present, "holder": holder}


def run(args, out) -> int:
    ledger = open_ledger(load_settings(args))
    table = ledger.gpu_table()
    if args.json:
        return print_json([gpu_json(st) for st in table], out)
    rows = []
    for st in table:
        h = st.holder
        rows.append(
            (
                st.gpu.node,
                st.gpu.index,
                st.gpu.model,
                "" if st.present else "gone",
                h.user if h else "free",
                words.stamp(h.started or h.created) if h else "",
                f"{h.purpose} {h.server_name}".strip() + f" (#{h.id})" if h else "",
            )
        )
    print(format_table(("NODE", "GPU", "MODEL", "", "HOLDER", "SINCE", "FOR"), rows), file=out)
    return 0
