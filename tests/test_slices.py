"""GPU slices, the pure parts (issue 34's groundwork): the admin's setting checked against the
GPUs, a request for a share read against what is offered (never rounded), a GPU held whole or
in slices but never both, slices packed onto GPUs already split, and the MPS command lines and
environments a slice runs with (no GPU here: they are built and checked, not run)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from spawner.policy import mps
from spawner.policy.placement import Gpu
from spawner.policy.slices import (
    MAX_SLICES,
    GpuUse,
    Offer,
    SliceWait,
    check_gpu_slices,
    expected_starts,
    free_slices,
    free_whole,
    grant_slices,
    parse_share,
    place_slice,
    resolve_share,
    slice_gpu,
    units,
    units_text,
    uses_of,
)

A100 = [Gpu("n1", i, "A100", 40960) for i in range(2)] + [Gpu("n2", 0, "A100", 40960)]
INVENTORY = [*A100, Gpu("n2", 1, "H100", 81920), Gpu("n3", 0, "T4", None)]
QUARTERS = {"A100": Offer("A100", 4, 40960)}


@pytest.mark.parametrize(
    "setting, want",
    [
        (None, {}),
        ({}, {}),
        ({"A100": 4}, {"A100": Offer("A100", 4, 40960)}),
        ({"A100": 2, "H100": 8}, {"A100": Offer("A100", 2, 40960), "H100": Offer("H100", 8, 81920)}),
        ({"T4": 3}, {"T4": Offer("T4", 3, None)}),  # memory unknown: no division to check
        ({"A100": MAX_SLICES}, "does not divide"),  # 40960 / 48 is not whole
        ({"A100": 3}, "40960 MiB does not divide into 3 equal slices"),
        ({"A100": 1}, "1 is the whole GPU: leave the model out"),
        ({"A100": 0}, "must be from 2 to 48 slices; got 0"),
        ({"A100": -4}, "must be from 2 to 48 slices; got -4"),
        ({"H100": 64}, "must be from 2 to 48 slices; got 64"),
        ({"A100": True}, "must be a whole number of slices; got true"),
        ({"A100": 4.0}, "must be a whole number of slices; got 4.0"),
        ({"A100": "4"}, "must be a whole number of slices; got '4'"),
        ({"V100": 4}, "no GPU here is of model 'V100' (the models here: A100, H100, T4)"),
        ({4: 4}, "no GPU here is of model 4"),
        ([("A100", 4)], "must be a dict of model to slice count"),
        ("A100=4", "must be a dict of model to slice count"),
    ],
)
def test_the_setting_is_checked_against_the_gpus(setting, want):
    if isinstance(want, dict):
        assert check_gpu_slices(setting, INVENTORY) == want
    else:
        with pytest.raises(ValueError, match=r"c\.GpuHub\.gpu_slices") as e:
            check_gpu_slices(setting, INVENTORY)
        assert want in str(e.value)


def test_gpus_of_one_model_with_different_memory_are_not_split_alike():
    mixed = [Gpu("n1", 0, "A100", 40960), Gpu("n1", 1, "A100", 81920)]
    with pytest.raises(ValueError, match=r"differ in memory \(40960, 81920 MiB\)"):
        check_gpu_slices({"A100": 4}, mixed)


def test_an_offer_says_each_slices_part():
    o = Offer("A100", 4, 40960)
    assert (o.share, o.memory_mib, o.thread_percent, o.label) == (Fraction(1, 4), 10240, 25, "1/4 GPU")
    assert Offer("A100", 3, 40959).thread_percent == 33
    assert Offer("X", 48, None).memory_mib is None and Offer("X", 48, None).thread_percent == 2


@pytest.mark.parametrize("text", ["1/4", " 1 / 4 ", "2/8", "0.25", ".25", "25%", "25 %", 0.25])
def test_one_slice_may_be_written_several_ways(text):
    assert parse_share(text, "A100", QUARTERS) == QUARTERS["A100"]


@pytest.mark.parametrize(
    "text, model, why",
    [
        ("3/4", "A100", "ask for 1/4 GPU (one slice); '3/4' is not one slice, and gpuhub does not round it"),
        ("1/3", "A100", "'1/3' is not one slice"),
        ("0.3", "A100", "'0.3' is not one slice"),
        ("1/8", "A100", "'1/8' is not one slice"),
        ("1", "A100", "'1' is a whole GPU or more: ask for whole GPUs"),
        ("4/4", "A100", "a whole GPU or more"),
        (1, "A100", "a whole GPU or more"),
        ("1/0", "A100", "cannot divide by 0"),
        ("quarter", "A100", "a share of a GPU is written 1/4 (or 25%)"),
        ("-1/4", "A100", "is written 1/4"),
        ("1e-1", "A100", "is written 1/4"),
        ("", "A100", "is written 1/4"),
        (None, "A100", "is written 1/4; got nothing"),
        (True, "A100", "is written 1/4; got true"),
        (
            "1/4",
            "H100",
            "H100 GPUs are not split into slices here: ask for whole GPUs (split here: A100 (1/4 GPU))",
        ),
    ],
)
def test_a_share_that_is_not_one_slice_is_refused_never_rounded(text, model, why):
    with pytest.raises(ValueError) as e:
        parse_share(text, model, QUARTERS)
    assert why in str(e.value)


def uses(*states):
    """GpuUse of A100[i] for each (whole, slices) in ``states``."""
    return [GpuUse(A100[i], whole, frozenset(sl)) for i, (whole, sl) in enumerate(states)]


@pytest.mark.parametrize(
    "states, want",
    [
        (((False, ()), (False, ()), (False, ())), (A100[0], 1)),  # nothing split: the lowest GPU
        (((False, ()), (False, (1,)), (False, ())), (A100[1], 2)),  # packs onto the GPU already split
        (((False, (1, 2)), (False, (1,)), (False, ())), (A100[0], 3)),  # the fullest that has room
        (
            ((False, (1, 2, 3, 4)), (False, (2,)), (False, ())),
            (A100[1], 1),
        ),  # a full GPU is skipped; lowest free number
        (((True, ()), (True, ()), (False, ())), (A100[2], 1)),  # held whole: never sliced
        (((True, ()), (False, (1, 2, 3, 4)), (True, ())), None),  # nowhere
    ],
)
def test_a_slice_goes_where_a_gpu_is_split_already_and_never_on_one_held_whole(states, want):
    assert place_slice(uses(*states), QUARTERS["A100"]) == want


def test_a_whole_request_never_takes_a_gpu_with_a_slice_in_use():
    state = uses((False, ()), (False, (3,)), (True, ()))
    assert free_whole(state) == [A100[0]]
    assert free_slices(state, QUARTERS["A100"]) == 4 + 3
    # the other model's GPUs are not this offer's slices
    other = [*state, GpuUse(Gpu("n2", 1, "H100", 81920))]
    assert free_slices(other, QUARTERS["A100"]) == 7 and place_slice(other, Offer("H100", 2, 81920)) == (
        other[3].gpu,
        1,
    )


@pytest.mark.parametrize(
    "gpus, share, want, text",
    [
        (1, Fraction(1, 4), Fraction(1, 4), "1/4 GPU"),
        (4, Fraction(1, 4), Fraction(1), "1 GPU"),
        (3, Fraction(1), Fraction(3), "3 GPUs"),
        (10, Fraction(1, 4), Fraction(5, 2), "2 1/2 GPUs"),
        (0, Fraction(1, 4), Fraction(0), "0 GPUs"),
    ],
)
def test_a_slice_counts_as_its_part_of_a_gpu(gpus, share, want, text):
    assert units(gpus, share) == want and units_text(want) == text


PRIVATE = "/run/user/1001/gpuhub"
UUID = "GPU-5f2c9a1e-7b3d-4c1a-9e2f-0a1b2c3d4e5f"


def test_mps_a_daemon_per_user_and_gpu_in_the_users_own_directory():
    argv, env = mps.control_start(PRIVATE + "/", UUID)
    assert argv == ["nvidia-cuda-mps-control", "-d"]
    assert env == {
        "CUDA_VISIBLE_DEVICES": UUID,
        "CUDA_MPS_PIPE_DIRECTORY": f"{PRIVATE}/mps-{UUID}/pipe",
        "CUDA_MPS_LOG_DIRECTORY": f"{PRIVATE}/mps-{UUID}/log",
    }
    argv, env, stdin = mps.control_quit(PRIVATE, UUID)
    assert (argv, env, stdin) == (
        ["nvidia-cuda-mps-control"],
        {"CUDA_MPS_PIPE_DIRECTORY": f"{PRIVATE}/mps-{UUID}/pipe"},
        "quit\n",
    )


@pytest.mark.parametrize(
    "offer, memory, threads",
    [
        (Offer("A100", 4, 40960), "0=10240M", "25"),
        (Offer("A100", 2, 40960), "0=20480M", "50"),
        (Offer("T4", 3, 15360), "0=5120M", "33"),
    ],
)
def test_mps_a_slices_client_is_held_to_its_memory_and_compute(offer, memory, threads):
    env = mps.client_env(PRIVATE, UUID, offer)
    assert env == {
        "CUDA_VISIBLE_DEVICES": UUID,
        "CUDA_MPS_PIPE_DIRECTORY": f"{PRIVATE}/mps-{UUID}/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": memory,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": threads,
    }


def test_mps_needs_the_gpus_memory_for_a_limit():
    with pytest.raises(ValueError, match="the inventory must give memory_mib"):
        mps.client_env(PRIVATE, UUID, Offer("T4", 3, None))


@pytest.mark.parametrize(
    "uuid",
    ["GPU-../../etc", "GPU-a/b", "gpu-123", "3", "", "GPU-", "MIG-a b", "GPU-x\n", None, "GPU-" + "a" * 81],
)
def test_mps_takes_only_a_uuid_as_nvml_gives_it(uuid):
    with pytest.raises(ValueError, match="not a GPU UUID"):
        mps.pipe_dir(PRIVATE, uuid)


def test_mps_takes_mig_instances_too():
    mig = "MIG-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d"
    assert mps.pipe_dir(PRIVATE, mig) == f"{PRIVATE}/mps-{mig}/pipe"


def test_the_uses_of_gpus_from_the_free_set_and_the_slices_held():
    split = {A100[1]: [(2, 4)], A100[2]: [(1, 2)]}  # GPU 2's slices are halves: offered as quarters now
    gpus = [*A100, Gpu("n3", 0, "A100", 40960), Gpu("n3", 1, "A100", 40960)]
    got = uses_of(gpus, free=[gpus[0], gpus[3]], split=split, count=4)
    assert got == [
        GpuUse(gpus[0]),
        GpuUse(gpus[1], slices=frozenset({2})),
        GpuUse(gpus[2], slices=frozenset({1, 2, 3, 4})),  # full until its halves end
        GpuUse(gpus[3]),
        GpuUse(gpus[4], whole=True),  # neither free nor split: held whole
    ]


Q = QUARTERS["A100"]


@pytest.mark.parametrize(
    "order, whole_waits, states, want",
    [
        # in the queue's order, onto the GPU already split, then a fresh one
        ([1, 2], [], ((False, (1, 2, 3)), (False, ())), {1: (0, 4), 2: (1, 1)}),
        # a whole request waits ahead: the later slice only fills the split GPU, never a fresh one
        ([1, 9, 2], [9], ((False, (1, 2, 3)), (False, ())), {1: (0, 4)}),
        ([9, 1], [9], ((False, ()), (False, ())), {}),
        # a whole request behind it does not hold it back
        ([1, 9], [9], ((False, ()), (True, ())), {1: (0, 1)}),
        # nothing free
        ([1], [], ((True, ()), (False, (1, 2, 3, 4))), {}),
    ],
)
def test_waiting_slices_start_in_the_queues_order_and_never_split_a_gpu_a_whole_request_waits_for(
    order, whole_waits, states, want
):
    waits = {i: SliceWait(i, Q) for i in (1, 2)}
    got = grant_slices(order, waits, whole_waits, uses(*states))
    assert {i: (A100.index(g.whole), g.part) for i, g in got.items()} == want
    for g in got.values():
        assert (g.parts, g.memory_mib, g.label[-2:]) == (4, 40960 // 4, f"s{g.part}")


def test_a_waiting_slice_keeps_to_its_nodes():
    waits = {1: SliceWait(1, Q, frozenset({"elsewhere"}))}
    assert grant_slices([1], waits, [], uses((False, ()))) == {}


TWO = {"A100": Offer("A100", 4, 40960), "T4": Offer("T4", 2, 16384)}


@pytest.mark.parametrize(
    "text, model, offers, want",
    [
        ("1/4", None, TWO, "A100"),  # the one model split in quarters
        ("50%", None, TWO, "T4"),
        ("1/4", "A100", TWO, "A100"),
        ("1/3", None, TWO, "is not a slice offered here: ask for one of 1/4 GPU of A100, 1/2 GPU of T4"),
        ("1/4", "T4", TWO, "T4 GPUs are split into 2 slices here: ask for 1/2 GPU"),
        (
            "1/4",
            None,
            {**TWO, "H100": Offer("H100", 4, 81920)},
            "offered for A100, H100: choose the GPU model",
        ),
        ("1/4", None, {}, "no GPU is split into slices here"),
        ("1/2", None, QUARTERS, "A100 GPUs are split into 4 slices here: ask for 1/4 GPU"),
    ],
)
def test_a_share_without_a_model_names_the_one_split_model_it_fits(text, model, offers, want):
    if want in offers:
        assert resolve_share(text, model, offers) == offers[want]
        return
    with pytest.raises(ValueError) as e:
        resolve_share(text, model, offers)
    assert want in str(e.value)


@pytest.mark.parametrize(
    "setting, why",
    [
        ({"Nope": 4}, "c.GpuHub.gpu_slices: no GPU here is of model 'Nope' (the models here: A100)"),
        ({"A100": 3}, "c.GpuHub.gpu_slices['A100'] = 3: 40960 MiB does not divide into 3 equal slices"),
    ],
)
def test_the_hub_and_broker_refuse_a_bad_slice_setting_when_they_open_the_ledger(tmp_path, setting, why):
    from spawner.settings import GpuHub

    hub = GpuHub(
        db_url=f"sqlite:///{tmp_path / 'gpuhub.sqlite'}",
        inventory="simulated",
        simulated_gpus=[{"node": "n1", "count": 2, "model": "A100", "memory_mib": 40960}],
        gpu_slices=setting,
    )
    with pytest.raises(ValueError) as e:
        hub.open_ledger()  # what the hub's spawner and the broker call at start
    assert why in str(e.value)


T = [f"t{i}" for i in range(5)]  # times, in order


@pytest.mark.parametrize(
    "frees, waiting, want",
    [
        ([], 2, [None, None]),  # nothing held ends: no estimate
        ([(T[2], "guess", 1), (T[1], "limit", 1)], 3, [(T[1], "guess"), (T[2], "guess"), None]),
        ([(T[3], "default", 4)], 2, [(T[3], "default")] * 2),  # a whole GPU frees four quarters
        ([(T[0], "firm", 1)], 0, []),
    ],
)
def test_waiting_slices_expect_the_slices_held_to_end_one_each_in_order(frees, waiting, want):
    assert expected_starts(frees, waiting) == want


def test_a_gpu_reserved_for_a_whole_request_is_refilled_only_by_slices_ahead_of_it():
    # GPU 0 has a quarter free and is reserved for the whole request 9
    state = uses((False, (1, 2, 3)), (True, ()))
    waits = {i: SliceWait(i, Q) for i in (1, 2)}
    assert grant_slices([1, 9, 2], waits, [9], state, {9: (A100[0],)}) == {1: slice_gpu(A100[0], 4, 4)}
    assert grant_slices([9, 1, 2], waits, [9], state, {9: (A100[0],)}) == {}  # it drains for 9
