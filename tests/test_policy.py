"""Table tests of every allocation decision (spawner/policy/limits.py)."""

import random
from datetime import datetime, timedelta

import pytest

from spawner.policy.limits import (
    EffectiveLimit,
    Holdings,
    Limit,
    LimitRules,
    Refusal,
    check_request,
    effective_limit,
    gpu_hours_used,
)
from spawner.policy.placement import (
    Gpu,
    GpuSet,
    GroupedGpus,
    Request,
    largest_placeable,
    make_fit_index,
    place,
    refit,
)

RULES = LimitRules(
    default=Limit(max_gpus=1),
    groups={
        "students": Limit(max_gpus=2),
        "staff": Limit(max_gpus=4, gpu_hours=100, window_hours=24),
        "open": Limit(max_gpus=None),
        "quota": Limit(max_gpus=3, gpu_hours=50),
    },
    users={"alice": Limit(max_gpus=6), "zero": Limit(max_gpus=0)},
)


@pytest.mark.parametrize(
    "user, groups, max_gpus, gpu_hours, source",
    [
        ("bob", [], 1, None, "default"),
        ("bob", ["unknown"], 1, None, "default"),
        ("bob", ["students"], 2, None, "group students"),
        ("alice", ["students"], 6, None, "user alice"),  # user over group
        ("zero", ["staff"], 0, None, "user zero"),  # user over group, even when stricter
        ("bob", ["students", "staff"], 4, None, "groups staff, students"),  # most generous
        ("bob", ["staff", "quota"], 4, 100, "groups quota, staff"),
        ("bob", ["students", "open"], None, None, "groups open, students"),  # None = unlimited
    ],
)
def test_effective_limit(user, groups, max_gpus, gpu_hours, source):
    eff = effective_limit(user, groups, RULES)
    assert (eff.limit.max_gpus, eff.limit.gpu_hours, eff.source) == (max_gpus, gpu_hours, source)


def test_effective_limit_keeps_the_window_of_the_chosen_quota():
    eff = effective_limit("bob", ["staff", "quota"], RULES)
    assert eff.limit.window_hours == 24


def node(name, n, model="A100", start=0):
    return [Gpu(name, start + i, model) for i in range(n)]


INV = node("n1", 4) + node("n2", 4) + node("n3", 2, "V100")


def labels(gpus):
    return [g.label for g in gpus] if gpus is not None else None


@pytest.mark.parametrize(
    "count, free, model, max_nodes, per_node, expected",
    [
        (0, INV, None, 1, None, []),
        (1, INV, None, 1, None, ["n3:0"]),  # best fit: the smallest node that fits
        (1, INV, "A100", 1, None, ["n1:0"]),
        (3, INV, None, 1, None, ["n1:0", "n1:1", "n1:2"]),
        # n1 has 2 free, n2 whole: a 2-GPU request fills n1's hole, keeps n2 whole
        (2, INV[2:], "A100", 1, None, ["n1:2", "n1:3"]),
        (5, INV, None, 1, None, None),  # no single node has 5
        # multi-node: whole nodes first, then the best fit for the rest
        (6, INV, None, None, None, ["n1:0", "n1:1", "n1:2", "n1:3", "n3:0", "n3:1"]),
        (8, INV, "A100", 2, None, labels(node("n1", 4) + node("n2", 4))),
        (10, INV, None, 2, None, None),  # would need 3 nodes
        (4, INV, None, None, 2, ["n1:0", "n1:1", "n3:0", "n3:1"]),  # 2 per node, fullest fits
        (3, INV, None, None, 2, None),  # 3 is not a multiple of 2
        (2, INV, "H100", 1, None, None),
    ],
)
def test_place(count, free, model, max_nodes, per_node, expected):
    got = place(Request("u", count, model, max_nodes, per_node), free, INV)
    assert labels(got) == expected


def test_place_finds_the_fewest_nodes_even_when_a_whole_node_is_small():
    # a whole 1-GPU node must not crowd out two 3-free nodes that together hold 6
    inv = node("a", 1) + node("b", 4) + node("c", 4)
    free = node("a", 1) + node("b", 4)[1:] + node("c", 4)[1:]
    got = place(Request("u", 6, None, max_nodes=2), free, inv)
    assert labels(got) == ["b:1", "b:2", "b:3", "c:1", "c:2", "c:3"]


