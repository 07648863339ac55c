"""Borrowing and preemption where they show: the spawn form, My GPUs, the GPU admin page, the
hub's home page (Debian's headless Chromium, driven by Playwright), the broker's JSON (every
answer validated against spawner/broker/openapi.yaml), the usage API and the metrics.

A real hub, proxy and broker on the demo's 4 simulated GPUs with a limit of 1 for everyone
and a borrowing allowance of 2; borrowed GPUs are taken back 20 s after the notice (the home
page's notices are cached for up to 10 s: a pending one must outlive that), and the
broker's preemption pass runs every second (``c.GpuBroker.sweep_seconds``). Queue entries stay
alive for 10 minutes without polling here (``queue_keepalive_seconds``).
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest
from openapi_core import OpenAPI
from openapi_core.contrib.requests import RequestsOpenAPIRequest, RequestsOpenAPIResponse
from playwright.sync_api import expect

import spawner.broker
from gpu_magics.common.words import stamp
from spawner.policy.records import PreemptionInfo, PreemptionNotice
from spawner.policy.values import period_in_words
from spawner.spawners.notices import render_preemptions

from .hubtools import ADMIN_PASSWORD, DEMO_PASSWORD, Hub, tidy_ledger, user_tokens, wait_for

pytestmark = pytest.mark.hub

SPEC = OpenAPI.from_file_path(str(Path(spawner.broker.__file__).with_name("openapi.yaml")))

CONFIG = """
c.GpuHub.default_limit = 1
c.GpuHub.group_limits = {}
c.GpuHub.user_limits = {}
c.GpuHub.default_borrow = 2
c.GpuHub.preempt_grace_seconds = 20
c.GpuHub.queue_keepalive_seconds = 600
c.GpuBroker.sweep_seconds = 1
"""
GRACE = 20


def checked(r):
    """The response, after validating it against the OpenAPI file."""
    SPEC.validate_response(RequestsOpenAPIRequest(r.request), RequestsOpenAPIResponse(r))
    return r


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    h = Hub(tmp_path_factory.mktemp("borrow"), extra_config=CONFIG).start()
    h.wait_for_broker()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def tokens(hub):
    return user_tokens(hub)


@pytest.fixture
def ledger(hub):
    """The hub's ledger; after each test nothing waits and no burst or server is held."""
    yield from tidy_ledger(hub, stop_servers=True)


def burst(hub, token, gpus, **extra):
    return checked(hub.broker("POST", "allocations", token, json={"gpus": gpus, **extra}))


def metrics(hub, tokens) -> dict[str, float]:
    text = hub.broker("GET", "../../metrics", tokens["admin"]).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def login(browser, hub, user, password=DEMO_PASSWORD):
    page = browser.new_page()
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", password)
    page.click("#login_submit")
    page.wait_for_url(lambda url: "/hub/login" not in url)
    return page


# ---- the form when nobody can borrow --------------------------------------------------------


def test_the_form_says_none_can_be_borrowed_while_someone_waits(hub, tokens, ledger, browser):
    page = login(browser, hub, "alice")
    page.goto(f"{hub.url}/hub/spawn")
    borrow = page.locator('[data-gpuhub="borrow"]')
    expect(borrow).to_have_attribute("data-why", "free")  # a quiet hub: 4 free, nobody waits
    expect(page.locator('[data-gpuhub="may-borrow"]')).to_have_text("2")

    # every GPU held within its limit, and the admin waits for one
    for user in ("alice", "bob", "carol", "dave"):
        assert burst(hub, tokens[user], 1).status_code == 201
    waits = burst(hub, tokens["admin"], 1, wait=True)
    assert waits.status_code == 202, waits.text

    page.goto(f"{hub.url}/hub/spawn")
    expect(borrow).to_have_attribute("data-why", "waiting")
    expect(page.locator('[data-gpuhub="may-borrow"]')).to_have_text("0")
    expect(borrow).to_contain_text(
        "You may borrow up to 2 GPUs beyond your limit, but 0 now: 1 request waits for GPUs, "
        "and GPUs are lent beyond a limit only while nobody waits."
    )
    expect(borrow).to_contain_text("with 20 seconds' notice")
    me = checked(hub.broker("GET", "me", tokens["alice"])).json()
    assert me["borrow"] == {"allowance": 2, "borrowed": 0, "may_borrow_now": 0, "waiting": 1}
    # nothing borrowed, so nothing is taken back for the waiting admin
    assert ledger.preemptions() == []


