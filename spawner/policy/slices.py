"""GPU slices (pure): how an admin splits a model's GPUs, what a request for a slice says, and
where a slice goes. The groundwork of slices as a unit (issue 34); nothing here touches a
database, a clock or a process.

- :func:`check_gpu_slices`: ``c.GpuHub.gpu_slices`` (``{"A100": 4}``: each A100 may be split in
  four) checked against the GPUs the hub has: a whole number from 2 to :data:`MAX_SLICES`, of
  a model that exists, into equal parts of its memory. Every refusal names the setting.
- :func:`parse_share`: a request for part of a GPU (``1/4``, ``0.25``, ``25%``) read against
  what is offered for that model: one slice exactly, or refused with what to ask for instead;
  never rounded.
- :func:`free_whole`, :func:`free_slices`, :func:`place_slice`: a GPU is held whole or in
  slices, never both: a whole request takes only GPUs with no slice held, a slice only GPUs not
  held whole. Slices pack onto the GPUs already split (fewest free slices first), so that whole
  GPUs stay whole for whole requests.
- :func:`units`: what an allocation counts against a limit and in GPU-hours: its GPUs times
  its share (a quarter slice is 1/4 of a GPU), exactly, as a :class:`~fractions.Fraction`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction

from spawner.policy.placement import Gpu
from spawner.policy.values import show

SETTING = "c.GpuHub.gpu_slices"
# the most clients one GPU takes: 48 MPS clients per GPU on Volta and later (MIG has at most 7
# instances, Slurm's shard count is free): more parts than that is never what an admin meant
MAX_SLICES = 48

_SHARE_TEXT = re.compile(
    r"\s*(?:(\d{1,3})\s*/\s*(\d{1,3})|(\d{0,3}\.\d{1,6}|\d{1,3})|(\d{1,3}(?:\.\d{1,6})?)\s*%)\s*"
)


@dataclass(frozen=True)
class Offer:
    """How a model's GPUs may be split: ``count`` equal slices."""

    model: str
    count: int
    gpu_memory_mib: int | None = None  # the whole GPU's, where the inventory knows it

    @property
    def share(self) -> Fraction:
        return Fraction(1, self.count)

    @property
    def memory_mib(self) -> int | None:
        """Each slice's part of the GPU's memory."""
        return None if self.gpu_memory_mib is None else self.gpu_memory_mib // self.count

    @property
    def thread_percent(self) -> int:
        """Each slice's part of the GPU's compute, as MPS's active thread percentage."""
        return max(1, 100 // self.count)

    @property
    def label(self) -> str:
        return f"1/{self.count} GPU"


def check_gpu_slices(setting: object, inventory: Iterable[Gpu]) -> dict[str, Offer]:
    """The offers ``setting`` makes, by model; ``ValueError`` naming the setting otherwise."""
    if setting is None:
        return {}
    if not isinstance(setting, Mapping):
        raise ValueError(
            f'{SETTING} must be a dict of model to slice count, e.g. {{"A100": 4}}; got {show(setting)}'
        )
    memory: dict[str, set[int | None]] = {}
    for g in inventory:
        memory.setdefault(g.model, set()).add(g.memory_mib)
    offers = {}
    for model, count in setting.items():
        if not isinstance(model, str) or model not in memory:
            known = ", ".join(sorted(memory)) or "none"
            raise ValueError(f"{SETTING}: no GPU here is of model {show(model)} (the models here: {known})")
        if isinstance(count, bool) or not isinstance(count, int):
            got = repr(count) if isinstance(count, float) else show(count)  # 4.0 is not shown as 4
            raise ValueError(f"{SETTING}[{model!r}] must be a whole number of slices; got {got}")
        if count < 2 or count > MAX_SLICES:
            hint = " (1 is the whole GPU: leave the model out)" if count == 1 else ""
            raise ValueError(f"{SETTING}[{model!r}] must be from 2 to {MAX_SLICES} slices; got {count}{hint}")
        sizes = memory[model]
        if len(sizes) > 1:
            shown = ", ".join(sorted(str(m) if m is not None else "unknown" for m in sizes))
            raise ValueError(
                f"{SETTING}[{model!r}]: the {model} GPUs here differ in memory ({shown} MiB), so a slice "
                "would not be the same part of each: give them different model names"
            )
        [mib] = sizes
        if mib is not None and mib % count:
            raise ValueError(
                f"{SETTING}[{model!r}] = {count}: {mib} MiB does not divide into {count} equal slices; "
                f"choose a count that divides it"
            )
        offers[model] = Offer(model, count, mib)
    return offers


def parse_share(text: object, model: str, offers: Mapping[str, Offer]) -> Offer:
    """The offer a request for part of a GPU of ``model`` asks for: exactly one slice of it
    (``1/4``, ``0.25`` or ``25%`` where quarters are offered). ``ValueError`` saying what may
    be asked otherwise: a share that is not one slice is refused, never rounded."""
    offer = offers.get(model)
    if offer is None:
        split = ", ".join(f"{o.model} ({o.label})" for o in offers.values()) or "none"
        raise ValueError(
            f"{model} GPUs are not split into slices here: ask for whole GPUs (split here: {split})"
        )
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"a share of a GPU is written 1/{offer.count}; got {show(text)}")
    m = _SHARE_TEXT.fullmatch(str(text))
    if m is None:
        raise ValueError(
            f"a share of a GPU is written 1/{offer.count} (or {100 / offer.count:g}%); got {show(text)}"
        )
    num, den, dec, pct = m.groups()
    if num is not None:
        if int(den) == 0:
            raise ValueError(f"a share of a GPU cannot divide by 0; ask for 1/{offer.count}")
        share = Fraction(int(num), int(den))
    elif dec is not None:
        share = Fraction(dec)
    else:
        share = Fraction(pct) / 100
    if share != offer.share:
        if share >= 1:
            raise ValueError(f"{show(text)} is a whole GPU or more: ask for whole GPUs, not a share")
        raise ValueError(
            f"{model} GPUs are split into {offer.count} slices here: ask for {offer.label} (one slice); "
            f"{show(text)} is not one slice, and gpuhub does not round it. For more, ask for a whole GPU."
        )
    return offer


