"""The spawn form's parsing and rendering (spawner/spawners/form.py)."""

import pytest

from spawner.policy.limits import EffectiveLimit, Limit, Refusal
from spawner.policy.records import Allowance
from spawner.spawners.form import (
    GpuOptions,
    options_from_form,
    parse_count,
    parse_gpu_options,
    render_form,
)


@pytest.mark.parametrize(
    "raw, count",
    [(0, 0), (3, 3), ("2", 2), (" 4 ", 4), ("+1", 1), (2.0, 2), (["3"], 3)],
)
def test_parse_count_accepts(raw, count):
    assert parse_count(raw) == count


@pytest.mark.parametrize(
    "raw, words",
    [
        ("abc", "whole number from 0 to 4096; got 'abc'"),
        ("", "whole number"),
        ("1e3", "whole number"),
        ("9" * 40, "whole number"),  # no giant ints from a form
        (2.5, "whole number"),
        (True, "whole number"),
        (None, "whole number"),
        ({"n": 1}, "whole number"),
        (-1, "from 0 to 4096; got -1"),
        ("-2", "from 0 to 4096; got -2"),
        (4097, "from 0 to 4096; got 4097"),
        (10**400, "more than 60 digits"),
        (float("nan"), "got nan"),
        ("\uff11", "whole number"),  # a full-width one
        (["1", "2"], "one value per option"),
        ("+-1", "whole number"),
        ("-+2", "whole number"),
        ("\u00b2", "whole number"),  # a superscript two is a digit to str.isdigit, not to us
        ("\u0663", "whole number"),  # an Arabic-Indic three
    ],
)
def test_parse_count_refuses(raw, words):
    with pytest.raises(Refusal) as err:
        parse_count(raw)
    assert err.value.reason == "bad_request" and words in err.value.message


@pytest.mark.parametrize(
    "options, expected",
    [
        (None, GpuOptions(1)),  # the default count
        ({}, GpuOptions(1)),
        ({"gpus": "2"}, GpuOptions(2)),
        ({"gpus": 2, "gpu_model": "A100"}, GpuOptions(2, "A100")),
        ({"gpus": 2, "gpu_model": ""}, GpuOptions(2, None)),
    ],
)
def test_parse_gpu_options(options, expected):
    assert parse_gpu_options(options, default_gpus=1) == expected


def test_unknown_options_are_named():
    with pytest.raises(Refusal, match="Unknown options 'a', 'b'"):
        parse_gpu_options({"gpus": 1, "b": 1, "a": 2}, default_gpus=1)


def test_options_from_form_drops_xsrf_and_unwraps():
    assert options_from_form({"gpus": ["2"], "_xsrf": ["t"], "x": ["1", "2"]}) == {
        "gpus": "2",
        "x": ["1", "2"],
    }


def allowance(**kw):
    base = dict(
        effective=EffectiveLimit(Limit(max_gpus=2), "group <students>"),
        held=1,
        gpu_hours=0.0,
        may_take=1,
        total=4,
        free=3,
        free_by_model={"A100": 2, "V100": 1},
        fits=1,
    )
    return Allowance(**{**base, **kw})


def test_render_form_shows_free_allowance_and_escapes():
    html = render_form(allowance(), ["A100", "V100"], default_gpus=2)
    assert '<span data-gpuhub="free">3</span> of <span data-gpuhub="total">4</span>' in html
    assert '<span data-gpuhub="held">1</span>' in html and '<span data-gpuhub="fits">1</span>' in html
    assert "group &lt;students&gt;" in html and "<students>" not in html
    assert 'value="1"' in html  # default 2 capped at what fits
    assert '<option value="V100">V100 (1 free)</option>' in html
    assert 'class="form-control"' in html and 'class="form-select"' in html


@pytest.mark.parametrize(
    "may_take, fits, default, value, says",
    [
        # the limit's room and what can start now are two facts, said apart, never contradicting
        (
            2,
            0,
            1,
            1,
            'your limit lets you hold 2 more GPUs; <span data-gpuhub="fits">0</span> can start now, '
            "so a request of up to 2 waits in the queue",
        ),
        (2, 0, 3, 2, "so a request of up to 2 waits in the queue"),  # the default capped by the limit
        (
            2,
            1,
            2,
            2,
            'your limit lets you hold 2 more GPUs; <span data-gpuhub="fits">1</span> can start now, so a '
            "request of up to 1 starts at once and one of up to 2 waits in the queue",
        ),
        (1, 1, 2, 1, "your limit lets you hold 1 more GPU, and it is free now"),  # nothing waits
        (2, 2, 2, 2, "your limit lets you hold 2 more GPUs, and they are free now"),
        (0, 0, 1, 0, "your limit lets you hold no more GPUs."),  # at the limit: nothing to wait for
    ],
)
def test_the_form_says_the_limits_room_and_what_can_start_now_apart(may_take, fits, default, value, says):
    html = render_form(allowance(may_take=may_take, fits=fits), ["A100"], default_gpus=default)
    assert f'value="{value}"' in html
    assert says in html, html
    assert ("waits in the queue" in html) is (fits < may_take)
    assert "you may take" not in html and "GPU(s)" not in html


