"""POST /v1/sessions/{id}/fork over a real server: a new session of the same key and metadata
whose history is the source's (all of it, or what came before a message's turn; a turn in
progress never), with no requests, no queue and no page context; the source byte for byte as it
was, and both usable after. Editing a message is a fork before it and the new text sent there.
Bad input (an unknown message, another key's session, a bad id) is refused and writes nothing."""

from __future__ import annotations

from typing import Any

import httpx
from redis.asyncio import Redis

from tests.channels.slack_support import echo_agent
from tests.channels.test_conversations import listing, new_session, say
from tests.channels.test_http import snapshot
from tests.harness.session_keys import keys_of


async def dumped(redis: Redis, sid: str) -> dict[str, Any]:
    """Every key of the session with its value (and its expiry), to prove it did not change;
    but its readers (which processes read it now: a reader that just left may be let go of
    meanwhile) and its lease (renewed while a turn runs), which no request writes."""
    out: dict[str, Any] = {}
    for key in sorted(k for k in await keys_of(redis, sid) if not k.endswith((":readers", ":lease"))):
        out[key] = (await redis.dump(key), await redis.pexpiretime(key))
    return out


async def history(c: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await c.get(f"/v1/sessions/{sid}/history")
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def texts(items: list[dict[str, Any]]) -> list[str]:
    return [i["text"] for i in items]


async def fork(c: httpx.AsyncClient, sid: str, **body: Any) -> str:
    r = await c.post(f"/v1/sessions/{sid}/fork", json=body)
    assert r.status_code == 201, r.text
    new: str = r.json()["session_id"]
    return new


async def test_a_fork_has_the_history_and_leaves_the_source_as_it_was(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        src = await new_session(c, app="crm")
        for text in ("one", "two", "three"):
            await say(c, src, text)
        before = await dumped(redis, src)
        whole = await fork(c, src)
        assert await dumped(redis, src) == before  # byte for byte
        assert await history(c, whole) == await history(c, src)
        info = (await c.get(f"/v1/sessions/{whole}")).json()
        assert info["metadata"] == {"app": "crm"} and info["status"] == "idle"
        assert info["pending"] == [] and info["queued"] == 0 and info["title"] == "one"
        assert (await listing(c))["items"][0]["session_id"] == whole

        # both go on, each with its own history
        await say(c, whole, "four")
        await say(c, src, "other")
        assert texts(await history(c, whole)) == [
            "one",
            "re:one",
            "two",
            "re:two",
            "three",
            "re:three",
            "four",
            "re:four",
        ]
        assert texts(await history(c, src))[-2:] == ["other", "re:other"]


async def test_editing_a_message_is_a_fork_before_it(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        src = await new_session(c)
        for text in ("one", "two", "three"):
            r = await c.post(f"/v1/sessions/{src}/messages?wait=true", json={"text": text, "message_id": f"m-{text}"})
            assert r.json()["status"] == "completed"
        before = await dumped(redis, src)
        edited = await fork(c, src, before_message_id="m-two")
        assert await dumped(redis, src) == before
        assert await history(c, edited) == (await history(c, src))[:2]  # the source's prefix
        await say(c, edited, "two, better")
        assert texts(await history(c, edited)) == ["one", "re:one", "two, better", "re:two, better"]
        # regenerating the first reply: a fork before its message, the same text again
        regen = await fork(c, src, before_message_id="m-one")
        assert await history(c, regen) == []
        await say(c, regen, "one")
        assert texts(await history(c, regen)) == ["one", "re:one"]


async def test_a_turn_in_progress_is_not_forked(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        src = await new_session(c)
        await say(c, src, "hello")
        r = await c.post(f"/v1/sessions/{src}/messages?wait=true", json={"text": "wipe disk", "message_id": "m-wipe"})
        assert r.json()["status"] == "waiting"
        for body in ({}, {"before_message_id": "m-wipe"}):
            new = await fork(c, src, **body)
            assert texts(await history(c, new)) == ["hello", "re:hello"]
            info = (await c.get(f"/v1/sessions/{new}")).json()
            assert info["status"] == "idle" and info["pending"] == [] and info["queued"] == 0
        pending = (await c.get(f"/v1/sessions/{src}")).json()["pending"]
        assert len(pending) == 1  # the source still waits for its answer
        r = await c.post(
            f"/v1/sessions/{src}/responses", json={"request_id": pending[0]["request_id"], "decision": "approve"}
        )
        assert r.status_code == 202


async def test_a_refused_fork_writes_nothing(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent(), api_keys=("k1", "k2"))
    async with live.client("k1") as c, live.client("k2") as other:
        src = await new_session(c)
        await say(c, src, "hello")
        before = await snapshot(redis)
        for client, body, status, code in (
            (c, {"before_message_id": "never-sent"}, 404, "message_not_found"),
            (c, {"before_message_id": "bad id!"}, 400, "invalid_message_id"),
            (c, {"before_message_id": 5}, 400, "invalid_request"),
            (c, {"after": "x"}, 400, "invalid_request"),
            (other, {}, 404, "session_not_found"),
        ):
            r = await client.post(f"/v1/sessions/{src}/fork", json=body)
            assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)
        r = await c.post("/v1/sessions/ses_00000000000000000000000000/fork", json={})
        assert r.status_code == 404
        assert await snapshot(redis) == before