def resolve_share(text: object, model: str | None, offers: Mapping[str, Offer]) -> Offer:
    """The offer a request for a share asks for: of ``model``, or where no model is given,
    of the one split model whose slice it names. ``ValueError`` saying what to ask otherwise."""
    if model is not None:
        return parse_share(text, model, offers)
    if not offers:
        raise ValueError("no GPU is split into slices here: ask for whole GPUs")
    fits = []
    for offer in offers.values():
        try:
            fits.append(parse_share(text, offer.model, offers))
        except ValueError as e:
            last = e
    if len(fits) == 1:
        return fits[0]
    if not fits:
        if len(offers) == 1:
            raise last
        split = ", ".join(f"{o.label} of {o.model}" for o in offers.values())
        raise ValueError(f"{show(text)} is not a slice offered here: ask for one of {split}")
    models = ", ".join(o.model for o in fits)
    raise ValueError(f"{show(text)} of a GPU is offered for {models}: choose the GPU model too")


@dataclass(frozen=True)
class GpuUse:
    """One GPU and what holds it: ``whole`` (an allocation has all of it) or the numbers
    (1 to the offer's count) of the slices held (a GPU is never both)."""

    gpu: Gpu
    whole: bool = False
    slices: frozenset[int] = frozenset()


def free_whole(uses: Iterable[GpuUse]) -> list[Gpu]:
    """The GPUs a whole-GPU request may take: none of it held, not even a slice."""
    return [u.gpu for u in uses if not u.whole and not u.slices]


def free_slices(uses: Iterable[GpuUse], offer: Offer) -> int:
    """How many slices of ``offer``'s model could start now."""
    return sum(offer.count - len(u.slices) for u in uses if u.gpu.model == offer.model and not u.whole)


def place_slice(uses: Iterable[GpuUse], offer: Offer) -> tuple[Gpu, int] | None:
    """The GPU and slice number (1 to ``offer.count``) a request for one slice of ``offer``
    takes, or None if none is free: on a GPU of the model not held whole, the one with the
    fewest free slices (a GPU already split before a whole one), then the lowest; its lowest
    free slice."""
    room = [u for u in uses if u.gpu.model == offer.model and not u.whole and len(u.slices) < offer.count]
    if not room:
        return None
    u = min(room, key=lambda u: (offer.count - len(u.slices), u.gpu))
    return u.gpu, min(set(range(1, offer.count + 1)) - u.slices)


def units(gpus: int, share: Fraction = Fraction(1)) -> Fraction:
    """What an allocation of ``gpus`` GPUs (or slices of ``share`` each) counts as, in GPUs."""
    return gpus * share