def test_place_is_deterministic_whatever_the_input_order():
    free = list(reversed(INV))
    a = place(Request("u", 3, None, 1), free, INV)
    b = place(Request("u", 3, None, 1), INV, INV)
    assert a == b


def eff(max_gpus, source="default", gpu_hours=None):
    return EffectiveLimit(Limit(max_gpus=max_gpus, gpu_hours=gpu_hours, window_hours=168), source)


SMALL = node("n1", 4)


@pytest.mark.parametrize(
    "count, model, limit, holdings, free, reason, fits, words",
    [
        (-1, None, eff(2), Holdings(), SMALL, "bad_request", None, ["whole number of 0 or more"]),
        ("2", None, eff(2), Holdings(), SMALL, "bad_request", None, ["'2'"]),
        (1, "H100", eff(2), Holdings(), SMALL, "unknown_model", None, ["'H100'", "Models here: A100"]),
        (5, None, eff(9), Holdings(), SMALL, "too_large", 4, ["5 GPUs", "at most 4", "4 or fewer"]),
        (
            3,
            None,
            eff(2, "group students"),
            Holdings(held=0),
            SMALL,
            "over_limit",
            2,
            [
                "3 GPUs",
                "hold 0",
                "limit of 2 (group students): your limit lets you hold 2 more GPUs.",
                "Ask for 2 or fewer.",
            ],
        ),
        (
            1,
            None,
            eff(2),
            Holdings(held=2),
            SMALL[2:],
            "over_limit",
            0,
            [
                "hold 2",
                "limit of 2 (default): your limit lets you hold no more.",
                "Stop something you hold first",
            ],
        ),
        (
            3,
            None,
            eff(4),
            Holdings(held=0),
            SMALL[2:],
            "no_capacity",
            2,
            ["only 2 are free", "2 of 4 in use", "Ask for 2 or fewer"],
        ),
        (
            1,
            None,
            eff(4, "user bob", gpu_hours=10),
            Holdings(gpu_hours=12.5),
            SMALL,
            "quota_exhausted",
            0,
            ["12.5 of your 10 GPU-hours", "168 hours (user bob)"],
        ),
    ],
)
def test_check_request_refusals(count, model, limit, holdings, free, reason, fits, words):
    with pytest.raises(Refusal) as err:
        check_request(Request("bob", count, model), limit, holdings, SMALL, free)
    assert err.value.reason == reason
    assert err.value.fits == fits
    for w in words:
        assert w in err.value.message


@pytest.mark.parametrize(
    "count, limit, holdings, free",
    [
        (0, eff(0), Holdings(held=5), []),  # no GPUs is always allowed
        (2, eff(2), Holdings(held=0), SMALL),
        (4, eff(None), Holdings(held=7), SMALL),  # unlimited
        (1, eff(3, gpu_hours=10), Holdings(held=1, gpu_hours=9.9), SMALL),
    ],
)
def test_check_request_admits(count, limit, holdings, free):
    check_request(Request("bob", count), limit, holdings, SMALL, free)


@pytest.mark.parametrize(
    "reason, status", [("bad_request", 400), ("over_limit", 403), ("no_capacity", 409), ("x", 400)]
)
def test_refusal_status_codes(reason, status):
    assert Refusal("m", reason=reason).status_code == status


T0 = datetime(2026, 1, 1, 12, 0)


@pytest.mark.parametrize(
    "intervals, now, window, expected",
    [
        ([], T0, 24, 0.0),
        ([(T0 - timedelta(hours=2), T0 - timedelta(hours=1), 2)], T0, 24, 2.0),
        ([(T0 - timedelta(hours=3), None, 1)], T0, 24, 3.0),  # still running: up to now
        ([(T0 - timedelta(hours=30), T0 - timedelta(hours=20), 4)], T0, 24, 16.0),  # clipped
        ([(T0 - timedelta(hours=30), T0 - timedelta(hours=25), 4)], T0, 24, 0.0),  # outside
        ([(T0 + timedelta(hours=1), None, 4)], T0, 24, 0.0),  # after now
    ],
)
def test_gpu_hours_used(intervals, now, window, expected):
    assert gpu_hours_used(intervals, now, window) == pytest.approx(expected)


