"""Outbound event webhooks, the API: subscriptions per API key, events validated, and URLs that
would reach inside (SSRF) refused however they are written."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from tests.channels.slack_support import echo_agent

pytestmark = pytest.mark.asyncio
INSIDE = [
    "https://127.0.0.1/hook",
    "https://localhost/hook",
    "https://2130706433/hook",  # 127.0.0.1 as one decimal number
    "https://0x7f.0.0.1/hook",  # ... in hex
    "https://0177.0.0.1/hook",  # ... in octal
    "https://[::1]/hook",
    "https://[::ffff:127.0.0.1]/hook",  # IPv4-mapped IPv6
    "https://[::ffff:0:7f00:1]/hook",  # IPv4-translated IPv6 (a hostile probe's find)
    "https://[::ffff:0:a9fe:a9fe]/latest/meta-data/",  # ... the metadata service
    "https://10.1.2.3/hook",
    "https://192.168.0.1/hook",
    "https://169.254.169.254/latest/meta-data",  # link-local: the cloud metadata service
    "https://[fe80::1]/hook",
    "https://0.0.0.0/hook",
    "https://224.0.0.1/hook",  # multicast
]


async def test_a_subscription_is_made_listed_shown_and_deleted_by_its_key_only(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("k1", "k2"), webhook_allow_private=True)
    async with live.client("k1") as c1, live.client("k2") as c2:
        r = await c1.post(
            "/v1/webhooks", json={"url": "http://127.0.0.1:9/hook", "events": ["turn.completed"], "description": "mine"}
        )
        assert r.status_code == 201
        made = r.json()
        assert made["id"].startswith("wh_") and made["secret"].startswith("whsec_")
        assert made["events"] == ["turn.completed"] and made["description"] == "mine"
        listed = (await c1.get("/v1/webhooks")).json()["webhooks"]
        assert [w["id"] for w in listed] == [made["id"]] and "secret" not in listed[0]
        assert (await c1.get(f"/v1/webhooks/{made['id']}")).json()["url"] == "http://127.0.0.1:9/hook"
        assert (await c2.get("/v1/webhooks")).json() == {"webhooks": []}
        for other in (
            c2.get(f"/v1/webhooks/{made['id']}"),
            c2.delete(f"/v1/webhooks/{made['id']}"),
            c2.get(f"/v1/webhooks/{made['id']}/failures"),
            c2.post(f"/v1/webhooks/{made['id']}/failures/retry"),
        ):
            r = await other
            assert r.status_code == 404 and r.json()["error"]["code"] == "webhook_not_found"
        assert (await c1.get(f"/v1/webhooks/{made['id']}/failures")).json() == {"failures": []}
        assert (await c1.delete(f"/v1/webhooks/{made['id']}")).status_code == 204
        assert (await c1.get(f"/v1/webhooks/{made['id']}")).status_code == 404
        assert (await c1.get("/v1/webhooks")).json() == {"webhooks": []}
        assert (await c1.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/"})).status_code == 400


@pytest.mark.parametrize("url", INSIDE)
async def test_urls_that_reach_inside_are_refused_and_nothing_is_stored(serve: Any, redis: Redis, url: str) -> None:
    live = await serve(echo_agent(), api_keys=("k1",))
    async with live.client("k1") as c:
        before = await redis.dbsize()
        r = await c.post("/v1/webhooks", json={"url": url, "events": ["*"]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "invalid_url"
        assert await redis.dbsize() == before


async def test_bad_subscriptions_get_their_4xx(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=False)
    async with live.client("k1") as c:
        cases = [
            ({"url": "http://example.com/hook", "events": ["*"]}, "invalid_url"),  # plain http
            ({"url": "https://user:pw@example.com/hook", "events": ["*"]}, "invalid_url"),
            ({"url": "ftp://example.com/hook", "events": ["*"]}, "invalid_url"),
            ({"url": "https://does-not-resolve.invalid/hook", "events": ["*"]}, "invalid_url"),
            ({"url": "https://" + "a" * 2000 + ".com/", "events": ["*"]}, "invalid_url"),
            ({"url": "https://example.com/hook", "events": ["turn.exploded"]}, "invalid_events"),
            ({"url": "https://example.com/hook", "events": []}, "invalid_events"),
            ({"url": "https://example.com/hook", "events": ["*"], "extra": 1}, "invalid_request"),
        ]
        for body, code in cases:
            r = await c.post("/v1/webhooks", json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, (body, r.text)


async def test_an_api_key_has_at_most_20_webhooks(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("k1",), webhook_allow_private=True)
    async with live.client("k1") as c:
        for n in range(20):
            r = await c.post("/v1/webhooks", json={"url": f"http://127.0.0.1:9/{n}", "events": ["*"]})
            assert r.status_code == 201
        r = await c.post("/v1/webhooks", json={"url": "http://127.0.0.1:9/21", "events": ["*"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "too_many_webhooks"
