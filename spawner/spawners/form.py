"""The spawn form and the ``user_options`` it produces, as pure functions.

``user_options`` for a GPU server (from the form, or the REST API's ``user_options``):

    {"gpus": 2, "gpu_model": "A100"}    # gpu_model optional; "" or absent means any
    {"gpus": 2, "partition": "gpu"}     # Slurm backend only: one of the cluster's partitions
    {"gpus": 1, "hours": 2}             # hours optional: less than the user's longest session
    {"gpu_share": "1/4"}                # one slice of a GPU, where c.GpuHub.gpu_slices offers it
                                        # (gpus 1 or absent; gpu_model where several are split)

The form sends strings; the REST API may send numbers. ``parse_gpu_options`` accepts
both and refuses anything else with a message that says what it takes: the server never
trusts the form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from html import escape
from typing import Any

from gpu_magics.common import words
from spawner.policy import timelimits, values
from spawner.policy.limits import MAX_COUNT, Refusal, describe_limit
from spawner.policy.records import Allowance
from spawner.policy.slices import units_text

OPTION_KEYS = ("gpus", "gpu_model", "hours", "gpu_share")
USAGE = (
    'gpuhub servers take "gpus" (a whole number, 0 for none) and optionally "gpu_model", '
    '"hours" (how long the session may run, up to your longest) and "gpu_share" (one slice of '
    'a GPU, e.g. "1/4", where GPUs are split).'
)


@dataclass(frozen=True)
class SliceChoice:
    """The slices the form offers: each model's offer with its free and total slices
    (``Ledger.slice_room``), and whether this user takes slices only (``c.GpuHub.slice_groups``)."""

    room: Mapping[str, tuple[Any, int, int]]
    only: bool = False
    shards: bool = False  # Slurm's gres/shard: nothing divides the GPU's memory or compute


@dataclass(frozen=True)
class GpuOptions:
    count: int
    model: str | None = None
    partition: str | None = None
    hours: float | None = None  # how long it may run (None: the user's longest session)
    share: str | None = None  # one slice of a GPU, as asked ("1/4"): resolved against the offers


def _single(value: Any) -> Any:
    """Form data arrives as lists of strings; one value is what a field means."""
    if isinstance(value, list | tuple):
        if len(value) != 1:
            raise Refusal(f"Give one value per option; got {len(value)}. {USAGE}", reason="bad_request")
        return value[0]
    return value


def parse_count(raw: Any) -> int:
    raw = _single(raw)
    try:
        return values.parse_count(raw, "The GPU count", lo=0, hi=MAX_COUNT)
    except values.BadValue as e:
        raise Refusal(f"{e} {USAGE}", reason="bad_request") from None


def _label(raw: Any, field: str) -> str | None:
    raw = _single(raw)
    if raw is None or raw == "":
        return None
    try:
        return values.parse_label(raw, field)
    except values.BadValue as e:
        raise Refusal(f"{e} {USAGE}", reason="bad_request") from None


def parse_gpu_options(
    user_options: Mapping[str, Any] | None,
    *,
    default_gpus: int,
    partitions: Sequence[str] | None = None,
) -> GpuOptions:
    """Check the shape of ``user_options``; whether the model exists is the policy's call.

    ``partitions``: the Slurm partitions a user may pick (None: the backend has none, and
    a ``partition`` option is refused like any unknown one).
    """
    options = dict(user_options or {})
    allowed = OPTION_KEYS if partitions is None else (*OPTION_KEYS, "partition")
    unknown = sorted(str(k) for k in options if k not in allowed)
    if unknown:
        shown = ", ".join(map(values.show, unknown[:5]))
        raise Refusal(
            f"Unknown option{'s' if len(unknown) > 1 else ''} {shown}. {USAGE}",
            reason="bad_request",
        )
    count = parse_count(options["gpus"]) if "gpus" in options else default_gpus
    model = _label(options.get("gpu_model"), "gpu_model")
    partition = _label(options.get("partition"), "partition")
    if partition is not None and (partitions is None or partition not in partitions):
        raise Refusal(
            f"There is no partition {values.show(partition)} to choose here. Partitions: "
            f"{', '.join(partitions or []) or 'none'}; or leave it empty for the default.",
            reason="bad_request",
        )
    try:
        hours = timelimits.parse_asked_hours(_single(options.get("hours")), "hours")
    except values.BadValue as e:
        raise Refusal(f"{e} {USAGE}", reason="bad_request") from None
    share = _label(options.get("gpu_share"), "gpu_share")
    if share is not None and share.strip() == "0":  # the form's "no GPU" among slices
        share, count = None, 0
    elif share is not None and count != 1:
        raise Refusal(
            f"gpu_share {values.show(share)} is one slice of one GPU, but gpus is {count}: ask for "
            "gpus 1 (or leave it out) with a share, or for whole GPUs without one.",
            reason="bad_request",
        )
    return GpuOptions(count=count, model=model, partition=partition, hours=hours, share=share)


def options_from_form(formdata: Mapping[str, list[str]]) -> dict[str, Any]:
    """Form fields to ``user_options``: one value each; fields starting with ``_`` (XSRF) dropped."""
    return {k: (v[0] if len(v) == 1 else v) for k, v in formdata.items() if not k.startswith("_")}


def _is_are(n: int) -> str:
    return "is" if n == 1 else "are"


def _allowance_text(a: Allowance) -> str:
    """What the user holds, what the limit still lets them hold, and what is free for them now:
    two facts (the limit's room, the free GPUs) said apart, with what a request of each size does."""
    lim = a.effective.limit
    # in GPUs, a slice as its share (0.25), as the live figures from the broker write it
    shown = a.held if a.held == int(a.held) else f"{float(a.held):g}"
    held = f'You hold <span data-gpuhub="held">{shown}</span> GPU{"" if a.held <= 1 and a.held != 0 else "s"}'
    fits = f'<span data-gpuhub="fits">{a.fits}</span>'
    queue = "waits in the queue for GPUs to free up, its place shown"
    beyond = f" (and {_gpus(a.borrowed)} borrowed beyond it)" if a.borrowed else ""
    used_up = lim.gpu_hours is not None and a.gpu_hours >= lim.gpu_hours
    if lim.max_gpus is None and not used_up:
        head = f"{held}, with no limit ({escape(a.effective.source)}){beyond}: "
        if a.fits:
            room = f"{fits} can start now, so a request of up to {a.fits} starts at once and a larger one "
            room += f"{queue}."
        else:
            room = f"{fits} can start now, so a request {queue}."
    else:
        head = f"{held} of {escape(describe_limit(a.effective))}{beyond}: "
        more = words.count(a.may_take or 0, "more GPU")
        if used_up or not a.may_take:
            room = (
                "your GPU-hours are used up for now." if used_up else "your limit lets you hold no more GPUs."
            )
        elif a.fits >= a.may_take:
            it = "it is" if a.fits == 1 else "they are"
            room = f"your limit lets you hold {more}, and {it} free now ({fits} can start at once)."
        elif a.fits:
            room = (
                f"your limit lets you hold {more}; {fits} can start now, so a request of up to {a.fits} "
                f"starts at once and one of up to {a.may_take} {queue}."
            )
        else:
            room = f"your limit lets you hold {more}; {fits} can start now, so a request of up to "
            room += f"{a.may_take} {queue}."
    quota = ""
    if lim.gpu_hours is not None:
        quota = (
            f' You have used <span data-gpuhub="gpu-hours">{a.gpu_hours:.1f}</span> of '
            f"{lim.gpu_hours:g} GPU-hours over the last {lim.window_hours:g} hours."
        )
    return head + room + quota


def _gpus(n: int) -> str:
    return words.count(n, "GPU")


def borrow_text(a: Allowance, grace_seconds: float | None) -> str:
    """What the form says about borrowing beyond the limit ("" without an allowance)."""
    if not a.borrow_allowance or a.effective.limit.max_gpus is None:
        return ""
    if grace_seconds is None:
        notice = "with notice"
    elif grace_seconds <= 0:
        notice = "without notice"
    else:
        words = values.period_in_words(grace_seconds)
        notice = f"with {words}{chr(39) if words.endswith('s') else chr(39) + 's'} notice"
    taken_back = (
        " Borrowed GPUs can be taken back when a request within its limit needs them, "
        f'<span data-gpuhub="preempt-notice">{notice}</span>: the server is then stopped '
        "(your files stay)."
    )
    lim = a.effective.limit
    if a.may_borrow_now > 0:
        return (
            '<span data-gpuhub="borrow" data-why="free">You may also borrow '
            f'<span data-gpuhub="may-borrow">{a.may_borrow_now}</span> '
            f"GPU{'' if a.may_borrow_now == 1 else 's'} beyond your limit right now, up to "
            f'<span data-gpuhub="most">{a.fits + a.may_borrow_now}</span> for this server '
            f"(your borrowing allowance is {_gpus(a.borrow_allowance)}; GPUs are lent while they "
            f"are free and nobody waits).{taken_back}</span>"
        )
    if a.waiting:
        why, reason = (
            "waiting",
            (
                f"{a.waiting} request{' waits' if a.waiting == 1 else 's wait'} for GPUs, and GPUs are "
                "lent beyond a limit only while nobody waits"
            ),
        )
    elif a.borrowed >= a.borrow_allowance:
        why, reason = "allowance", f"you already borrow {_gpus(a.borrowed)}, all of your borrowing allowance"
    elif lim.gpu_hours is not None and a.gpu_hours >= lim.gpu_hours:
        why, reason = "quota", "your GPU-hours for this period are used up"
    elif a.free == 0:
        why, reason = "none_free", "no GPU is free"
    else:
        why, reason = "none_free", "no GPU is free beyond what your limit leaves you"
    return (
        f'<span data-gpuhub="borrow" data-why="{why}">You may borrow up to '
        f"{_gpus(a.borrow_allowance)} beyond your limit, but "
        f'<span data-gpuhub="may-borrow">0</span> now: {escape(reason)}.{taken_back}</span>'
    )


def render_form(
    allowance: Allowance,
    models: Sequence[str],
    default_gpus: int,
    partitions: Mapping[str, int] | None = None,
    default_partition: str = "",
    grace_seconds: float | None = None,
    asked: int | None = None,
    longest: tuple[float | None, str] = (None, "default"),
    slices: SliceChoice | None = None,
) -> str:
    """The spawn form's HTML (Bootstrap 5 classes, as JupyterHub 5+ pages use).

    ``partitions`` (Slurm): partition name to GPUs free in it now; a request larger than
    what is free waits in the queue, so the count is capped by the limit only.

    ``grace_seconds``: ``c.GpuHub.preempt_grace_seconds``, the notice borrowed GPUs are taken
    back with (said in words when the user may borrow). The count has no ``max``: what the
    limit and the borrowing allowance allow is the server's call, and its refusal says why.

    ``asked``: the count of a start just refused, shown again in the field with the refusal
    (the user's own value, not the default).

    ``longest``: the user's longest session in hours (None: no limit) and where it comes from
    (``timelimits.max_hours``); the hours field may ask for less.

    ``slices``: the slices offered (``c.GpuHub.gpu_slices``): a choice of GPU size, whole GPUs
    or one slice; a user who takes slices only (``c.GpuHub.slice_groups``) chooses a slice or
    no GPU, and has no count to give.
    """
    # capped by the limit, not by what is free: a request that does not fit now waits its turn
    room = allowance.may_take
    value = min(default_gpus, allowance.fits if room is None else max(room, allowance.fits))
    if asked is not None:
        value = asked
    borrow = borrow_text(allowance, grace_seconds)
    if slices is not None and slices.only:
        return "\n".join(slice_field(slices, allowance) + hours_field(*longest))
    parts = [
        '<div class="mb-3" id="gpuhub-form">',
        '  <label for="gpuhub-gpus" class="form-label">GPUs</label>',
        f'  <input type="number" class="form-control" id="gpuhub-gpus" name="gpus" min="0" '
        f'step="1" value="{value}" aria-describedby="gpuhub-gpus-help">',
        '  <div class="form-text" id="gpuhub-gpus-help">',
        f'    <span data-gpuhub="free">{allowance.free}</span> of '
        f'<span data-gpuhub="total">{allowance.total}</span> GPUs are free now. '
        + _allowance_text(allowance)
        + (" " + borrow if borrow else ""),
        "  </div>",
        "</div>",
    ]
    if slices is not None:
        parts += slice_field(slices, allowance)
    parts += hours_field(*longest)
    if len(models) > 1:
        options = ['    <option value="">Any model</option>'] + [
            f'    <option value="{escape(m)}">{escape(m)} ({allowance.free_by_model.get(m, 0)} free)</option>'
            for m in models
        ]
        parts += [
            '<div class="mb-3">',
            '  <label for="gpuhub-model" class="form-label">GPU model</label>',
            '  <select class="form-select" id="gpuhub-model" name="gpu_model">',
            *options,
            "  </select>",
            "</div>",
        ]
    if partitions:
        options = [
            f'    <option value="{escape(p)}" data-free="{n}"{" selected" if p == default_partition else ""}>'
            f"{escape(p)} ({n} free)</option>"
            for p, n in partitions.items()
        ]
        parts += [
            '<div class="mb-3">',
            '  <label for="gpuhub-partition" class="form-label">Slurm partition</label>',
            '  <select class="form-select" id="gpuhub-partition" name="partition">',
            *options,
            "  </select>",
            '  <div class="form-text">A request larger than what is free now waits in the queue.</div>',
            "</div>",
        ]
    return "\n".join(parts)


def slice_field(choice: SliceChoice, allowance: Allowance) -> list[str]:
    """The choice of a GPU size: whole GPUs (the count above) or one slice of a split model,
    with what isolates a slice; for a user who takes slices only, a slice or no GPU."""
    first = (
        '    <option value="0">No GPU</option>'
        if choice.only
        else '    <option value="" selected>Whole GPUs (the count above)</option>'
    )
    options = [first]
    for model, (offer, free, total) in choice.room.items():
        memory = f", {offer.memory_mib / 1024:g} GiB" if offer.memory_mib else ""
        selected = " selected" if choice.only and len(options) == 1 else ""
        options.append(
            f'    <option value="1/{offer.count}" data-model="{escape(model)}" data-free="{free}"{selected}>'
            f"{escape(offer.label)} of {escape(model)}{memory} ({free} of {total} free)</option>"
        )
    only = ""
    if choice.only:
        only = (
            f'<input type="hidden" name="gpus" value="1">'
            '<p class="form-text" data-gpuhub="slices-only">You take slices of GPUs here, not whole GPUs. '
            f"You hold {units_text(Fraction(allowance.held))} of "
            f"{escape(describe_limit(allowance.effective))}.</p>"
        )
    return [
        '<div class="mb-3" id="gpuhub-slices">',
        '  <label for="gpuhub-share" class="form-label">GPU size</label>',
        '  <select class="form-select" id="gpuhub-share" name="gpu_share" '
        'aria-describedby="gpuhub-share-help">',
        *options,
        "  </select>",
        '  <div class="form-text" id="gpuhub-share-help" data-gpuhub="slice-isolation">'
        + only
        + "A slice is a part of one GPU shared with other users: it counts as that part of a GPU "
        "against your limit and in GPU-hours, and waits in the queue when none is free. "
        + (
            "Here a slice is one of Slurm's GPU shards: Slurm gives the GPU to your job, but nothing "
            "divides its memory or compute between the users who share it. "
            if choice.shards
            else "On NVIDIA GPUs each slice runs through CUDA MPS with its own memory limit and share "
            "of the compute; a fatal GPU fault in one user's work can end the work of the others on "
            "that GPU. "
        )
        + "<code>%%distributed</code> needs whole GPUs.</div>",
        "</div>",
    ]


def hours_field(longest: float | None, source: str) -> list[str]:
    """The spawn form's hours: empty means the longest the user may run (said, with its source)."""
    if longest is None:
        help_text = "No time limit applies to your sessions; give hours to end this one by itself."
        bound = ""
    else:
        help_text = (
            f"Your session may run for up to {timelimits.hours_text(longest)} ({escape(source)}); "
            "it ends then, with warnings before. Leave empty for the most, or ask for less."
        )
        bound = f' max="{longest:g}"'
    return [
        '<div class="mb-3">',
        '  <label for="gpuhub-hours" class="form-label">Hours</label>',
        f'  <input type="number" class="form-control" id="gpuhub-hours" name="hours" min="0.0167" '
        f'step="any"{bound} placeholder="{"no limit" if longest is None else f"{longest:g}"}" '
        'aria-describedby="gpuhub-hours-help">',
        f'  <div class="form-text" id="gpuhub-hours-help" data-gpuhub="longest">{help_text}</div>',
        "</div>",
    ]
