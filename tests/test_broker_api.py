"""The broker's REST API against a real hub, proxy and service: access, bursts, bad input.

Every response is validated against spawner/broker/openapi.yaml. Actors: alice (limit 3),
bob (group students, limit 2), admin (the gpuhub-admin role), alice's notebook server (its
own JUPYTERHUB_API_TOKEN, read from the running process) and a token of alice narrowed to
no gpuhub scope.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse

import spawner.broker
from spawner.ledger import Ledger

from .hubtools import Hub, wait_for

pytestmark = pytest.mark.hub

SPEC = OpenAPI.from_file_path(str(Path(spawner.broker.__file__).with_name("openapi.yaml")))


def checked(r):
    """The response, after validating it (and its request) against the OpenAPI file."""
    req = RequestsOpenAPIRequest(r.request)
    # the spec's server is relative (/services/gpuhub/api/v1): match on the path
    SPEC.validate_response(req, RequestsOpenAPIResponse(r))
    return r


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    # few reports per minute, so that the flood test needs only a few requests
    h = Hub(tmp_path_factory.mktemp("broker"), extra_config="c.GpuReclaim.reports_per_gpu_minute = 5").start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return {
        "alice": hub.user_token("alice"),
        "bob": hub.user_token("bob"),
        "admin": hub.user_token("admin"),
        "narrow": hub.user_token("alice", scopes=["read:users:name!user=alice"]),
    }


@pytest.fixture
def ledger(hub):
    led = Ledger(hub.ledger_url)
    yield led
    for a in led.active():
        if a.purpose == "distributed":
            led.release(a.id, "test cleanup")
    led.close()


@pytest.fixture
def alice_server(hub, ledger):
    """alice's running server with 1 GPU, and its own API token."""
    assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
    hub.wait_ready("alice")
    yield hub.server_env("alice")["JUPYTERHUB_API_TOKEN"]
    hub.stop_server("alice")


def snapshot(ledger):
    return (
        [(a.id, a.state, a.lease_expires) for a in ledger.active()],
        [(e.scope, e.name, e.limit, e.origin) for e in ledger.limit_entries()],
    )


def test_the_server_token_has_exactly_the_magics_scope(hub, alice_server):
    me = hub.api("GET", "/user", headers={"Authorization": f"token {alice_server}"}).json()
    assert me["name"] == "alice"
    # JupyterHub's server defaults, plus gpuhub's two; the read:users:* ones are what
    # users:activity implies. No admin scope, nothing about other users.
    assert sorted(me["scopes"]) == [
        "access:servers!server=alice/",
        "access:services!service=gpuhub",
        "custom:gpuhub:allocations!user=alice",
        "read:users:activity!user=alice",
        "read:users:groups!user=alice",
        "read:users:name!user=alice",
        "users:activity!user=alice",
    ]


def test_access_matrix(hub, tokens, ledger, alice_server):
    tokens = {**tokens, "server": alice_server}
    burst = checked(hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 1}))
    assert burst.status_code == 201
    aid = burst.json()["id"]
    cells = [
        # (method, path, body, {actor: expected status})
        ("GET", "me", None, {"alice": 200, "bob": 200, "admin": 200, "server": 200, "narrow": 403}),
        (
            "GET",
            f"allocations/{aid}",
            None,
            {"alice": 200, "bob": 404, "admin": 200, "server": 200, "narrow": 403},
        ),
        ("GET", "allocations", None, {"alice": 200, "bob": 200, "server": 200, "narrow": 403}),
        ("GET", "allocations?user=alice", None, {"alice": 200, "bob": 403, "admin": 200, "narrow": 403}),
        ("GET", "allocations?all=1", None, {"alice": 403, "bob": 403, "server": 403, "admin": 200}),
        ("POST", f"allocations/{aid}/renew", {}, {"bob": 404, "narrow": 403, "alice": 200, "server": 200}),
        ("DELETE", f"allocations/{aid}", None, {"bob": 404, "narrow": 403}),
        ("GET", "usage", None, {"alice": 200, "server": 200, "narrow": 403}),
        ("GET", "usage?user=alice", None, {"alice": 200, "bob": 403, "admin": 200}),
        ("GET", "usage?user=bob", None, {"alice": 403, "server": 403, "admin": 200}),
        ("GET", "limits", None, {"alice": 403, "bob": 403, "server": 403, "narrow": 403, "admin": 200}),
        (
            "PUT",
            "limits/user/alice",
            {"max_gpus": 9},
            {"alice": 403, "bob": 403, "server": 403, "narrow": 403},
        ),
        ("DELETE", "limits/group/students", None, {"alice": 403, "server": 403}),
        ("GET", "cluster", None, {"alice": 403, "bob": 403, "server": 403, "narrow": 403, "admin": 200}),
    ]
    for method, path, body, expected in cells:
        for actor, status in expected.items():
            before = snapshot(ledger)
            r = hub.broker(method, path, tokens[actor], json=body)
            assert r.status_code == status, (method, path, actor, r.text)
            checked(r)
            if status >= 400:
                assert r.json()["message"]
                assert snapshot(ledger) == before, (method, path, actor)
    # metrics: admins and read:metrics only
    for actor, status in {"alice": 403, "server": 403, "admin": 200}.items():
        r = hub.broker("GET", "../../metrics", tokens[actor])
        assert r.status_code == status, actor
    # the owner and their server may release the burst; it is gone for everyone after
    r = checked(hub.broker("DELETE", f"allocations/{aid}", tokens["server"]))
    assert r.status_code == 200 and r.json()["state"] == "released"
    assert checked(hub.broker("DELETE", f"allocations/{aid}", tokens["alice"])).status_code == 409


