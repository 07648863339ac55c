"""The queue for admins and users: the broker's REST API, the GPU admin page and My GPUs in a
real browser (Debian's headless Chromium, driven by Playwright), and the queue's metrics.

A real hub, proxy and broker with the demo's 4 simulated GPUs; alice (limit 3) and carol
(group students, 2) hold them all with bursts, and requests made with ``"wait": true`` join
the queue. Every API answer is validated against spawner/broker/openapi.yaml. Waiting
entries stay alive for 10 minutes without polling here (``queue_keepalive_seconds``), so the
tests poll only where they check what a poll answers.
"""

import re
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import requests
import yaml
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse
from playwright.sync_api import expect

import spawner.broker
from spawner.broker.metrics import WAIT_BUCKETS, QueueWaitCollector
from spawner.policy.records import QueueInfo

from .hubtools import ADMIN_PASSWORD, DEMO_PASSWORD, Hub, tidy_ledger, user_tokens, wait_for

pytestmark = pytest.mark.hub

SPEC = OpenAPI.from_file_path(str(Path(spawner.broker.__file__).with_name("openapi.yaml")))


def checked(r):
    """The response, after validating it against the OpenAPI file."""
    SPEC.validate_response(RequestsOpenAPIRequest(r.request), RequestsOpenAPIResponse(r))
    return r


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("queue"), extra_config="c.GpuHub.queue_keepalive_seconds = 600").start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return user_tokens(hub)


@pytest.fixture
def ledger(hub):
    """The hub's ledger; after each test nothing waits and no burst is held."""
    yield from tidy_ledger(hub)


def burst(hub, token, gpus, **extra):
    return checked(hub.broker("POST", "allocations", token, json={"gpus": gpus, **extra}))


def fill(hub, tokens, ledger):
    """Every GPU held: alice 3, carol 1 (so carol has recent use and dave none)."""
    held = [burst(hub, tokens["alice"], 3), burst(hub, tokens["carol"], 1)]
    assert [r.status_code for r in held] == [201, 201], [r.text for r in held]
    assert all(st.holder for st in ledger.gpu_table())
    return [r.json() for r in held]


def enqueue(hub, token, gpus):
    r = burst(hub, token, gpus, wait=True)
    assert r.status_code == 202, r.text
    return r.json()["queued"]


def queue_ids(hub, tokens, who="admin"):
    return [q["id"] for q in checked(hub.broker("GET", "queue", tokens[who])).json()["queue"]]


def metrics(hub, tokens) -> dict[str, float]:
    text = hub.broker("GET", "../../metrics", tokens["admin"]).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def wait_count(hub, tokens, outcome):
    return metrics(hub, tokens)[f'gpuhub_queue_wait_seconds_count{{outcome="{outcome}"}}']


def login(browser, hub, user, password):
    page = browser.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    return page


ROW_IDS = """(table) => [...document.querySelectorAll(`${table} tbody tr[data-queue-entry]`)]
  .map((r) => Number(r.dataset.queueEntry))"""


def expect_rows(page, table, ids):
    """Wait (Playwright's bounded wait) until the live table lists exactly ``ids``, in order."""
    page.wait_for_function(
        f"([table, ids]) => JSON.stringify(({ROW_IDS})(table)) === JSON.stringify(ids)", arg=[table, ids]
    )


SHOWS_QUEUE = """(queue) => {
  const rows = [...document.querySelectorAll("#queue tbody tr[data-queue-entry]")];
  if (rows.length !== queue.length) return false;
  return queue.every((q, i) => {
    const r = rows[i];
    const text = (c) => r.querySelector(c).textContent;
    const num = (c) => Number(text(c));
    const f = q.factors;
    return Number(r.dataset.queueEntry) === q.id && text(".queue-user") === q.user
      && num(".queue-position") === q.position && num(".queue-priority") === f.priority
      && num(".queue-fairshare") === f.fairshare && num(".queue-age") === f.age
      && num(".queue-share") === f.share && num(".queue-usage") === f.recent_gpu_hours
      && r.querySelector(".queue-expected").dataset.sure === q.expected_sure
      && r.textContent.includes(q.created.replace("T", " ").replace("Z", "") + " UTC");
  });
}"""