# ---- a borrowed server, marked everywhere, then preempted -------------------------------------


def test_a_borrowed_server_is_marked_then_preempted_with_the_reason_shown(
    hub, tokens, ledger, browser, tmp_path
):
    before = metrics(hub, tokens)
    alice = login(browser, hub, "alice")
    alice.goto(f"{hub.url}/hub/spawn")
    expect(alice.locator('[data-gpuhub="borrow"]')).to_have_attribute("data-why", "free")
    expect(alice.locator('[data-gpuhub="may-borrow"]')).to_have_text("2")
    expect(alice.locator('[data-gpuhub="most"]')).to_have_text("3")
    expect(alice.locator('[data-gpuhub="preempt-notice"]')).to_have_text(
        f"with {period_in_words(GRACE)}' notice"
    )
    expect(alice.locator("#gpuhub-gpus-help")).to_contain_text(
        "You may also borrow 2 GPUs beyond your limit right now, up to 3 for this server"
    )
    alice.fill("#gpuhub-gpus", "3")  # 1 within the limit, 2 borrowed
    alice.locator("#spawn_form input[type=submit], #spawn_form button[type=submit]").first.click()
    hub.wait_ready("alice")
    alice.wait_for_url(re.compile(r"/user/alice/"), timeout=90_000)  # the spawn page goes on to the server
    [mine] = ledger.active(user="alice")
    assert (mine.purpose, len(mine.gpus), mine.borrowed, mine.preempt_due) == ("server", 3, 2, None)

    # the broker's JSON
    me = checked(hub.broker("GET", "me", tokens["alice"])).json()
    assert [(a["id"], a["borrowed"], a["preemption"]) for a in me["allocations"]] == [(mine.id, 2, None)]
    assert me["borrow"] == {"allowance": 2, "borrowed": 2, "may_borrow_now": 0, "waiting": 0}
    listed = checked(hub.broker("GET", "allocations?all=1", tokens["admin"])).json()["allocations"]
    assert [(a["user"], a["borrowed"]) for a in listed] == [("alice", 2)]
    cluster = checked(hub.broker("GET", "cluster", tokens["admin"])).json()
    held = [g["holder"] for n in cluster["nodes"] for g in n["gpus"] if g["holder"]]
    assert [(h["user"], h["borrowed"], h["gpu_count"]) for h in held] == [("alice", 2, 3)] * 3
    util = checked(hub.broker("GET", "utilization", tokens["admin"])).json()
    assert [(a["id"], a["borrowed"]) for a in util["allocations"]] == [(mine.id, 2)]
    assert metrics(hub, tokens)['gpuhub_borrowed_gpus{purpose="server"}'] == 2

    # My GPUs marks the allocation as borrowed
    alice.goto(hub.broker_url + "/")
    expect(alice.locator(f'tr[data-allocation="{mine.id}"] [data-borrowed="2"]')).to_have_text(
        "2 of 3 borrowed"
    )
    expect(alice.locator('[data-gpuhub="borrowed"]')).to_have_text("2")
    # ... and so does the admin page: the live grid and the holders
    admin = login(browser, hub, "admin", ADMIN_PASSWORD)
    admin.goto(f"{hub.broker_url}/admin")
    for g in mine.gpus:
        expect(admin.locator(f'.gpu-cell[data-gpu="{g.label}"] .gpu-borrowed')).to_have_text(
            "2 of 3 borrowed"
        )
        expect(admin.locator(f'#cluster tr[data-gpu="{g.label}"] [data-borrowed="2"]')).to_have_text(
            "2 of 3 borrowed"
        )

    # carol takes the last GPU, within her limit; with nothing free, dave may borrow none
    assert burst(hub, tokens["carol"], 1).status_code == 201
    dave = hub.login("dave").get(f"{hub.url}/hub/spawn").text
    assert 'data-why="none_free"' in dave and "0</span> now: no GPU is free." in dave

    # bob asks for 1 GPU within his limit: only alice's borrowed GPUs could serve him
    assert hub.spawn("bob", {"gpus": 1}).status_code == 202
    [p] = wait_for(lambda: ledger.preemptions(user="alice"), 30, "alice's server given notice")
    assert (p.allocation_id, p.purpose, p.borrowed, p.gpus, p.for_user) == (mine.id, "server", 2, 3, "bob")
    assert p.due - p.created == timedelta(seconds=GRACE)
    assert p.reason.startswith(
        "preempted: 2 borrowed GPUs taken back for another user's request within its limit"
    )

    # after the grace period the broker stops alice's server; bob's spawn starts on its GPUs
    ended = wait_for(
        lambda: (a := ledger.get(mine.id)).state == "released" and a, 60, "alice's server preempted"
    )
    assert ended.end_reason == p.reason and ended.ended >= p.due
    wait_for(lambda: hub.server("alice") is None, 30, "alice's server gone from the hub")
    hub.wait_ready("bob")
    [bobs] = ledger.active(user="bob", purpose="server")
    assert bobs.borrowed == 0 and {g.label for g in bobs.gpus} <= {g.label for g in mine.gpus}

    # the hub's home page tells alice (and only alice) why, in the browser
    session = hub.login("alice")
    wait_for(  # the home page's notices are cached for up to 10 s per user
        lambda: "were taken back at" in session.get(f"{hub.url}/hub/home").text,
        30,
        "the notice on the home page",
    )
    alice.goto(f"{hub.url}/hub/home")
    notice = alice.locator(f'.gpuhub-preemption[data-preemption="{p.id}"]')
    expect(notice).to_have_attribute("data-state", "done")
    expect(notice).to_contain_text(
        f"Your server's 2 borrowed GPUs were taken back at {stamp(ended.ended)} "
        "for a request within its limit: gpuhub stopped the server. Your notebooks"
    )
    expect(notice).not_to_contain_text("preempted:")  # said once: not the reason again
    alice.screenshot(path=str(tmp_path / "home-preempted.png"), full_page=True)
    assert "were taken back" not in hub.login("bob").get(f"{hub.url}/hub/home").text
    # ... and My GPUs
    alice.goto(hub.broker_url + "/")
    mine_notice = alice.locator(f'#preemption-notices [data-preemption="{p.id}"]')
    expect(mine_notice).to_have_attribute("data-state", "done")
    expect(mine_notice).to_contain_text("Your server's 2 borrowed GPUs were taken back at")
    expect(mine_notice).to_contain_text(f"taken back at {stamp(ended.ended)} for a request within its limit")
    expect(mine_notice).not_to_contain_text("preempted:")
    me = checked(hub.broker("GET", "me", tokens["alice"])).json()
    assert [(n["id"], n["allocation_id"], n["reason"]) for n in me["preempted"]] == [
        (p.id, mine.id, p.reason)
    ]
    assert me["allocations"] == [] and me["borrow"]["borrowed"] == 0

    # accounting: borrowed GPU-hours and the preemption, in the usage API ...
    hours = 2 * (ended.ended - (mine.started or mine.created)).total_seconds() / 3600
    usage = checked(hub.broker("GET", "usage?since=1d", tokens["admin"])).json()
    assert usage["borrowed_gpu_hours"]["alice"] == pytest.approx(hours, abs=1e-4)
    assert usage["preemptions"]["alice"] == 1
    assert usage["preemptions"].get("bob", 0) == 0 and usage["borrowed_gpu_hours"].get("bob", 0) == 0
    assert usage["total"]["alice"] >= usage["borrowed_gpu_hours"]["alice"]  # of all her GPU-hours
    own = checked(hub.broker("GET", "usage?since=1d", tokens["alice"])).json()
    assert (own["borrowed_gpu_hours"], own["preemptions"]) == (
        {"alice": usage["borrowed_gpu_hours"]["alice"]},
        {"alice": 1},
    )
    assert checked(hub.broker("GET", "usage?since=1d&user=alice", tokens["bob"])).status_code == 403
    pre = checked(hub.broker("GET", "preemptions?since=1d", tokens["admin"])).json()
    assert pre["users"]["alice"] == {
        "borrowed_gpu_hours": usage["borrowed_gpu_hours"]["alice"],
        "preemptions": 1,
    }
    assert [(x["id"], x["for_user"], x["ended"] is not None) for x in pre["preemptions"]] == [
        (p.id, "bob", True)
    ]
    assert checked(hub.broker("GET", "preemptions", tokens["bob"])).json()["preemptions"] == []
    # ... on the admin page ...
    admin.goto(f"{hub.broker_url}/admin")
    row = admin.locator('#borrowing-users tr[data-user="alice"]')
    expect(row.locator(".preemption-count")).to_have_text("1")
    expect(row.locator(".borrowed-hours")).to_have_text(re.compile(r"^[0-9][0-9.e-]*$"))
    shown = float(row.locator(".borrowed-hours").inner_text())  # to 2 significant digits
    assert shown == pytest.approx(usage["borrowed_gpu_hours"]["alice"], rel=0.05)
    preempted_row = admin.locator(f'#preemptions tr[data-preemption="{p.id}"]')
    expect(preempted_row).to_contain_text(p.reason)
    expect(preempted_row).to_contain_text("2 of 3")
    admin.screenshot(path=str(tmp_path / "admin-borrowing.png"), full_page=True)
    # ... and in the metrics
    m = metrics(hub, tokens)
    assert m['gpuhub_preempted_allocations{user="alice"}'] == 1
    assert m['gpuhub_borrowed_gpu_hours{user="alice"}'] == pytest.approx(hours, abs=1e-4)
    assert (
        m['gpuhub_preemptions_total{purpose="server"}']
        == before.get('gpuhub_preemptions_total{purpose="server"}', 0) + 1
    )
    assert m['gpuhub_borrowed_gpus{purpose="server"}'] == 0  # bob's GPU is within his limit


