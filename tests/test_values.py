"""Every parser of input, fuzzed (Hypothesis, fixed seed, bounded examples) and with the
regressions a fuzz of the demo found (issue 12) as explicit examples.

The properties: a parser either returns a value inside its documented range or refuses
with its own error naming the field; nothing else escapes (no ``OverflowError``,
``RecursionError``, ``ValueError`` of int digits); and no value that is accepted can later
make a request fail (a limit the API, CLI or traits take is one the policy can use).
"""

import io
import json
import math
import string
from contextlib import redirect_stderr, redirect_stdout
from datetime import datetime

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from spawner import cli, policy
from spawner.broker import requests as schemas
from spawner.ledger import Ledger
from spawner.policy import values
from spawner.policy.limits import Holdings, Limit, Refusal
from spawner.policy.placement import Gpu, Request
from spawner.settings import parse_limit
from spawner.spawners import form

FUZZ = settings(
    max_examples=150,
    derandomize=True,  # a fixed seed: CI and every developer see the same examples
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
NOW = datetime(2026, 12, 1, 12, 0)

# anything a JSON body, a form or a command line can carry, and worse
huge_ints = st.integers(min_value=-(10**500), max_value=10**500)
weird_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "",
            " ",
            "nan",
            "inf",
            "-inf",
            "-0",
            "+0",
            "1e400",
            "\u00b2",
            "\u0663",
            "\uff11",
            "1" + "0" * 400,
            "2026-11-01",
            "7d",
            "0x10",
            "1_000",
            "٣",
            "  3  ",
            "+-1",
        ]
    ),
    st.from_regex(r"[+-]?[0-9]{1,20}(\.[0-9]{0,5})?([eE][+-]?[0-9]{1,4})?", fullmatch=True),
)
anything = st.one_of(
    st.none(),
    st.booleans(),
    huge_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    weird_text,
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), huge_ints, st.floats(allow_nan=False), st.text(max_size=10)),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)


def json_object(keys):
    return st.dictionaries(st.one_of(st.sampled_from(keys), st.text(max_size=6)), json_values, max_size=5)


# the parsers ---------------------------------------------------------------------------


@FUZZ
@given(anything)
@example(True)
@example(10**4400)
@example("\u00b2")
@example(float("nan"))
def test_parse_count_takes_a_whole_number_in_range_or_names_the_field(raw):
    try:
        n = values.parse_count(raw, "--gpus", lo=1, hi=4096)
    except values.BadValue as e:
        assert str(e).startswith("--gpus must be a whole number from 1 to 4096; got ")
        return
    assert type(n) is int and 1 <= n <= 4096
    assert not isinstance(raw, bool)


@FUZZ
@given(anything)
@example(10**400)
@example(float("inf"))
@example("-0")
@example("1e400")
def test_parse_number_takes_a_finite_number_in_range_or_names_the_field(raw):
    try:
        x = values.parse_number(raw, "'lease_seconds'", lo=10, hi=3600, unit="seconds")
    except values.BadValue as e:
        assert str(e).startswith("'lease_seconds' must be a number from 10 to 3600 seconds; got ")
        return
    assert type(x) is float and math.isfinite(x) and 10 <= x <= 3600


@pytest.mark.parametrize("raw", ["-0", -0.0, "0", 0])
def test_minus_zero_is_zero(raw):
    assert math.copysign(1, values.parse_number(raw, "x", lo=0, hi=1)) == 1.0


@FUZZ
@given(
    st.one_of(
        weird_text,
        st.datetimes().map(datetime.isoformat),
        st.datetimes().map(lambda d: d.isoformat() + "+01:00"),
    )
)
@example("0001-01-01T00:00+01:00")
@example("9999-12-31T23:59-01:00")
@example("9999-12-31T00:00")
@example("99999999d")
def test_parse_timestamp_is_naive_utc_in_range_or_names_the_field(raw):
    try:
        when = values.parse_timestamp(raw, "'since'", NOW)
    except values.BadValue as e:
        assert str(e).startswith("'since' must be a date (2026-11-01)")
        return
    assert when.tzinfo is None and values.EARLIEST <= when <= values.LATEST