def checked_playwright(response):
    """A response the page got, validated against the OpenAPI file like the others."""
    req = requests.Request("GET", response.url).prepare()
    fake = requests.Response()
    fake.status_code, fake._content = response.status, response.body()
    fake.headers.update(response.headers)
    fake.request = req
    return checked(fake).json()


# ---- the admin page, My GPUs and the metrics --------------------------------------------------


def test_admins_see_reorder_and_cancel_the_queue_and_users_leave_it(hub, tokens, ledger, browser, tmp_path):
    page = login(browser, hub, "admin", ADMIN_PASSWORD)
    page.goto(f"{hub.broker_url}/admin")
    expect(page.locator('[data-empty="queue"]')).to_have_text("Nobody is waiting for GPUs now.")
    left_before = wait_count(hub, tokens, "left")

    fill(hub, tokens, ledger)
    carol = enqueue(hub, tokens["carol"], 1)  # carol asks first, but she holds a GPU now
    dave = enqueue(hub, tokens["dave"], 1)  # dave has used nothing: fair share puts him ahead
    assert carol["created"] <= dave["created"]
    rest = checked(hub.broker("GET", "queue", tokens["admin"])).json()["queue"]
    assert [q["id"] for q in rest] == [dave["id"], carol["id"]]
    assert [q["position"] for q in rest] == [1, 2] and {q["waiting"] for q in rest} == {2}
    light, heavy = (next(q["factors"] for q in rest if q["user"] == u) for u in ("dave", "carol"))
    assert light["fairshare"] == 1.0 > heavy["fairshare"]
    assert light["recent_gpu_hours"] == 0 <= heavy["recent_gpu_hours"]  # seconds of use: rounds to 0.0
    assert light["priority"] > heavy["priority"]
    m = metrics(hub, tokens)
    assert m['gpuhub_queue_length{purpose="distributed"}'] == 2
    assert m['gpuhub_queue_length{purpose="server"}'] == 0

    # the page lists both, in the queue's order, with what they wait for and their factors:
    # exactly what its last poll of GET queue answered (the factors move as time passes)
    expect_rows(page, "#queue", [dave["id"], carol["id"]])
    with page.expect_response(lambda r: r.url.endswith("/api/v1/queue") and r.request.method == "GET") as got:
        pass  # the page's next poll
    polled = checked_playwright(got.value)["queue"]
    assert [q["id"] for q in polled] == [dave["id"], carol["id"]]
    try:
        page.wait_for_function(SHOWS_QUEUE, arg=polled, timeout=10_000)
    except Exception:
        raise AssertionError(f"the page does not show {polled}:\n{page.inner_text('#queue')}") from None
    cells = page.locator(f'#queue tr[data-queue-entry="{dave["id"]}"] td')
    assert cells.nth(2).inner_text() == "1"  # GPUs (any model)
    assert cells.nth(3).inner_text() == "distributed"
    assert re.fullmatch(r"\d+ s", cells.nth(5).inner_text()), cells.nth(5).inner_text()  # waited
    page.screenshot(path=str(tmp_path / "admin-queue.png"), full_page=True)

    # a user may not reorder the queue, nor see or touch another user's entry
    for method, path, status in [
        ("POST", f"queue/{dave['id']}/front", 403),  # his own: only admins move entries
        ("POST", f"queue/{carol['id']}/front", 404),  # another user's is not even confirmed
        ("GET", f"queue/{carol['id']}", 404),
        ("DELETE", f"queue/{carol['id']}", 404),
        ("POST", f"queue/{carol['id']}/wait", 404),
    ]:
        r = checked(hub.broker(method, path, tokens["dave"]))
        assert r.status_code == status, (method, path, r.text)
    assert queue_ids(hub, tokens, "dave") == [dave["id"]]  # his own only
    assert checked(hub.broker("GET", "queue?user=carol", tokens["dave"])).status_code == 403
    assert queue_ids(hub, tokens) == [dave["id"], carol["id"]]

    # Move to front: carol goes ahead (REST and page)
    page.locator(f'#queue tr[data-queue-entry="{carol["id"]}"] button[data-queue-front]').click()
    expect_rows(page, "#queue", [carol["id"], dave["id"]])
    assert queue_ids(hub, tokens) == [carol["id"], dave["id"]]
    moved = checked(hub.broker("GET", f"queue/{carol['id']}", tokens["carol"])).json()
    assert moved["position"] == 1 and moved["moved_to_front"] and moved["factors"]["front"] is True
    expect(page.locator(f'#queue tr[data-queue-entry="{carol["id"]}"]')).to_contain_text("moved to front")

    # Cancel: dave's entry ends; his waiter's next poll says so, naming the admin
    page.locator(f'#queue tr[data-queue-entry="{dave["id"]}"] button[data-queue-cancel]').click()
    expect_rows(page, "#queue", [carol["id"]])
    assert queue_ids(hub, tokens) == [carol["id"]]
    poll = checked(hub.broker("POST", f"queue/{dave['id']}/wait", tokens["dave"])).json()
    assert poll["allocation"] is None
    assert poll["entry"]["state"] == "left" and poll["entry"]["end_reason"] == "an admin (admin) cancelled it"
    assert poll["entry"]["line"] == "an admin (admin) cancelled it" and poll["entry"]["position"] == 0
    assert ledger.active(user="dave") == []
    # an ended entry cannot be moved or cancelled again
    for method, path in [("POST", f"queue/{dave['id']}/front"), ("DELETE", f"queue/{dave['id']}")]:
        r = checked(hub.broker(method, path, tokens["admin"]))
        assert r.status_code == 409 and r.json()["reason"] == "not_waiting", r.text

    # My GPUs: carol sees her wait, with its line, and leaves the queue
    mine = login(browser, hub, "carol", DEMO_PASSWORD)
    mine.goto(f"{hub.broker_url}/")
    expect_rows(mine, "#my-queue", [carol["id"]])
    line = mine.locator(f'#my-queue tr[data-queue-entry="{carol["id"]}"] .queue-line')
    expect(line).to_contain_text("1st of 1 waiting for 1 GPU")
    rest_line = checked(hub.broker("GET", f"queue/{carol['id']}", tokens["carol"])).json()["line"]
    assert rest_line.startswith("1st of 1 waiting for 1 GPU")
    mine.screenshot(path=str(tmp_path / "my-queue.png"), full_page=True)
    mine.locator(f'#my-queue tr[data-queue-entry="{carol["id"]}"] button[data-queue-leave]').click()
    expect_rows(mine, "#my-queue", [])
    expect(mine.locator('[data-empty="my-queue"]')).to_have_text("You are not waiting for GPUs.")
    gone = ledger.queue_entry(carol["id"])
    assert gone.state == "left" and gone.end_reason == "its owner left the queue"
    assert len(ledger.active(user="carol")) == 1  # her burst is untouched
    expect(page.locator('[data-empty="queue"]')).to_have_text("Nobody is waiting for GPUs now.")

    # the metrics: nothing waits, and the two waits that ended were observed once each
    m = metrics(hub, tokens)
    assert m['gpuhub_queue_length{purpose="distributed"}'] == 0
    assert m['gpuhub_queue_wait_seconds_count{outcome="left"}'] == left_before + 2
    assert wait_count(hub, tokens, "left") == left_before + 2  # a second scrape counts nothing again