# ---- a borrowed burst's notice, while it lives ----------------------------------------------


def test_a_borrowed_burst_shows_its_notice_then_ends_at_its_due_time(hub, tokens, ledger, browser):
    got = burst(hub, tokens["alice"], 3, lease_seconds=600)  # nobody renews it: it lives 10 min
    assert got.status_code == 201 and got.json()["borrowed"] == 2, got.text
    lent = got.json()
    assert metrics(hub, tokens)['gpuhub_borrowed_gpus{purpose="distributed"}'] == 2
    assert burst(hub, tokens["carol"], 1).status_code == 201
    waiting = burst(hub, tokens["bob"], 1, wait=True)
    assert waiting.status_code == 202, waiting.text
    entry = waiting.json()["queued"]

    [p] = wait_for(
        lambda: [x for x in ledger.preemptions(user="alice") if x.allocation_id == lent["id"]],
        30,
        "the notice",
    )
    shown = checked(hub.broker("GET", f"allocations/{lent['id']}", tokens["alice"])).json()
    assert shown["preemption"] == {"due": p.due.isoformat(timespec="seconds") + "Z", "reason": p.reason}

    # My GPUs: the notice with the reason, and the allocation's badges
    alice = login(browser, hub, "alice")
    alice.goto(hub.broker_url + "/")
    notice = alice.locator(f'#preemption-notices [data-preemption="{p.id}"]')
    expect(notice).to_have_attribute("data-state", "pending")
    expect(notice).to_contain_text(f"Your burst #{lent['id']}'s 2 borrowed GPUs")
    expect(notice).to_contain_text(
        "for a request within its limit: its engines stop then. Save your work now."
    )
    expect(notice).to_contain_text(f"will be taken back at {stamp(p.due)}, in ")
    expect(notice).not_to_contain_text("preempted:")  # said once: not the reason again
    row = alice.locator(f'tr[data-allocation="{lent["id"]}"]')
    expect(row.locator("[data-borrowed]")).to_have_text("2 of 3 borrowed")
    expect(row.locator("[data-preempt-due]")).to_contain_text("taken back at")
    # the hub's home page says it too while the burst lives
    session = hub.login("alice")
    wait_for(
        lambda: (
            f"Your burst #{lent['id']}&#x27;s 2 borrowed GPUs" in session.get(f"{hub.url}/hub/home").text
            or f"Your burst #{lent['id']}'s 2 borrowed GPUs" in session.get(f"{hub.url}/hub/home").text
        ),
        30,
        "the burst's notice on the home page",
    )

    # once due, the broker ends it there and then, whatever its lease (10 min): the ledger
    # frees its GPUs for bob, and its kernel's channel (GET allocations/{id}) says it is gone
    ended = wait_for(
        lambda: (a := ledger.get(lent["id"])).state == "released" and a, 60, "the burst ended at its due time"
    )
    assert ended.end_reason == p.reason and ended.ended >= p.due
    assert ended.ended < ended.lease_expires  # its lease did not end it
    gone = checked(hub.broker("GET", f"allocations/{lent['id']}", tokens["alice"])).json()
    assert (gone["state"], gone["end_reason"]) == ("released", p.reason)
    assert hub.broker("POST", f"allocations/{lent['id']}/renew", tokens["alice"]).status_code == 409
    polled = checked(hub.broker("POST", f"queue/{entry['id']}/wait", tokens["bob"])).json()
    assert polled["allocation"] is not None and polled["allocation"]["borrowed"] == 0
    alice.goto(hub.broker_url + "/")  # My GPUs no longer lists it
    expect(alice.locator(f'tr[data-allocation="{lent["id"]}"]')).to_have_count(0)


