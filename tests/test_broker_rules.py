"""Pure parts of the broker: who may do what, and request-body checks (table tests)."""

import pytest

from spawner.broker.access import Caller, has_scope, is_admin, may_manage_own, may_read_metrics, may_see
from spawner.broker.requests import (
    BadRequest,
    BurstRequest,
    parse_burst_request,
    parse_json_object,
    parse_limit_body,
    parse_renew,
)

ALICE = Caller("alice", "user", frozenset({"custom:gpuhub:allocations!user=alice"}))
ADMIN = Caller("root", "user", frozenset({"custom:gpuhub:admin"}))
NOBODY = Caller("eve", "user", frozenset({"read:users:name!user=eve"}))
FORGED = Caller("eve", "user", frozenset({"custom:gpuhub:allocations!user=alice"}))  # not her own
SERVICE = Caller("prom", "service", frozenset({"read:metrics"}))


@pytest.mark.parametrize(
    "caller, own, sees_alice, sees_bob, admin, metrics",
    [
        (ALICE, True, True, False, False, False),
        (ADMIN, True, True, True, True, True),
        (NOBODY, False, False, False, False, False),
        (FORGED, False, False, False, False, False),
        (SERVICE, False, False, False, False, True),
    ],
)
def test_access(caller, own, sees_alice, sees_bob, admin, metrics):
    assert may_manage_own(caller) == own
    assert may_see(caller, "alice") == sees_alice
    assert may_see(caller, "bob") == sees_bob
    assert is_admin(caller) == admin
    assert may_read_metrics(caller) == metrics


def test_has_scope_filters():
    assert has_scope({"x"}, "x", "anyone")
    assert has_scope({"x!user=a"}, "x", "a") and not has_scope({"x!user=a"}, "x", "b")
    assert not has_scope({"x!user=a"}, "x")


@pytest.mark.parametrize(
    "body, expected",
    [
        ({"gpus": 2}, BurstRequest(2)),
        ({"gpus": 4, "nodes": 2, "gpus_per_node": 2}, BurstRequest(4, 2, 2)),
        ({"gpus": 1, "gpu_model": "", "lease_seconds": 60}, BurstRequest(1, lease_seconds=60.0)),
        ({"gpus": 1, "nodes": 1, "node": "gpu1"}, BurstRequest(1, 1, node="gpu1")),  # beside a server's
    ],
)
def test_parse_burst_request(body, expected):
    assert parse_burst_request(body, max_lease_seconds=3600) == expected


@pytest.mark.parametrize(
    "body, words",
    [
        ({"gpus": 3, "gpus_per_node": 2}, "multiple"),
        ({"gpus": 4, "nodes": 3, "gpus_per_node": 1}, "must equal 'gpus'"),
        ({"gpus": 1, "lease_seconds": 7200}, "'lease_seconds' must be a number from 10 to 3600 seconds"),
        ({"gpus": 1, "nodes": 0}, "'nodes' must be a whole number from 1 to 4096; got 0"),
        (
            {"gpus": 2, "nodes": 2, "node": "gpu1"},
            "'node' puts every GPU on one node; 'nodes' must then be 1",
        ),
        ({"gpus": 1, "node": 7}, "'node' must be a name"),
        ({"gpus": 1, "node": " "}, "'node' must be a node's name"),
    ],
)
def test_parse_burst_request_refuses(body, words):
    with pytest.raises(BadRequest, match=words):
        parse_burst_request(body, max_lease_seconds=3600)


def test_parse_json_object_and_renew_and_limit():
    assert parse_json_object(b"") == {}
    with pytest.raises(BadRequest, match="at most 10"):
        parse_json_object(b"{}" * 10, max_bytes=10)
    assert parse_renew({}, max_lease_seconds=60) is None
    with pytest.raises(BadRequest, match="Unknown field"):
        parse_renew({"gpus": 1}, max_lease_seconds=60)
    lim = parse_limit_body({"max_gpus": None, "gpu_hours": 5}, 168)
    assert (lim.max_gpus, lim.gpu_hours, lim.window_hours) == (None, 5.0, 168)


def test_enable_broker_passes_the_settings_to_the_service_as_json():
    import json

    from traitlets.config import Config

    from spawner.broker import enable_broker

    c = Config()
    c.GpuReclaim.exempt_users = {"bob", "alice"}
    c.GpuHub.default_limit = 2
    c.Authenticator.admin_users = {"root"}
    enable_broker(c)
    [service] = c.JupyterHub.services
    settings = json.loads(service["environment"]["GPUHUB_SETTINGS"])
    assert settings["GpuReclaim"]["exempt_users"] == ["alice", "bob"]
    assert settings["GpuHub"]["default_limit"] == 2
    # something the service could not get as JSON is refused, not passed on as its repr
    c.GpuHub.db_url = object()
    with pytest.raises(TypeError, match="cannot be passed to the broker service"):
        enable_broker(c)