# ---- the REST API ----------------------------------------------------------------------------


def test_a_waiting_burst_is_answered_202_and_granted_on_a_poll_after_a_release(hub, tokens, ledger):
    granted_before = wait_count(hub, tokens, "granted")
    alice, _carol = fill(hub, tokens, ledger)
    # not waiting: refused as before, and nothing is queued
    r = burst(hub, tokens["bob"], 2)
    assert r.status_code == 409 and r.json()["reason"] == "no_capacity", r.text
    assert queue_ids(hub, tokens) == []
    # over the limit: refused at once, even when asking to wait
    r = burst(hub, tokens["bob"], 3, wait=True)
    assert r.status_code == 403 and r.json()["reason"] == "over_limit", r.text
    assert queue_ids(hub, tokens) == []

    r = burst(hub, tokens["bob"], 2, wait=True)
    assert r.status_code == 202, r.text
    entry = r.json()["queued"]
    assert r.headers["Location"] == f"/services/gpuhub/api/v1/queue/{entry['id']}"
    assert entry["state"] == "waiting" and entry["user"] == "bob" and entry["gpus"] == 2
    assert entry["purpose"] == "distributed" and entry["allocation_id"] is None
    assert (entry["position"], entry["waiting"]) == (1, 1)
    assert entry["line"].startswith("1st of 1 waiting for 2 GPUs")
    located = checked(hub.api_url_request("GET", r.headers["Location"], headers=auth(tokens["bob"])))
    assert located.status_code == 200 and located.json()["id"] == entry["id"]

    poll = checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["bob"])).json()
    assert poll["allocation"] is None and poll["entry"]["state"] == "waiting"
    assert ledger.active(user="bob") == []
    # the admin may see it, but only its owner waits in it
    assert checked(hub.broker("GET", f"queue/{entry['id']}", tokens["admin"])).status_code == 200
    assert checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["admin"])).status_code == 403

    # alice releases: bob's next poll books the GPUs for him
    assert checked(hub.broker("DELETE", f"allocations/{alice['id']}", tokens["alice"])).status_code == 200

    def granted():
        got = checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["bob"])).json()
        return got if got["allocation"] else None

    got = wait_for(granted, 30, "bob's poll to be granted")
    allocation = got["allocation"]
    assert allocation["user"] == "bob" and len(allocation["gpus"]) == 2 and allocation["state"] != "released"
    assert got["entry"]["state"] == "granted" and got["entry"]["allocation_id"] == allocation["id"]
    assert got["entry"]["end_reason"].startswith("started after")
    assert [a.id for a in ledger.active(user="bob")] == [allocation["id"]]
    held = {g["index"] for g in alice["gpus"]}
    assert {g["index"] for g in allocation["gpus"]} <= held  # the GPUs alice gave back
    # asking again answers the same allocation; nothing more is booked
    again = checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["bob"])).json()
    assert again["allocation"]["id"] == allocation["id"] and len(ledger.active(user="bob")) == 1
    assert queue_ids(hub, tokens) == []
    assert wait_count(hub, tokens, "granted") == granted_before + 1
    # the grant is a burst like any other: its owner releases it
    r = checked(hub.broker("DELETE", f"allocations/{allocation['id']}", tokens["bob"]))
    assert r.status_code == 200 and r.json()["state"] == "released"


