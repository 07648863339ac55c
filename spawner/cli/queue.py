"""``gpuhub queue``: the waiting requests, as the GPU admin page shows them; cancel, front."""

from __future__ import annotations

from gpu_magics.common import words
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import UsageError, format_table, print_json
from spawner.cli.parsers import actions, command
from spawner.policy import values
from spawner.policy.values import minutes_in_words


def register(sub) -> None:
    queue = actions(sub, "queue", "requests waiting for GPUs")
    command(
        queue,
        "show",
        run,
        json_output=True,
        help="the queue in its order, with places and fair-share factors",
    )
    for action, text in (
        ("cancel", "end a waiting request"),
        ("front", "move a request ahead of every other"),
    ):
        command(queue, action, run, help=text).add_argument(
            "entry",
            type=values.argparse_type(values.parse_count, "ENTRY", lo=1, hi=10**18),
            help="the entry's id",
        )


def run(args, out) -> int:
    ledger = open_ledger(load_settings(args))
    if args.action == "show":
        from spawner.ledger import utcnow

        now = utcnow()
        entries = ledger.queue()
        if args.json:
            from spawner.broker.responses import queue_json

            return print_json([queue_json(q, now) for q in entries], out)
        rows = []
        for q in entries:
            f = q.factors
            expected = "" if q.expected is None else f"{words.stamp(q.expected)} ({q.sure})"
            rows.append(
                (
                    q.position,
                    q.id,
                    q.user + (" *front" if q.front else ""),
                    (f"1/{q.slice_parts}" if q.slice_parts else f"{q.gpu_count}")
                    + (f" {q.model}" if q.model else ""),
                    q.purpose + (f" {q.server_name}" if q.server_name else ""),
                    minutes_in_words((now - q.created).total_seconds()),
                    expected,
                    "" if f is None else f"{f.priority:.0f}",
                    "" if f is None else f"{f.fairshare:.3f}",
                    "" if f is None else f"{f.age:.3f}",
                )
            )
        if not rows:
            print("nobody waits for GPUs", file=out)
            return 0
        head = ("#", "ID", "USER", "GPUS", "FOR", "WAITED", "EXPECTED", "PRIORITY", "FAIRSHARE", "AGE")
        print(format_table(head, rows), file=out)
        return 0
    entry = ledger.queue_entry(args.entry)
    if entry is None or entry.state != "waiting":
        why = "does not exist" if entry is None else f"no longer waits ({entry.end_reason})"
        raise UsageError(f"queue entry {args.entry} {why}")
    if args.action == "cancel":
        ledger.leave_queue(args.entry, "cancelled by an admin (gpuhub queue cancel)")
        print(
            f"cancelled queue entry {args.entry} ({entry.user}, "
            + (entry.amount if entry.slice_parts else words.count(entry.gpu_count, "GPU"))
            + ")",
            file=out,
        )
        return 0
    ledger.move_to_front(args.entry)
    print(f"queue entry {args.entry} ({entry.user}) goes ahead of every other", file=out)
    return 0