def test_a_user_cannot_release_their_servers_allocation_through_the_api(hub, tokens, ledger, alice_server):
    [server] = ledger.active(user="alice", purpose="server")
    r = checked(hub.broker("DELETE", f"allocations/{server.id}", tokens["alice"]))
    assert r.status_code == 409 and "stop the server" in r.json()["message"]
    assert ledger.get(server.id).active


def test_limit_counts_server_and_burst_gpus_together(hub, tokens, ledger):
    assert hub.spawn("alice", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("alice")
    try:
        r = checked(hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 2}))
        assert r.status_code == 403
        body = r.json()
        assert body["reason"] == "over_limit" and body["fits"] == 1
        assert (
            "you hold 2 of a limit of 3 (user alice): your limit lets you hold 1 more GPU" in body["message"]
        )
        ok = checked(hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 1}))
        assert ok.status_code == 201
        me = checked(hub.broker("GET", "me", tokens["alice"])).json()
        assert me["held"] == 3 and me["may_take"] == 0 and len(me["allocations"]) == 2
        # and the spawn form sees the burst too: alice cannot start another server with a GPU
        r = hub.spawn("alice", {"gpus": 1}, name="")  # her server is running: hub refuses 400
        assert r.status_code == 400
    finally:
        hub.stop_server("alice")


def test_a_lease_that_is_not_renewed_expires(hub, tokens, ledger):
    r = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 2, "lease_seconds": 10}))
    assert r.status_code == 201
    aid = r.json()["id"]
    assert {g["index"] for g in r.json()["gpus"]} and ledger.get(aid).active
    wait_for(lambda: not ledger.get(aid).active, 30, "the lease to expire")
    gone = ledger.get(aid)
    assert gone.end_reason == "lease expired" and gone.ended == gone.lease_expires
    assert checked(hub.broker("POST", f"allocations/{aid}/renew", tokens["bob"])).status_code == 409


def test_concurrent_burst_requests_never_over_allocate(hub, tokens, ledger):
    def ask(token):
        return hub.broker("POST", "allocations", token, json={"gpus": 1})

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(ask, [tokens["bob"]] * 6 + [tokens["alice"]] * 6))
    codes = sorted(r.status_code for r in results)
    assert all(c in (201, 403, 409) for c in codes), codes
    assert codes.count(201) == 4  # exactly the 4 GPUs, whoever was first
    bob_got = sum(1 for r in results[:6] if r.status_code == 201)
    alice_got = sum(1 for r in results[6:] if r.status_code == 201)
    assert bob_got <= 2 and alice_got <= 3  # bob: students 2; alice: 3
    held = {st.gpu.label: st.holder.user for st in ledger.gpu_table() if st.holder}
    assert len(held) == 4
    assert sorted(held.values()) == sorted(["bob"] * bob_got + ["alice"] * alice_got)


def test_a_burst_can_be_asked_for_on_one_named_node(hub, tokens, ledger):
    """What a kernel asks for beside its server's GPUs: every GPU on the server's node."""
    [node] = {st.gpu.node for st in ledger.gpu_table()}
    r = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 2, "node": node}))
    assert r.status_code == 201, r.text
    assert {g["node"] for g in r.json()["gpus"]} == {node} and len(r.json()["gpus"]) == 2
    before = snapshot(ledger)
    bad = checked(hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 1, "node": "nowhere"}))
    assert bad.status_code == 400 and "There is no node 'nowhere' with GPUs here." in bad.json()["message"]
    split = checked(
        hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 2, "nodes": 2, "node": node})
    )
    assert split.status_code == 400 and "'nodes' must then be 1" in split.json()["message"]
    assert snapshot(ledger) == before
    checked(hub.broker("DELETE", f"allocations/{r.json()['id']}", tokens["bob"]))