def auth(token):
    return {"Authorization": f"token {token}"}


def test_the_owner_leaves_the_queue_with_delete(hub, tokens, ledger):
    fill(hub, tokens, ledger)
    entry = enqueue(hub, tokens["bob"], 1)
    assert checked(hub.broker("DELETE", f"queue/{entry['id']}", tokens["carol"])).status_code == 404
    assert queue_ids(hub, tokens) == [entry["id"]]
    r = checked(hub.broker("DELETE", f"queue/{entry['id']}", tokens["bob"]))
    assert r.status_code == 200
    assert r.json()["state"] == "left" and r.json()["end_reason"] == "its owner left the queue"
    assert r.json()["ended"] and r.json()["factors"] is None
    again = checked(hub.broker("DELETE", f"queue/{entry['id']}", tokens["bob"]))
    assert again.status_code == 409 and again.json()["reason"] == "not_waiting"
    poll = checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["bob"])).json()
    assert poll["allocation"] is None and poll["entry"]["state"] == "left"
    assert queue_ids(hub, tokens, "bob") == [] and ledger.active(user="bob") == []
    # and an unknown entry is 404 for everyone
    assert checked(hub.broker("GET", "queue/999999", tokens["admin"])).status_code == 404


def test_a_burst_that_fits_now_is_granted_even_when_asked_to_wait(hub, tokens, ledger):
    r = burst(hub, tokens["bob"], 1, wait=True)
    assert r.status_code == 201, r.text
    assert r.headers["Location"].endswith(f"/allocations/{r.json()['id']}")
    assert queue_ids(hub, tokens) == []