@FUZZ
@given(st.datetimes(min_value=values.EARLIEST, max_value=values.LATEST))
def test_a_timestamp_in_range_reads_back_as_itself(when):
    assert values.parse_timestamp(when.isoformat(), "t", NOW) == when


@FUZZ
@given(st.one_of(st.text(max_size=300), anything))
@example("bo,b")
@example("a=b")
@example("alice\n")
def test_parse_name_never_passes_a_separator(raw):
    try:
        name = values.parse_name(raw, "--user")
    except values.BadValue as e:
        assert str(e).startswith("--user must be a user or group name")
        return
    assert 1 <= len(name) <= 255 and not set(name) & set(",=/\\:;\"' \t\n\r")


@pytest.mark.parametrize("name", ["alice", "bob.smith", "j-doe_2", "ana@lab", "Zoë", "研究者"])
def test_ordinary_names_pass(name):
    assert values.parse_name(name, "--user") == name


# the broker's bodies --------------------------------------------------------------------

ARRAYS = b"[" * 5000 + b"]" * 5000


@FUZZ
@given(st.binary(max_size=200))
@example(ARRAYS)
@example(b'{"gpus": 1' + b"0" * 4400 + b"}")
@example(b'{"gpus": NaN}')
@example(b'{"lease_seconds": Infinity}')
@example(b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}")
@example(b"\xff\xfe")
def test_a_body_is_an_object_or_a_bad_request(body):
    try:
        value = schemas.parse_json_object(body)
    except schemas.BadRequest:
        return
    assert isinstance(value, dict)


BURST_KEYS = ["gpus", "nodes", "gpus_per_node", "gpu_model", "lease_seconds"]
SAMPLE_KEYS = ["gpus", "idle_seconds", "source"]
LIMIT_KEYS = ["max_gpus", "gpu_hours", "window_hours"]


@FUZZ
@given(json_object(BURST_KEYS))
@example({"gpus": 1, "lease_seconds": 10**400})
@example({"gpus": 10**400})
def test_burst_requests_are_valid_or_refused(body):
    try:
        req = schemas.parse_burst_request(body, max_lease_seconds=3600)
    except schemas.BadRequest as e:
        assert str(e)
        return
    assert 1 <= req.gpus <= policy.MAX_COUNT
    assert req.lease_seconds is None or 10 <= req.lease_seconds <= 3600


@FUZZ
@given(json_object(["lease_seconds", "idle_seconds"]))
@example({"lease_seconds": 10**400})
@example({"idle_seconds": 1e308})
def test_renewals_are_valid_or_refused(body):
    try:
        seconds = schemas.parse_renew(body, max_lease_seconds=3600)
        idle = schemas.parse_activity(body)
    except schemas.BadRequest:
        return
    assert seconds is None or 10 <= seconds <= 3600
    assert idle is None or 0 <= idle <= schemas.MAX_IDLE_SECONDS


@FUZZ
@given(
    st.one_of(
        json_object(SAMPLE_KEYS),
        st.builds(
            lambda gpus: {"gpus": gpus},
            st.lists(json_object(["node", "index", "utilization", "memory_used_mib"]), max_size=3),
        ),
    )
)
@example({"gpus": [{"node": "n", "index": 0, "utilization": 10**400}]})
def test_samples_are_valid_or_refused(body):
    try:
        report = schemas.parse_samples(body)
    except schemas.BadRequest:
        return
    for s in report.samples:
        assert 0 <= s.utilization <= 100 and s.index >= 0


@FUZZ
@given(json_object(LIMIT_KEYS))
@example({"max_gpus": 2, "gpu_hours": 10**400})
@example({"max_gpus": 2, "gpu_hours": -0.0})
@example({"max_gpus": 2, "window_hours": 1e308})
def test_an_accepted_limit_body_is_one_the_policy_can_use(body):
    try:
        lim = schemas.parse_limit_body(body, policy.DEFAULT_WINDOW_HOURS)
    except schemas.BadRequest:
        return
    assert_usable(Limit(lim.max_gpus, lim.gpu_hours, lim.window_hours))


# the form, the traits and the CLI ---------------------------------------------------------


