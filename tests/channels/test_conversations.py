"""A key's conversations over a real server: GET /v1/sessions lists them most recent activity
first (a message, a turn's end), with their title (the start of the first message until one is
set), status, metadata and preview (the start of the last message); in pages whose walk gives no
session twice and misses none, also while other sessions are written; filtered by status and
metadata; another key's, deleted and expired sessions never in it. PATCH /v1/sessions/{id}
renames a session and merges its metadata, within the limits a new session's metadata has, and a
refused change writes nothing."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from harness.store.keys import OwnerKeys
from tests.channels.slack_support import echo_agent, eventually
from tests.channels.test_http import snapshot


async def new_session(c: httpx.AsyncClient, **metadata: Any) -> str:
    r = await c.post("/v1/sessions", json={"metadata": metadata})
    assert r.status_code == 201, r.text
    sid: str = r.json()["session_id"]
    return sid


async def say(c: httpx.AsyncClient, sid: str, text: str) -> dict[str, Any]:
    r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": text})
    assert r.status_code == 200 and r.json()["status"] in ("completed", "waiting"), r.text
    body: dict[str, Any] = r.json()
    return body


async def listing(c: httpx.AsyncClient, **query: Any) -> dict[str, Any]:
    r = await c.get("/v1/sessions", params=query)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def walk(c: httpx.AsyncClient, limit: int, **query: Any) -> list[str]:
    """Every page, from the first to the last: the session ids in the order given."""
    seen: list[str] = []
    cursor = None
    while True:
        page = await listing(c, limit=limit, **({"cursor": cursor} if cursor else {}), **query)
        assert len(page["items"]) <= limit
        seen += [i["session_id"] for i in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            return seen


async def test_the_list_is_most_recent_activity_first_with_titles_and_previews(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("k1", "k2"))
    async with live.client("k1") as c, live.client("k2") as other:
        first = await new_session(c, app="crm")
        second = await new_session(c)
        empty = await new_session(c, app="crm")
        long_text = "plan the launch " * 10
        await say(c, first, long_text)
        await say(c, second, "hello there")
        await say(c, first, "and the budget")  # the first is the most recent again

        page = await listing(c)
        assert [i["session_id"] for i in page["items"]] == [first, second, empty]
        assert page["next_cursor"] is None
        top = page["items"][0]
        assert top["title"] == long_text[:80]  # the start of its first message, not its last
        assert top["preview"] == "re:and the budget"  # the start of the last message: the reply
        assert top["status"] == "idle" and top["metadata"] == {"app": "crm"}
        assert top["updated_at"] >= page["items"][1]["updated_at"] >= page["items"][2]["updated_at"]
        assert top["created_at"] < top["updated_at"]
        assert page["items"][2] == {
            "session_id": empty,
            "title": None,
            "status": "idle",
            "metadata": {"app": "crm"},
            "created_at": page["items"][2]["created_at"],
            "updated_at": page["items"][2]["created_at"],
            "preview": "",
        }
        # the session itself says the same
        info = (await c.get(f"/v1/sessions/{first}")).json()
        assert info["title"] == long_text[:80] and info["updated_at"] == top["updated_at"]

        assert await listing(other) == {"items": [], "next_cursor": None}  # another key's: none

        assert [i["session_id"] for i in (await listing(c, status="idle"))["items"]] == [first, second, empty]
        assert (await listing(c, status="running"))["items"] == []
        assert [i["session_id"] for i in (await listing(c, **{"metadata.app": "crm"}))["items"]] == [first, empty]
        assert (await listing(c, **{"metadata.app": "crm", "metadata.x": "1"}))["items"] == []

        assert (await c.delete(f"/v1/sessions/{second}")).status_code == 204
        assert [i["session_id"] for i in (await listing(c))["items"]] == [first, empty]


async def test_a_waiting_session_is_listed_as_waiting(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = await new_session(c)
        assert (await say(c, sid, "wipe disk"))["status"] == "waiting"
        (item,) = (await listing(c, status="waiting"))["items"]
        assert item["session_id"] == sid and item["preview"] == "wipe disk"


async def test_pages_give_every_session_once_while_others_are_written(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sids = [await new_session(c, n=n) for n in range(40)]
        assert await walk(c, 7) == sids[::-1]  # most recent first: the newest made
        busy = random.Random(5).sample(sids, 12)  # written while the walks go on
        quiet = [s for s in sids if s not in busy]

        async def write() -> None:
            for n, sid in enumerate(busy):
                await c.post(f"/v1/sessions/{sid}/messages", json={"text": f"busy {n}"})
                await new_session(c, made="during")

        for limit in (1, 3, 8, 100):
            writer = asyncio.create_task(write())
            seen = await walk(c, limit)
            await writer
            assert len(seen) == len(set(seen)), f"a session given twice with limit {limit}"
            assert set(quiet) <= set(seen), f"sessions missing with limit {limit}"
            # the quiet ones keep their order among themselves
            assert [s for s in seen if s in quiet] == quiet[::-1]
        # once the writes are over: every session, in one walk, the busy ones first
        everything = await walk(c, 9)
        assert len(everything) == len(set(everything)) == 40 + 4 * len(busy)
        assert set(busy) <= set(everything[: 4 * len(busy) + len(busy)])


async def test_bad_list_queries_are_refused(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        await new_session(c)
        for query in (
            {"limit": "0"},
            {"limit": "101"},
            {"limit": "１"},
            {"cursor": "nope"},
            {"cursor": "12.ses_x"},
            {"status": "busy"},
            {f"metadata.k{n}": "v" for n in range(9)},
        ):
            r = await c.get("/v1/sessions", params=query)
            assert r.status_code == 400, (query, r.text)
            assert r.json()["error"]["code"] in ("invalid_query", "invalid_cursor"), r.text


async def test_expired_sessions_leave_the_list(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent(), session_ttl_ms=300)
    async with live.client() as c:
        gone = await new_session(c)

        async def expired() -> bool:
            return not await redis.exists(f"keel:{{{gone}}}:meta")

        await eventually(expired, timeout=10)
        kept = await new_session(c)
        assert [i["session_id"] for i in (await listing(c))["items"]] == [kept]
        # and the entry is gone from the owner's list in Redis too
        assert await redis.zscore(OwnerKeys("anon").sessions, gone) is None


async def test_patch_renames_and_merges_metadata(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("k1", "k2"))
    async with live.client("k1") as c, live.client("k2") as other:
        sid = await new_session(c, app="crm", team="a", n=1)
        await say(c, sid, "first words")
        r = await c.patch(f"/v1/sessions/{sid}", json={"title": "Launch plan", "metadata": {"team": "b", "n": None}})
        assert r.status_code == 200, r.text
        assert r.json()["title"] == "Launch plan" and r.json()["metadata"] == {"app": "crm", "team": "b"}
        await say(c, sid, "more words")  # a title that was set stays
        (item,) = (await listing(c))["items"]
        assert item["title"] == "Launch plan" and item["metadata"] == {"app": "crm", "team": "b"}
        assert [i["session_id"] for i in (await listing(c, **{"metadata.team": "b"}))["items"]] == [sid]
        r = await c.patch(f"/v1/sessions/{sid}", json={})
        assert r.status_code == 200 and r.json()["title"] == "Launch plan"
        r = await other.patch(f"/v1/sessions/{sid}", json={"title": "mine"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"title": ""}, "invalid_title"),
        ({"title": "x" * 201}, "invalid_title"),
        ({"title": 5}, "invalid_request"),
        ({"metadata": {f"k{n}": n for n in range(63)}}, "invalid_metadata"),  # 64 with `app`... and one more
        ({"metadata": {"big": "x" * 17_000}}, "invalid_metadata"),
        ({"metadata": {"": 1}}, "invalid_metadata"),
        ({"metadata": {"k" * 129: 1}}, "invalid_metadata"),
        ({"metadata": []}, "invalid_request"),
        ({"owner": "me"}, "invalid_request"),
    ],
)
async def test_a_refused_patch_writes_nothing(serve: Any, redis: Redis, body: dict[str, Any], code: str) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = await new_session(c, app="crm", extra=True)
        before = await snapshot(redis)
        r = await c.patch(f"/v1/sessions/{sid}", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert await snapshot(redis) == before


async def test_new_sessions_have_the_same_metadata_limits(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        before = await snapshot(redis)
        for metadata in ({f"k{n}": n for n in range(65)}, {"big": "x" * 17_000}, {"": 1}):
            r = await c.post("/v1/sessions", json={"metadata": metadata})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_metadata", r.text
        assert await snapshot(redis) == before
        r = await c.post("/v1/sessions", json={"metadata": {f"k{n}": n for n in range(64)}})
        assert r.status_code == 201


async def test_concurrent_patches_lose_no_key(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = await new_session(c)
        rs = await asyncio.gather(*(c.patch(f"/v1/sessions/{sid}", json={"metadata": {f"k{n}": n}}) for n in range(12)))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["metadata"] == {f"k{n}": n for n in range(12)}
