"""``gpuhub usage``: GPU-hours per user over a period (``--since``, ``--until``, ``--user``);
``--energy``: the energy too (kWh at the GPUs, idle share, kWh at the meter, cost, CO2e, GPU-hours
not measured), from gpuhub's own readings, kept per UTC day (a period counts whole days)."""

from __future__ import annotations

from datetime import datetime

from gpu_magics.common import words
from spawner.broker.energy_views import costing_json
from spawner.cli.context import load_settings, open_ledger
from spawner.cli.output import UsageError, format_table, iso, parse_name, print_json
from spawner.cli.parsers import command
from spawner.policy import values
from spawner.policy.energy import Energy, figures


def register(sub) -> None:
    usage = command(sub, "usage", run, json_output=True, help="GPU-hours per user")
    usage.add_argument("--since", default="30d", help="start: a date or a span such as 7d (default 30d)")
    usage.add_argument("--until", help="end (default: now)")
    usage.add_argument("--user")
    usage.add_argument(
        "--energy", action="store_true", help="energy and cost too (c.GpuHub.pue, energy_price, ...)"
    )


def parse_when(text: str, now: datetime, field: str = "the date") -> datetime:
    """``2026-11-01``, ``2026-11-01T12:00`` or a span back from now: ``7d``, ``12h``."""
    try:
        return values.parse_timestamp(text, field, now)
    except values.BadValue as e:
        raise UsageError(str(e)) from None


def run(args, out) -> int:
    settings = load_settings(args)
    ledger = open_ledger(settings)
    from spawner.ledger import utcnow

    now = utcnow()
    since = parse_when(args.since, now, "--since")
    until = parse_when(args.until, now, "--until") if args.until else now
    if until <= since:
        raise UsageError("--until must be after --since")
    user = parse_name(args.user, "--user") if args.user is not None else None
    hours = ledger.usage(since, until, user=user)
    if args.energy:
        try:
            costing = settings.costing()
        except ValueError as e:
            raise UsageError(str(e)) from None
        energy = ledger.energy_totals(since, until, user=user)
        return show_energy(args, out, since, until, hours, energy, costing)
    if args.json:
        per_user = {u: round(h, 4) for u, h in sorted(hours.items())}
        return print_json({"since": iso(since), "until": iso(until), "gpu_hours": per_user}, out)
    rows = [(u, f"{h:.2f}") for u, h in sorted(hours.items())]
    print(f"GPU-hours from {words.stamp(since)} to {words.stamp(until)}", file=out)
    print(format_table(("USER", "GPU-HOURS"), rows), file=out)
    return 0


def show_energy(args, out, since, until, hours, energy, costing) -> int:
    users = sorted(set(hours) | set(energy))
    per_user = {u: figures(energy.get(u, Energy()), costing) for u in users}
    if args.json:
        doc = {
            "since": iso(since),
            "until": iso(until),
            "gpu_hours": {u: round(hours.get(u, 0.0), 4) for u in users},
            "energy": per_user,
            "costing": costing_json(costing),
        }
        return print_json(doc, out)
    head = ["USER", "GPU-HOURS", "KWH", "IDLE", "METER KWH"]
    if costing.currency:
        head.append(f"COST {costing.currency}")
    if costing.carbon_g_per_kwh is not None:
        head.append("KG CO2E")
    head.append("NOT MEASURED")
    rows = []
    for u in users:
        f = per_user[u]
        row = [u, f"{hours.get(u, 0.0):.2f}", f"{f['gpu_kwh']:.3f}"]
        row.append("-" if f["idle_share"] is None else f"{f['idle_share'] * 100:.0f} %")
        row.append(f"{f['meter_kwh']:.3f}")
        if costing.currency:
            row.append(f"{f['cost']:.2f}")
        if costing.carbon_g_per_kwh is not None:
            row.append(f"{f['co2e_kg']:.3f}")
        row.append(f"{f['unknown_gpu_hours']:.2f} GPU-h")
        rows.append(tuple(row))
    print(
        f"GPU-hours and energy from {words.stamp(since)} to {words.stamp(until)} "
        f"(energy per whole UTC day; PUE {costing.pue:g})",
        file=out,
    )
    print(format_table(tuple(head), rows), file=out)
    return 0