def test_the_form_keeps_the_count_of_a_refused_start():
    """Shown again after a refusal, the field holds what the user asked, not the default."""
    a = allowance(
        effective=EffectiveLimit(Limit(max_gpus=3), "user alice"), held=0, may_take=3, fits=0, free=0
    )
    html = render_form(a, ["A100"], default_gpus=1, asked=4)
    assert 'value="4"' in html
    assert "your limit lets you hold 3 more GPUs;" in html and "up to 3 waits in the queue" in html


def test_render_form_single_model_has_no_select_and_shows_quota():
    a = allowance(effective=EffectiveLimit(Limit(max_gpus=None, gpu_hours=10), "default"), gpu_hours=2.5)
    html = render_form(a, ["A100"], default_gpus=1)
    assert "<select" not in html
    assert "with no limit (default)" in html and "2.5</span> of 10 GPU-hours" in html


# ---- borrowing beyond the limit -----------------------------------------------------------


def lender(**kw):
    """alice: limit 1 (default), holding nothing, a borrowing allowance of 2, 4 GPUs free."""
    base = dict(
        effective=EffectiveLimit(Limit(max_gpus=1), "default"),
        held=0,
        gpu_hours=0.0,
        may_take=1,
        total=4,
        free=4,
        free_by_model={"A100": 4},
        fits=1,
        borrow_allowance=2,
        borrowed=0,
        waiting=0,
        may_borrow_now=2,
    )
    return Allowance(**{**base, **kw})


@pytest.mark.parametrize(
    "facts, grace, shown",
    [
        # free GPUs, nobody waits: how many now, and how many in all for this server
        (
            {},
            5,
            [
                'data-why="free"',
                'You may also borrow <span data-gpuhub="may-borrow">2</span> GPUs beyond your limit',
                'up to <span data-gpuhub="most">3</span> for this server',
                "your borrowing allowance is 2 GPUs",
                "with 5 seconds' notice",
                "the server is then stopped",
            ],
        ),
        (
            {"may_borrow_now": 1, "free": 2, "fits": 1},
            60,
            ['<span data-gpuhub="may-borrow">1</span> GPU beyond', "with 60 seconds' notice"],
        ),
        ({}, 300, ["with 5 minutes' notice"]),
        ({}, 60 * 60, ["with 60 minutes' notice"]),
        ({}, 3 * 3600, ["with 3 hours' notice"]),
        ({}, 1, ["with 1 second's notice"]),
        ({}, 0, ["without notice"]),
        ({}, None, ["with notice"]),
        # why none can be borrowed now
        (
            {"may_borrow_now": 0, "waiting": 1, "free": 1},
            5,
            [
                'data-why="waiting"',
                'You may borrow up to 2 GPUs beyond your limit, but <span data-gpuhub="may-borrow">0</span>',
                "1 request waits for GPUs, and GPUs are lent beyond a limit only while nobody waits",
            ],
        ),
        ({"may_borrow_now": 0, "waiting": 3}, 5, ["3 requests wait for GPUs"]),
        (
            {"may_borrow_now": 0, "held": 3, "borrowed": 2, "may_take": 0, "fits": 0, "free": 1},
            5,
            ['data-why="allowance"', "you already borrow 2 GPUs, all of your borrowing allowance"],
        ),
        (
            {
                "may_borrow_now": 0,
                "effective": EffectiveLimit(Limit(max_gpus=1, gpu_hours=10), "default"),
                "gpu_hours": 10.0,
                "held": 1,
                "may_take": 0,
                "fits": 0,
            },
            5,
            ['data-why="quota"', "your GPU-hours for this period are used up"],
        ),
        ({"may_borrow_now": 0, "free": 0, "fits": 0}, 5, ['data-why="none_free"', "now: no GPU is free."]),
        (
            {"may_borrow_now": 0, "free": 1, "fits": 1},
            5,
            ['data-why="none_free"', "no GPU is free beyond what your limit leaves you"],
        ),
    ],
)
def test_the_form_says_what_can_be_borrowed_now_and_why_not(facts, grace, shown):
    html = render_form(lender(**facts), ["A100"], default_gpus=1, grace_seconds=grace)
    for words in shown:
        assert words in html, (words, html)
    assert html.count('data-gpuhub="borrow"') == 1
    assert "can be taken back when a request within its limit needs them" in html


@pytest.mark.parametrize(
    "facts",
    [
        {"borrow_allowance": 0, "may_borrow_now": 0},  # no allowance: not a word of borrowing
        {"effective": EffectiveLimit(Limit(max_gpus=None), "default"), "may_take": None},  # no limit
    ],
)
def test_the_form_says_nothing_of_borrowing_without_an_allowance(facts):
    html = render_form(lender(**facts), ["A100"], default_gpus=1, grace_seconds=5)
    assert "borrow" not in html and "taken back" not in html


@pytest.mark.parametrize(
    "facts",
    [{}, {"may_borrow_now": 0, "waiting": 1}, {"held": 3, "borrowed": 2, "may_take": 0, "fits": 0}],
)
def test_the_count_is_not_capped_below_what_may_be_borrowed(facts):
    """The count has no max: the limit and the allowance are the server's call (its refusal
    says why), so a borrowable count is never blocked by the browser."""
    html = render_form(lender(**facts), ["A100"], default_gpus=3, grace_seconds=5)
    assert " max=" not in html and 'min="0"' in html
