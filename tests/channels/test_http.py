"""The HTTP channel over a real server: a whole conversation, page context, bad input."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis
from starlette.requests import Request

from channels.http import query
from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall


def echo_agent(model: ScriptedModel | None = None) -> Agent:
    @tool
    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text.startswith("shout "):
            return ModelReply(tool_calls=[ToolCall("shout", {"text": last.text[6:]})])
        ctx = [m.text.split("\n", 1)[1] for m in r.messages if m.kind in ("context", "sticky")]
        return ModelReply(text=f"{last.text} ctx={ctx}")

    return Agent(instructions="echo", tools=[shout], model=model or ScriptedModel(script))


async def test_a_whole_conversation(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        r = await c.post("/v1/sessions", json={"metadata": {"user": "u1"}})
        assert r.status_code == 201
        sid = r.json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi", "context": "CTX-1"})
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "completed" and body["reply"] == "hi ctx=['CTX-1']"
        assert body["session_id"] == sid and body["message_id"].startswith("msg_")
        assert body["events"][0]["type"] == "message.received"
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "shout hey", "context": ["CTX-2"]})
        assert r.json()["reply"] == "HEY ctx=['CTX-2']"
        r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": "third", "message_id": "client-3"})
        assert r.status_code == 202 and r.json() == {"session_id": sid, "message_id": "client-3", "handled": "queued"}
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "third", "message_id": "client-3"})
        assert r.json()["reply"] == "third ctx=[]"
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["status"] == "idle" and info["pending"] == [] and info["metadata"] == {"user": "u1"}
        assert info["usage"]["model_calls"] == 4 and info["usage"]["input_tokens"] > 0
        items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [(i["role"], i["text"]) for i in items] == [
            ("user", "hi"),
            ("assistant", "hi ctx=['CTX-1']"),
            ("user", "shout hey"),
            ("assistant", ""),
            ("tool", "HEY"),
            ("assistant", "HEY ctx=['CTX-2']"),
            ("user", "third"),
            ("assistant", "third ctx=[]"),
        ]
        assert all(set(i) >= {"id", "role", "text"} for i in items)
        assert "CTX" not in str([i["text"] for i in items if i["role"] != "assistant"])


async def test_health_and_readiness(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        assert (await c.get("/healthz")).json() == {"ok": True}
        assert (await c.get("/readyz")).json() == {"ok": True}


async def snapshot(redis: Redis) -> dict[bytes, Any]:
    """Every key with a digest of its value, to prove a request changed nothing. A stream is its
    entries and its groups' positions and pending counts: a consumer's last-seen time moves
    whenever an idle runner or relay reads (and a new one appears when it first does). A
    session's `readers` (which processes listen to it, and until when) is not its state: a
    reader that opens names its process there, whatever it is sent."""
    out: dict[bytes, Any] = {}
    for key in await redis.keys("*"):
        if key.endswith(b":readers"):
            continue
        if await redis.type(key) == b"stream":
            groups = [(g["name"], g["last-delivered-id"], g["pending"]) for g in await redis.xinfo_groups(key)]
            out[key] = (await redis.xrange(key), groups)
        else:
            out[key] = await redis.dump(key)
    return out


async def jobs_done(redis: Redis) -> None:
    """Until the runners have acknowledged (and so deleted) every turn job: they do so a moment
    after a turn settles, which a snapshot taken meanwhile would see as a change."""
    async with asyncio.timeout(5):
        while any([await redis.xlen(k) for k in await redis.keys("keel:{jobs*}:stream")]):  # noqa: ASYNC110 (Redis state)
            await asyncio.sleep(0.01)


BAD_MESSAGES = [
    (b"{not json", 400, "invalid_json"),
    (b"", 400, "invalid_request"),
    (b"[]", 400, "invalid_request"),
    (b'{"text": 5}', 400, "invalid_request"),
    (b'{"text": ""}', 400, "invalid_request"),
    (b'{"text": "a", "extra": 1}', 400, "invalid_request"),
    (b'{"text": "a", "context": 5}', 400, "invalid_request"),
    (b'{"text": "a", "context": {"k": 5}}', 400, "invalid_request"),
    (b'{"text": "a", "context": ["a", 1]}', 400, "invalid_request"),
    (b'{"text": "a", "message_id": "has space"}', 400, "invalid_message_id"),
    (b'{"text": "a", "message_id": ""}', 400, "invalid_message_id"),
    (b'{"text": "a", "context": {"": "v"}}', 400, "invalid_request"),
    (b'{"text": "a", "context": [' + b",".join([b'"x"'] * 33) + b"]}", 400, "invalid_request"),
    (b'{"text": "' + b"x" * 5000 + b'"}', 413, "too_large"),
    (b'{"text": "a", "context": ' + b"[" * 1500 + b"]" * 1500 + b"}", 400, "invalid_request"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_MESSAGES)
async def test_bad_messages_get_4xx_and_change_nothing(
    serve: Any, redis: Redis, body: bytes, status: int, code: str
) -> None:
    live = await serve(echo_agent(), max_body=4096)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        before = await snapshot(redis)
        r = await c.post(f"/v1/sessions/{sid}/messages", content=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code and r.json()["error"]["message"]
        assert await snapshot(redis) == before


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("POST", "/v1/sessions/ses_00000000000000000000000000/messages", b'{"text":"a"}', 404, "session_not_found"),
        ("POST", "/v1/sessions/..%2F..%2Fetc/messages", b'{"text":"a"}', 404, "not_found"),
        ("POST", "/v1/sessions/ses_{}/messages", b'{"text":"a"}', 404, "session_not_found"),
        ("POST", "/v1/sessions/{sid}/messages?wait=maybe", b'{"text":"a"}', 400, "invalid_query"),
        ("POST", "/v1/sessions/{sid}/messages?wait=true&timeout=-1", b'{"text":"a"}', 400, "invalid_query"),
        ("GET", "/v1/sessions/ses_00000000000000000000000000", b"", 404, "session_not_found"),
        ("GET", "/v1/sessions/nope/history", b"", 404, "session_not_found"),
        ("GET", "/v1/sessions/{sid}/events?after=abc", b"", 400, "invalid_event_id"),
        ("GET", "/v1/sessions/{sid}/events?after=99999999999999999999-0", b"", 400, "invalid_event_id"),
        (
            "GET",
            "/v1/sessions/{sid}/events?after=18446744073709551615-18446744073709551615",
            b"",
            400,
            "invalid_event_id",
        ),
        ("POST", "/v1/sessions", b'{"metadata": ' + b'{"a":' * 1500 + b"1" + b"}" * 1500 + b"}", 400, "invalid_json"),
        ("POST", "/v1/sessions", b'{"metadata": []}', 400, "invalid_request"),
        ("POST", "/v1/sessions", b'{"meta": {}}', 400, "invalid_request"),
        ("PUT", "/v1/sessions/{sid}", b"", 405, "method_not_allowed"),
        ("DELETE", "/v1/sessions/{sid}/history", b"", 405, "method_not_allowed"),
        ("DELETE", "/v1/sessions/ses_00000000000000000000000000", b"", 404, "session_not_found"),
        ("DELETE", "/v1/sessions/nope", b"", 404, "session_not_found"),
        ("DELETE", "/v1/sessions/ses_{}", b"", 404, "session_not_found"),
        ("POST", "/v1/sessions/{sid}/compact", b'{"now": true}', 400, "invalid_request"),
        ("POST", "/v1/sessions/{sid}/clear", b"[1]", 400, "invalid_request"),
        ("POST", "/v1/sessions/{sid}/clear", b"{nope", 400, "invalid_json"),
        ("POST", "/v1/sessions/ses_00000000000000000000000000/compact", b"", 404, "session_not_found"),
        ("POST", "/v1/sessions/ses_00000000000000000000000000/clear", b"{}", 404, "session_not_found"),
        ("GET", "/v1/sessions/{sid}/clear", b"", 405, "method_not_allowed"),
        ("GET", "/v1/nothing-here", b"", 404, "not_found"),
    ],
)
async def test_bad_requests_get_4xx_and_change_nothing(
    serve: Any, redis: Redis, method: str, path: str, body: bytes, status: int, code: str
) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        before = await snapshot(redis)
        r = await c.request(method, path.replace("{sid}", sid), content=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        assert await snapshot(redis) == before


async def test_a_message_id_sent_twice_over_http_is_one_turn(serve: Any) -> None:
    model = ScriptedModel(lambda r: ModelReply(text="once"))
    live = await serve(echo_agent(model))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        a = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "x", "message_id": "m1"})
        b = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "x", "message_id": "m1"})
        assert a.json() == b.json()
        assert len(model.requests) == 1
        assert len((await c.get(f"/v1/sessions/{sid}/history")).json()["items"]) == 2


async def test_history_comes_in_pages(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for n in range(5):
            await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": f"m{n}"})
        whole = (await c.get(f"/v1/sessions/{sid}/history")).json()
        assert len(whole["items"]) == 10 and whole["next_offset"] is None
        pages, offset = [], 0
        while offset is not None:
            page = (await c.get(f"/v1/sessions/{sid}/history", params={"offset": offset, "limit": 4})).json()
            pages.append(page["items"])
            offset = page["next_offset"]
        assert [len(p) for p in pages] == [4, 4, 2]
        assert [i for p in pages for i in p] == whole["items"]
        by_cursor, page = [], (await c.get(f"/v1/sessions/{sid}/history", params={"limit": 3})).json()
        while True:
            by_cursor += page["items"]
            if page["next_cursor"] is None:
                break
            page = (
                await c.get(f"/v1/sessions/{sid}/history", params={"cursor": page["next_cursor"], "limit": 3})
            ).json()
        assert by_cursor == whole["items"]
        for bad in ({"limit": 0}, {"limit": 1001}, {"offset": -1}, {"limit": "x"}):
            r = await c.get(f"/v1/sessions/{sid}/history", params=bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_query"


_NAMES = st.sampled_from([b"wait", b"timeout", b"limit", b"w%61it", b"", b"wait;x"])
_VALUES = st.sampled_from([b"true", b"1", b"", b"%74rue", b"a+b", b"\xe9", b"x=y", b"30"])
_PARTS = st.tuples(_NAMES, st.sampled_from([b"=", b""]), _VALUES).map(b"".join)
_QUERIES = st.lists(st.tuples(_PARTS, st.sampled_from([b"&", b"&&", b";"]))).map(
    lambda ps: b"".join(a + b for a, b in ps)
)


@settings(max_examples=400, deadline=None)
@given(
    raw=_QUERIES,
    name=st.sampled_from(["wait", "timeout", "limit"]),
)
def test_a_query_parameter_reads_as_starlette_parses_it(raw: bytes, name: str) -> None:
    """`query`'s own split of a plain query string gives what Starlette's full parse gives: the
    last value, a bare name as "", escapes and `+` decoded."""
    request = Request({"type": "http", "query_string": raw, "headers": []})
    assert query(request, name) == request.query_params.get(name)
