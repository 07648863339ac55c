"""The spawn form's parsing and rendering (spawner/form.py)."""

import pytest

from spawner.form import GpuOptions, options_from_form, parse_count, parse_gpu_options, render_form
from spawner.ledger import Allowance
from spawner.policy import EffectiveLimit, Limit, Refusal


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


def test_render_form_single_model_has_no_select_and_shows_quota():
    a = allowance(effective=EffectiveLimit(Limit(max_gpus=None, gpu_hours=10), "default"), gpu_hours=2.5)
    html = render_form(a, ["A100"], default_gpus=1)
    assert "<select" not in html
    assert "no limit (default)" in html and "2.5</span> of 10 GPU-hours" in html