@FUZZ
@given(st.dictionaries(st.sampled_from(["gpus", "gpu_model", "partition", "x"]), anything, max_size=3))
@example({"gpus": "\u00b2"})
@example({"gpus": 10**400})
@example({"gpus": "1", "gpu_model": "\x00"})
def test_user_options_are_options_or_a_bad_request_refusal(options):
    try:
        opts = form.parse_gpu_options(options, default_gpus=1, partitions=["gpu"])
    except Refusal as e:
        assert e.reason == "bad_request" and e.status_code == 400
        return
    assert 0 <= opts.count <= policy.MAX_COUNT


@FUZZ
@given(st.one_of(anything, st.fixed_dictionaries({}, optional={k: anything for k in LIMIT_KEYS})))
@example({"gpu_hours": float("inf")})
@example({"window_hours": float("nan")})
def test_a_limit_trait_is_usable_or_refused_naming_the_trait(value):
    try:
        lim = parse_limit(value, "c.GpuHub.default_limit")
    except ValueError as e:
        assert str(e).startswith("c.GpuHub.default_limit: ")
        return
    assert_usable(lim)


def assert_usable(lim: Limit) -> None:
    """The policy decides with this limit: every answer is a grant or a Refusal."""
    assert policy.limit_problem(lim) is None
    eff = policy.EffectiveLimit(lim, "fuzz")
    inv = [Gpu("n1", i) for i in range(4)]
    hours = policy.gpu_hours_used([(NOW.replace(hour=0), None, 2)], NOW, lim.window_hours)
    policy.remaining(eff, Holdings(held=1, gpu_hours=hours))
    try:
        policy.check_request(Request("u", 1), eff, Holdings(1, hours), inv, inv[:2])
    except Refusal:
        pass


@pytest.fixture(scope="module")
def ledger_url(tmp_path_factory):
    url = f"sqlite:///{tmp_path_factory.mktemp('cli') / 'gpuhub.sqlite'}"
    Ledger(url).close()
    return url


def read_ledger(url: str, method: str):
    led = Ledger(url)
    try:
        return getattr(led, method)()
    finally:
        led.close()


CLI_VALUES = st.one_of(weird_text, st.sampled_from(["unlimited", "2", "0", "4096", "4097"]))


@FUZZ
@given(
    count=CLI_VALUES,
    hours=st.one_of(st.none(), CLI_VALUES),
    window=st.one_of(st.none(), CLI_VALUES),
    name=st.one_of(st.just("bob"), st.text(min_size=1, max_size=8)),
)
@example(count="2", hours="10", window="inf", name="bob")
@example(count="2", hours="-0", window=None, name="bob")
@example(count="2", hours="nan", window=None, name="bob")
@example(count="\u00b2", hours=None, window=None, name="bob")
def test_the_cli_sets_a_usable_limit_or_says_why_in_one_line(ledger_url, count, hours, window, name):
    argv = ["--db-url", ledger_url, "limits", "set", "--user", name, count]
    argv += ["--gpu-hours", hours] if hours is not None else []
    argv += ["--window-hours", window] if window is not None else []
    before = read_ledger(ledger_url, "limit_entries")
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's own refusal of an option value
            code = e.code
    if code == 0:
        rules = read_ledger(ledger_url, "rules")
        assert_usable(rules.users[name])
        return
    assert code == 2 and "Traceback" not in err.getvalue()
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    assert lines and lines[-1].startswith(("gpuhub: error: ", "gpuhub limits set: error: ")), err.getvalue()
    assert read_ledger(ledger_url, "limit_entries") == before  # a refusal writes nothing


# a limit already stored that the policy cannot use ---------------------------------------