@pytest.mark.parametrize("raw", ['"yes"', '"true"', "1", "0", "null", "[]", "{}"])
def test_bad_wait_values_are_refused(hub, tokens, ledger, raw):
    before = ([a.id for a in ledger.active()], [q.id for q in ledger.queue()])
    body = f'{{"gpus": 1, "wait": {raw}}}'.encode()
    r = checked(
        hub.broker(
            "POST", "allocations", tokens["bob"], data=body, headers={"Content-Type": "application/json"}
        )
    )
    assert r.status_code == 400, r.text
    assert r.json()["reason"] == "bad_request"
    assert "'wait' must be true or false" in r.json()["message"], r.text
    assert ([a.id for a in ledger.active()], [q.id for q in ledger.queue()]) == before


# ---- the wait-time histogram, without a hub ---------------------------------------------------


class FakeLedger:
    """The two calls the collector makes, over a list of ended entries."""

    def __init__(self, now):
        self.now = now
        self.ended: list[QueueInfo] = []

    def clock(self):
        return self.now

    def queue_history(self, since):
        return [q for q in self.ended if q.ended >= since]

    def end(self, id, state, waited, commit_lag=0.0):
        """An entry that waited ``waited`` s and ended ``commit_lag`` s before now."""
        ended = self.now - timedelta(seconds=commit_lag)
        self.ended.append(
            QueueInfo(
                id=id,
                user="u",
                purpose="distributed",
                server_name="",
                gpu_count=1,
                model=None,
                state=state,
                created=ended - timedelta(seconds=waited),
                seen=ended,
                front=None,
                ended=ended,
                end_reason="x",
                allocation_id=None,
            )
        )


def samples(collector):
    [family] = collector.collect()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}


def test_the_wait_histogram_counts_each_ended_entry_once():
    t0 = datetime(2026, 1, 1, 12, 0, 0)
    led = FakeLedger(t0)
    led.end(1, "left", 10)  # ended when the service started: counted
    c = QueueWaitCollector(led)
    led.now = t0 - timedelta(seconds=1)
    led.end(0, "granted", 5)  # ended before the service started: not counted
    led.now = t0 + timedelta(seconds=30)
    led.end(2, "granted", 40)
    got = samples(c)
    assert got[("gpuhub_queue_wait_seconds_count", (("outcome", "granted"),))] == 1
    assert got[("gpuhub_queue_wait_seconds_count", (("outcome", "left"),))] == 1
    assert got[("gpuhub_queue_wait_seconds_sum", (("outcome", "granted"),))] == 40
    assert got[("gpuhub_queue_wait_seconds_bucket", (("le", "30"), ("outcome", "granted")))] == 0
    assert got[("gpuhub_queue_wait_seconds_bucket", (("le", "60"), ("outcome", "granted")))] == 1
    assert got[("gpuhub_queue_wait_seconds_bucket", (("le", "+Inf"), ("outcome", "left")))] == 1
    assert len([k for k in got if k[0].endswith("_bucket")]) == 2 * (len(WAIT_BUCKETS) + 1)
    # a later scrape counts nothing twice; an end committed just after the last scrape, with a
    # timestamp before it, is still counted once
    led.now = t0 + timedelta(seconds=60)
    led.end(3, "left", 700, commit_lag=45)
    got = samples(c)
    assert got[("gpuhub_queue_wait_seconds_count", (("outcome", "granted"),))] == 1
    assert got[("gpuhub_queue_wait_seconds_count", (("outcome", "left"),))] == 2
    assert got[("gpuhub_queue_wait_seconds_sum", (("outcome", "left"),))] == 710
    led.now = t0 + timedelta(hours=1)
    assert samples(c) == got


def test_the_openapi_file_documents_the_queue():
    spec = yaml.safe_load(Path(spawner.broker.__file__).with_name("openapi.yaml").read_text())
    paths = spec["paths"]
    for path in ("/queue", "/queue/{id}", "/queue/{id}/wait", "/queue/{id}/front"):
        assert path in paths, path
    assert "202" in paths["/allocations"]["post"]["responses"]
    assert spec["components"]["schemas"]["BurstRequest"]["properties"]["wait"]["type"] == "boolean"
    # every field of views.queue_json is in the schema, and nothing else
    from spawner.broker import responses as views

    info = FakeLedger(datetime(2026, 1, 1))
    info.end(1, "left", 3)
    fields = set(views.queue_json(info.ended[0], info.now))
    schema = spec["components"]["schemas"]["QueueEntry"]
    assert set(schema["properties"]) == fields == set(schema["required"])