@pytest.mark.parametrize(
    "raw, words",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, not list"),
        (b'"gpus"', "must be a JSON object, not str"),
        (b"{}", "'gpus' is required"),
        (b'{"gpus": "2"}', "'gpus' must be a whole number"),
        (b'{"gpus": true}', "'gpus' must be a whole number"),
        (b'{"gpus": 1.5}', "'gpus' must be a whole number"),
        (b'{"gpus": -1}', "'gpus' must be a whole number from 1 to 4096"),
        (b'{"gpus": 0}', "'gpus' must be a whole number from 1 to 4096"),
        (b'{"gpus": 100000000000000000000}', "'gpus' must be a whole number from 1 to 4096"),
        (b'{"gpus": 1, "priority": "high"}', "Unknown field(s) 'priority'"),
        (b'{"gpus": 1, "lease_seconds": 1}', "'lease_seconds' must be a number from 10"),
        (b'{"gpus": 3, "gpus_per_node": 2}', "must be a multiple"),
        (b'{"gpus": 1, "gpu_model": 7}', "'gpu_model' must be a name"),
        (json.dumps({"gpus": 1, "pad": "x" * 20000}).encode(), "at most 16384 are accepted"),
    ],
)
def test_bad_burst_requests_are_refused_with_a_message(hub, tokens, ledger, raw, words):
    before = snapshot(ledger)
    r = hub.broker(
        "POST", "allocations", tokens["alice"], data=raw, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert words in r.json()["message"]
    assert snapshot(ledger) == before
    if len(raw) < 16384:
        checked(r)


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("limits/user/carol", {"max_gpus": -2}, "'max_gpus' must be a whole number from 0"),
        ("limits/user/carol", {"gpu_hours": 5}, "'max_gpus' is required"),
        ("limits/user/carol", {"max_gpus": 1, "window_hours": 0}, "'window_hours' must be a number from"),
        ("limits/user/carol", {"max_gpus": 1, "colour": "red"}, "Unknown field(s) 'colour'"),
        ("limits/user/a,b", {"max_gpus": 1}, "the user name must be a user or group name"),
        ("limits/group/%20ml", {"max_gpus": 1}, "no space at either end"),
        ("limits/planet/mars", {"max_gpus": 1}, None),  # no such route: 404
    ],
)
def test_bad_limit_requests(hub, tokens, ledger, path, body, words):
    before = snapshot(ledger)
    r = hub.broker("PUT", path, tokens["admin"], json=body)
    assert r.status_code == (404 if words is None else 400), r.text
    if words:
        assert words in r.json()["message"]
        checked(r)
    assert snapshot(ledger) == before


def test_admin_limits_roundtrip_and_win_over_config(hub, tokens, ledger):
    r = checked(hub.broker("PUT", "limits/group/students", tokens["admin"], json={"max_gpus": 1}))
    assert r.status_code == 200 and r.json()["origin"] == "ledger"
    try:
        refused = checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 2}))
        assert refused.status_code == 403 and "limit of 1 (group students)" in refused.json()["message"]
        entries = checked(hub.broker("GET", "limits", tokens["admin"])).json()["limits"]
        assert {
            "scope": "group",
            "name": "students",
            "origin": "ledger",
            "max_gpus": 1,
            "gpu_hours": None,
            "window_hours": 168.0,
        } in entries
    finally:
        assert checked(hub.broker("DELETE", "limits/group/students", tokens["admin"])).status_code == 204
    assert checked(hub.broker("DELETE", "limits/group/students", tokens["admin"])).status_code == 404
    assert checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 2})).status_code == 201


def test_usage_and_cluster_views(hub, tokens, ledger):
    checked(hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 1}))
    cluster = checked(hub.broker("GET", "cluster", tokens["admin"])).json()
    holders = [g["holder"]["user"] for n in cluster["nodes"] for g in n["gpus"] if g["holder"]]
    assert holders == ["bob"] and cluster["free"] == cluster["total"] - 1

    def usage():  # bob's burst has held its GPU long enough to show (GPU-hours, to 4 places)
        got = checked(hub.broker("GET", "usage?since=1d&bucket_hours=6", tokens["admin"])).json()
        return got if got["total"].get("bob", 0) > 0 else None

    got = wait_for(usage, 10, "bob's GPU-hours to show")
    assert len(got["buckets"]) == 4 and "bob" in got["series"]
    bad = checked(hub.broker("GET", "usage?since=yesterday", tokens["admin"]))
    assert bad.status_code == 400 and "'since' must be a date (2026-11-01)" in bad.json()["message"]