# ---- the home page's words, as a table --------------------------------------------------------


def _notice(purpose="server", server_name="", borrowed=2, ended=None, pending=False, withdrawn=None):
    from datetime import datetime

    created = datetime(2026, 3, 2, 14, 20, 0)
    gone = None if withdrawn is None else created + timedelta(seconds=withdrawn)
    p = PreemptionInfo(
        id=7,
        allocation_id=12,
        user="alice",
        purpose=purpose,
        server_name=server_name,
        gpus=3,
        borrowed=borrowed,
        for_user="bob",
        entry_id=3,
        reason="preempted: <b>2</b> borrowed GPU(s) taken back for bob's request",
        created=created,
        due=created + timedelta(seconds=5),
        withdrawn=gone,
        withdrawn_reason=None if gone is None else "withdrawn: the request it was for left the <i>queue</i>",
    )
    live = pending or gone is not None
    return PreemptionNotice(p, None if live else (ended or created + timedelta(seconds=6)))


def max_depth(text: str) -> int:
    depth = most = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        most = max(most, depth)
    return most


@pytest.mark.parametrize(
    "notice, now_seconds, words",
    [
        (
            _notice(),
            10,
            "Your server's 2 borrowed GPUs were taken back at 2026-03-02 14:20:06 UTC for a request "
            "within its limit: gpuhub stopped the server. Your notebooks and files are saved;",
        ),
        (_notice(server_name="big"), 10, "Your server <b>big</b>'s 2 borrowed GPUs were taken back"),
        (_notice(borrowed=1), 10, "1 borrowed GPU was taken back"),
        (
            _notice(pending=True),
            1,
            "Your server's 2 borrowed GPUs will be taken back at 14:20:05 UTC for a "
            "request within its limit: gpuhub stops the server then. Save your work now.",
        ),
        (_notice(pending=True), 6, "Your server's 2 borrowed GPUs are being taken back now"),
        (
            _notice(purpose="distributed", pending=True),
            1,
            "Your burst #12's 2 borrowed GPUs will be taken back "
            "at 14:20:05 UTC for a request within its limit: its engines stop then.",
        ),
        # started ahead of the queue (backfill): all its GPUs, none borrowed
        (
            _notice(borrowed=0, pending=True),
            1,
            "Your server's 3 GPUs, which started ahead of the queue, will be taken back",
        ),
        # withdrawn: nothing is taken back, whatever the time
        (
            _notice(purpose="distributed", withdrawn=3),
            10,
            "Your burst #12's 2 borrowed GPUs will not be taken back: the notice of 14:20:00 UTC was "
            "withdrawn at 14:20:03 UTC: the request it was for left the &lt;i&gt;queue&lt;/i&gt;.",
        ),
    ],
)
def test_the_home_page_words_of_a_preemption(notice, now_seconds, words):
    html = render_preemptions([notice], notice.preemption.created + timedelta(seconds=now_seconds))
    assert words in html, html
    assert "<b>2</b>" not in html and "<i>" not in html  # the reasons are escaped
    assert "preempted:" not in html and "GPU(s)" not in html  # said once, in words
    assert max_depth(html) <= 1, html  # no parentheses inside parentheses
    want = "withdrawn" if notice.withdrawn else ("pending" if notice.pending else "done")
    assert f'data-state="{want}"' in html


@pytest.mark.parametrize("path", ["reclaims", "preemptions"])
@pytest.mark.parametrize(
    "since, words", [("yesterday-ish", "'since'"), ("2999-01-01T00:00:00Z", "'since' is in the future.")]
)
def test_a_bad_since_is_refused_with_the_field_named(hub, tokens, path, since, words):
    r = hub.broker("GET", f"{path}?since={since}", tokens["admin"])
    assert r.status_code == 400 and r.json()["reason"] == "bad_request", r.text
    assert words in r.json()["message"]