@pytest.mark.parametrize(
    "column, value",
    # SQLite stores NaN as NULL, and a CHECK keeps max_gpus >= 0: these are what it can hold
    [("window_hours", math.inf), ("window_hours", 1e12), ("gpu_hours", -1.0), ("gpu_hours", math.inf)],
)
def test_a_stored_limit_the_policy_cannot_use_is_ignored_with_a_warning(tmp_path, caplog, column, value):
    url = f"sqlite:///{tmp_path / 'gpuhub.sqlite'}"
    led = Ledger(url, config_rules=policy.LimitRules(users={"bob": Limit(max_gpus=2)}))
    led.sync_inventory([Gpu("n1", i) for i in range(4)])
    led.set_limit("user", "bob", Limit(max_gpus=1, gpu_hours=5))
    # an older version, or a direct write, stored what no parser would take today
    import sqlalchemy as sa

    with led.engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE limits SET {column} = :v WHERE name = 'bob'"), {"v": value})
    caplog.set_level("WARNING", logger="gpuhub.ledger")
    allowance = led.allowance("bob")  # the trait's limit for bob, not a 500
    assert allowance.effective.limit == Limit(max_gpus=2) and allowance.effective.source == "user bob"
    a = led.allocate("bob", [], 2, purpose="server")
    assert len(a.gpus) == 2
    assert "Ignoring the ledger's limit for user 'bob'" in caplog.text
    assert [(s, n) for s, n, _ in led.ignored_limits()] == [("user", "bob")]
    assert all(e.origin == "config" for e in led.limit_entries() if e.name == "bob")
    led.close()


def test_a_large_stored_limit_from_an_older_cli_still_holds(tmp_path):
    """An older CLI stored any count; a limit far above the cluster is an admin's "plenty"."""
    url = f"sqlite:///{tmp_path / 'gpuhub.sqlite'}"
    led = Ledger(url)
    led.sync_inventory([Gpu("n1", i) for i in range(4)])
    led.set_limit("user", "bob", Limit(max_gpus=1))
    import sqlalchemy as sa

    with led.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE limits SET max_gpus = :v, window_hours = 10000 WHERE name = 'bob'"), {"v": 10**12}
        )
    assert led.allowance("bob").effective.limit.max_gpus == 10**12 and led.ignored_limits() == []
    assert len(led.allocate("bob", [], 3, purpose="server").gpus) == 3
    led.close()


def test_the_options_a_message_quotes_are_short_and_printable():
    for raw in (10**5000, "x" * 10_000, float("nan"), b"bytes", object()):
        shown = values.show(raw)
        assert len(shown) <= 64 and all(c in string.printable for c in shown)


def test_json_examples_from_the_fuzz_are_refused_with_the_reason():
    cases = {
        json.dumps({"gpus": 1}).replace("1", "1" + "0" * 4400).encode(): "at most 30 are accepted",
        ARRAYS: "nested too deeply",
        b'{"gpus": NaN}': "not a JSON number",
    }
    for body, words in cases.items():
        with pytest.raises(schemas.BadRequest, match=words):
            schemas.parse_json_object(body)
    with pytest.raises(schemas.BadRequest, match="'lease_seconds' must be a number from 10 to 3600"):
        schemas.parse_burst_request({"gpus": 1, "lease_seconds": 10**400}, max_lease_seconds=3600)


# the magics' options ----------------------------------------------------------------------


def _magic(name):
    from IPython.core import magic_arguments

    from gpu_magics.dask.magic import DaskMagics
    from gpu_magics.kernel.distributed import DistributedMagics

    owner = DistributedMagics if name == "distributed" else DaskMagics
    return magic_arguments, getattr(owner, name)


@FUZZ
@given(option=st.sampled_from(["--gpus", "--nodes", "--gpus-per-node", "--timeout"]), value=weird_text)
@example(option="--gpus", value="\u00b2")
@example(option="--timeout", value="nan")
@example(option="--timeout", value="1e400")
@example(option="--gpus", value="1" + "0" * 5000)
def test_distributed_options_are_in_range_or_a_usage_error(option, value):
    from IPython.core.error import UsageError

    magic_arguments, fn = _magic("distributed")
    try:
        args = magic_arguments.parse_argstring(fn, f"{option} {value!r}" if value.strip() else option)
    except UsageError as e:
        assert "Traceback" not in str(e)
        return
    got = getattr(args, option.lstrip("-").replace("-", "_"))
    if option == "--timeout":
        assert 0.1 <= got <= 7 * 86400 and math.isfinite(got)
    else:
        assert 1 <= got <= policy.MAX_COUNT


@pytest.mark.parametrize("line", ["--gpus 0", "--gpus \u00b2", "--workers -1", "--workers 1e400"])
def test_dask_options_out_of_range_are_a_usage_error(line):
    from IPython.core.error import UsageError

    magic_arguments, fn = _magic("dask_cuda")
    with pytest.raises(UsageError, match="must be a whole number from 1 to 4096"):
        magic_arguments.parse_argstring(fn, line)