def test_metrics_match_the_ledger(hub, tokens, ledger):
    assert hub.spawn("alice", {"gpus": 2}).status_code in (201, 202)
    hub.wait_ready("alice")
    try:
        assert hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 1}).status_code == 201
        refusals_before = _metric(hub, tokens, 'gpuhub_refusals_total{reason="over_limit"}') or 0
        assert hub.broker("POST", "allocations", tokens["bob"], json={"gpus": 2}).status_code == 403
        table = ledger.gpu_table()
        node, model = table[0].gpu.node, table[0].gpu.model
        allocated = sum(1 for st in table if st.holder)
        labels = f'model="{model}",node="{node}"'
        assert _metric(hub, tokens, f'gpuhub_gpus{{{labels},state="allocated"}}') == allocated == 3
        assert _metric(hub, tokens, f'gpuhub_gpus{{{labels},state="free"}}') == len(table) - allocated
        assert _metric(hub, tokens, 'gpuhub_allocations{purpose="server"}') == 1
        assert _metric(hub, tokens, 'gpuhub_allocated_gpus{purpose="distributed"}') == 1
        assert _metric(hub, tokens, 'gpuhub_refusals_total{reason="over_limit"}') == refusals_before + 1
        assert _metric(hub, tokens, "gpuhub_allocation_seconds_count") >= 1
    finally:
        hub.stop_server("alice")


def _metric(hub, tokens, name):
    text = hub.broker("GET", "../../metrics", tokens["admin"]).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def test_the_openapi_check_catches_a_wrong_shape(hub, tokens):
    r = checked(hub.broker("GET", "me", tokens["alice"]))
    body = r.json()
    del body["fits"]
    r._content = json.dumps(body).encode()
    with pytest.raises(Exception, match=r"fits|[Vv]alidat"):
        checked(r)
    # and the spec served by the service is the one in the package
    served = hub.broker("GET", "openapi.yaml", tokens["alice"])
    assert served.status_code == 200
    assert served.text == Path(spawner.broker.__file__).with_name("openapi.yaml").read_text()


@pytest.mark.parametrize(
    "path, status",
    [
        ("usage?since=2026-01-01T00:00:00Z", 200),  # the API's own timestamp format
        ("usage?since=2026-01-01T00:00:00%2B02:00", 200),
        ("usage?since=9999999999d", 400),
        ("usage?since=1d&bucket_hours=0", 400),
        ("allocations/99999999999999999999", 404),
        ("allocations/99999999999999999999/renew", 404),
        ("me?server=", 400),  # a session needs its start
        ("me?server=&since=yesterday", 400),
        ("me?server=&since=1d", 200),
        ("usage?since=1d&format=csv", 200),
    ],
)
def test_odd_queries_are_answered_never_500(hub, tokens, path, status):
    method = "POST" if path.endswith("renew") else "GET"
    r = hub.broker(method, path, tokens["admin"])
    assert r.status_code == status, r.text


def test_nobody_releases_a_running_servers_gpus_through_the_api(hub, tokens, ledger, alice_server):
    [server] = ledger.active(user="alice", purpose="server")
    r = checked(hub.broker("DELETE", f"allocations/{server.id}", tokens["admin"]))
    assert r.status_code == 409 and "stop the server" in r.json()["message"]
    assert ledger.get(server.id).active


def test_a_flood_of_use_reports_is_refused_and_not_stored(hub, tokens, ledger):
    def burst():
        r = checked(hub.broker("POST", "allocations", tokens["alice"], json={"gpus": 1}))
        assert r.status_code == 201, r.text
        return r.json()

    first, second = burst(), burst()

    def report(a, utilization):
        [gpu] = a["gpus"]
        sample = {"node": gpu["node"], "index": gpu["index"], "utilization": utilization}
        return checked(
            hub.broker("POST", f"allocations/{a['id']}/samples", tokens["alice"], json={"gpus": [sample]})
        )

    for u in range(5):  # c.GpuReclaim.reports_per_gpu_minute = 5 (1 GPU)
        assert report(first, 10 + u).status_code == 200
    r = report(first, 99)
    assert r.status_code == 429 and r.json()["reason"] == "too_many_reports", r.text
    assert 1 <= int(r.headers["Retry-After"]) <= 60 and "reports_per_gpu_minute" in r.json()["message"]
    grid = {
        g["holder"]["allocation_id"]: g["reported"]["utilization"]
        for g in hub.broker("GET", "utilization", tokens["alice"]).json()["gpus"]
        if g["holder"] and g["reported"]
    }
    assert grid[first["id"]] == 14.0  # the refused report was not stored (her own, as she sees it)
    assert report(second, 50).status_code == 200  # another allocation has its own rate
    for a in (first, second):
        hub.broker("DELETE", f"allocations/{a['id']}", tokens["alice"])