def _general_rule(request: Request, free, inventory):
    """The placement rule as first written (every node sorted, then the k fullest): the
    oracle for the one-node shortcut and for the groups a GpuSet remembers."""
    n = request.count
    by = {}
    for g in sorted(free):
        if request.model is None or g.model == request.model:
            by.setdefault(g.node, []).append(g)
    total = {}
    for g in inventory:
        if request.model is None or g.model == request.model:
            total[g.node] = total.get(g.node, 0) + 1
    order = sorted(by, key=lambda node: (-len(by[node]), len(by[node]) != total[node], node))
    k, held = 0, 0
    while held < n and k < len(order):
        held += len(by[order[k]])
        k += 1
    if held < n or (request.max_nodes is not None and k > request.max_nodes):
        return None
    chosen = [g for node in order[: k - 1] for g in by[node]]
    rest = n - len(chosen)
    fits = [node for node in order[k - 1 :] if len(by[node]) >= rest]
    best = min(fits, key=lambda node: (len(by[node]), len(by[node]) != total[node], node))
    return tuple(sorted(chosen + by[best][:rest]))


def test_placement_shortcuts_choose_what_the_general_rule_chooses():
    rnd = random.Random(7)
    for _ in range(400):
        sizes = [rnd.choice((2, 4, 8)) for _ in range(rnd.randint(1, 12))]
        inv = [
            Gpu(f"n{k:02d}", i, rnd.choice(("A100", "H100")) if rnd.random() < 0.2 else "A100")
            for k, size in enumerate(sizes)
            for i in range(size)
        ]
        free = [g for g in inv if rnd.random() < 0.6]
        request = Request("u", rnd.randint(1, 12), rnd.choice((None, None, "A100")), rnd.choice((None, 1, 2)))
        expected = _general_rule(request, free, inv)
        assert place(request, free, inv) == expected
        # the same through the sets a ledger keeps (grouped once, "ever fits" remembered)
        gs_inv, gs_free = GpuSet.ordered(sorted(inv)), GpuSet.ordered(sorted(free))
        assert place(request, gs_free, gs_inv) == expected
        assert place(request, gs_inv, gs_inv) == _general_rule(request, inv, inv)
        assert place(request, gs_inv, gs_inv) == place(request, gs_inv, gs_inv)  # remembered
        assert largest_placeable(gs_free, request.model, request.max_nodes) == largest_placeable(
            free, request.model, request.max_nodes
        )


def test_the_kept_fit_index_chooses_what_the_general_rule_chooses():
    """A ledger keeps the free GPUs' fit index from write to write (``refit``), and a
    one-node request is placed from it: after every move it places as the general rule."""
    rnd = random.Random(11)
    for _ in range(60):
        sizes = [rnd.choice((2, 4, 8)) for _ in range(rnd.randint(1, 10))]
        inv = [Gpu(f"n{k:02d}", i, "A100") for k, size in enumerate(sizes) for i in range(size)]
        everyone = GpuSet.ordered(inv)
        free = {g for g in inv if rnd.random() < 0.5}
        groups = GpuSet.ordered(sorted(free)).by_node(None)
        index = make_fit_index(groups, everyone.by_node(None))
        for _ in range(30):
            moved = rnd.sample(inv, min(len(inv), rnd.randint(1, 3)))
            before = {g.node: len(groups.get(g.node, ())) for g in moved}
            free ^= set(moved)  # taken if it was free, given back if it was held
            groups = GpuSet.ordered(sorted(free)).by_node(None)
            total = everyone.by_node(None)
            index = refit(index, {n: (k, len(groups.get(n, ())), len(total[n])) for n, k in before.items()})
            assert index == make_fit_index(groups, total)
            kept = GroupedGpus(groups, (everyone, index))
            assert kept == sorted(free) and len(kept) == len(free) and list(kept) == sorted(free)
            assert kept.by_node("A100") == groups and (not free or kept[-1] == max(free))
            for n in range(1, 10):
                request = Request("u", n, None, rnd.choice((None, 1)))
                assert place(request, kept, everyone) == _general_rule(request, sorted(free), inv)
                assert largest_placeable(kept, None, None) == len(free)