def plain(amount: Fraction | int) -> Fraction | int:
    """``amount`` as an ``int`` where it is whole (what every count of whole GPUs was)."""
    amount = Fraction(amount)
    return amount.numerator if amount.denominator == 1 else amount


def units_text(amount: Fraction) -> str:
    """``1/4 GPU``, ``1 GPU``, ``2 1/2 GPUs``: an amount of GPUs as a person writes it."""
    whole, part = divmod(amount.numerator, amount.denominator)
    if part == 0:
        return f"{whole} GPU" + ("" if whole == 1 else "s")
    frac = f"{part}/{amount.denominator}"
    return f"{frac} GPU" if whole == 0 else f"{whole} {frac} GPUs"


def uses_of(
    gpus: Iterable[Gpu], free: Iterable[Gpu], split: Mapping[Gpu, Iterable[tuple[int, int]]], count: int
) -> list[GpuUse]:
    """The :class:`GpuUse` of each of ``gpus``: free whole GPUs (``free``), GPUs held in
    slices (``split``: the (part, parts) held of each), the rest held whole. A GPU held in
    slices of another count than ``count`` (the offer changed while they ran) takes no new
    slice until they end: it counts as full."""
    free = set(free)
    out = []
    for g in gpus:
        held = list(split.get(g, ()))
        if held:
            same = all(parts == count for _, parts in held)
            taken = frozenset(p for p, _ in held) if same else frozenset(range(1, count + 1))
            out.append(GpuUse(g, slices=taken))
        else:
            out.append(GpuUse(g, whole=g not in free))
    return out


@dataclass(frozen=True)
class SliceWait:
    """A request for one slice waiting in the queue."""

    id: int
    offer: Offer
    on_nodes: frozenset[str] | None = None


def grant_slices(
    order: Iterable[int],
    slice_waits: Mapping[int, SliceWait],
    whole_waits: Iterable[int],
    uses: list[GpuUse],
    reserved: Mapping[int, Iterable[Gpu]] | None = None,
) -> dict[int, Gpu]:
    """Which waiting slices start now (id: the slice, a ``Gpu`` with ``part`` and ``parts``),
    in the queue's ``order``. A slice starts on a GPU already split wherever one has room; it
    splits a free whole GPU only when no whole request waits ahead of it (``whole_waits``: the
    whole requests not starting now), and it never refills a GPU reserved for a whole request
    ahead of it (``reserved``: the queue plan's reservations, by entry), which then drains; so
    slices never keep a waiting whole request from the GPUs it waits for. ``uses`` are the
    GPUs after this plan's whole grants."""
    whole_waits, reserved = set(whole_waits), reserved or {}
    current = {u.gpu: u for u in uses}
    grants: dict[int, Gpu] = {}
    whole_ahead, blocked = False, set()
    for entry in order:
        if entry in whole_waits:
            whole_ahead = True
            blocked.update(reserved.get(entry, ()))
            continue
        w = slice_waits.get(entry)
        if w is None:
            continue
        room = [
            u
            for u in current.values()
            if (w.on_nodes is None or u.gpu.node in w.on_nodes)
            and u.gpu not in blocked
            and (u.slices or not whole_ahead)
        ]
        placed = place_slice(room, w.offer)
        if placed is None:
            continue
        g, part = placed
        u = current[g]
        current[g] = GpuUse(g, slices=u.slices | {part})
        grants[entry] = slice_gpu(g, part, w.offer.count)
    return grants


def expected_starts(frees, waiting: int) -> list[tuple[object, str] | None]:
    """When each of ``waiting`` slices (in the queue's order) may start: the slices held that
    end, earliest first (``frees``: (when, how sure, how many slices it frees)), one each; None
    for those beyond what anything now held frees. A guess at best: a whole-GPU request may take
    a GPU that frees, and a slice is not reserved."""
    out: list[tuple[object, str] | None] = []
    for when, sure, n in sorted(frees, key=lambda f: f[0]):
        out += [(when, "guess" if sure in ("firm", "limit") else sure)] * n
    return (out + [None] * waiting)[:waiting]


def slice_gpu(g: Gpu, part: int, count: int) -> Gpu:
    """Slice ``part`` (1 to ``count``) of the GPU ``g``, with its share of the memory."""
    memory = None if g.memory_mib is None else g.memory_mib // count
    return Gpu(g.node, g.index, g.model, memory, g.uuid, part, count)
