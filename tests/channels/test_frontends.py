"""The frontend protocols over HTTP, read as a client of each would: the AI SDK's UI message
stream (`/v1/chat`) and AG-UI (`/v1/agui`). The real JavaScript clients drive the same routes
in tests/js; these pin keel's side: what is streamed, what is recorded, what is refused."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.frontend_agent import frontend_agent, text_of


async def chunks_of(
    c: httpx.AsyncClient, method: str, url: str, body: Any = None, first: asyncio.Event | None = None
) -> list[dict[str, Any]]:
    """The JSON of every `data:` line until the stream ends (`[DONE]` is kept as a string);
    `first` is set when the first one came."""
    out: list[Any] = []
    async with c.stream(method, url, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                raw = line[6:]
                out.append(raw if raw == "[DONE]" else json.loads(raw))
                if first is not None:
                    first.set()
    return out


def user(text: str, mid: str) -> dict[str, Any]:
    return {"id": mid, "role": "user", "parts": [{"type": "text", "text": text}]}


@pytest.fixture
async def chat(serve: Any) -> Any:
    agent, runs, gates = frontend_agent()
    live = await serve(agent)
    c = live.client()
    sid = (await c.post("/v1/sessions")).json()["session_id"]
    yield c, sid, runs, gates
    await c.aclose()


async def test_ui_stream_of_a_text_turn(chat: Any) -> None:
    c, sid, _, _ = chat
    body = {"id": sid, "messages": [user("hello there", "m1")], "trigger": "submit-message"}
    got = await chunks_of(c, "POST", "/v1/chat", body)
    assert got[-1] == "[DONE]"
    types = [g["type"] for g in got[:-1]]
    assert types[0] == "start" and types[1] == "start-step" and types[-2:] == ["finish-step", "finish"]
    assert got[-2]["finishReason"] == "stop"
    assert text_of(got[:-1]) == "Echo: hello there"
    assert types.count("text-start") == 1 and types.count("text-end") == 1
    # the reply is history; the same message id again is the same turn, replayed whole
    again = await chunks_of(c, "POST", "/v1/chat", body)
    assert text_of(again[:-1]) == "Echo: hello there" and again[0]["messageId"] == got[0]["messageId"]
    history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    assert [i["role"] for i in history] == ["user", "assistant"]


async def test_ui_stream_of_a_tool_turn(chat: Any) -> None:
    c, sid, runs, _ = chat
    got = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("weather Oslo", "m1")]})
    tool_in = next(g for g in got if g != "[DONE]" and g["type"] == "tool-input-available")
    assert tool_in["toolName"] == "weather" and tool_in["input"] == {"city": "Oslo"}
    tool_out = next(g for g in got if g != "[DONE]" and g["type"] == "tool-output-available")
    assert tool_out == {"type": "tool-output-available", "toolCallId": tool_in["toolCallId"], "output": "sunny in Oslo"}
    assert text_of(got[:-1]) == "Looking it up.Done: sunny in Oslo"
    assert [g["type"] for g in got[:-1]].count("start-step") == 2
    assert list(runs.values()) == [1]


async def test_ui_approval_round_trip_runs_the_tool_once(chat: Any) -> None:
    c, sid, runs, _ = chat
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 30", "m1")]})
    asked = next(g for g in first if g != "[DONE]" and g["type"] == "tool-approval-request")
    assert first[-2] == {"type": "finish", "finishReason": "tool-calls"} and not runs
    message_id = first[0]["messageId"]
    answered = {
        "id": message_id,
        "role": "assistant",
        "parts": [
            {"type": "step-start"},
            {"type": "text", "text": "I will pay.", "state": "done"},
            {
                "type": "tool-pay",
                "toolCallId": asked["toolCallId"],
                "state": "approval-responded",
                "input": {"amount": 30},
                "approval": {"id": asked["approvalId"], "approved": True},
            },
        ],
    }
    body = {"id": sid, "messages": [user("pay 30", "m1"), answered], "trigger": "submit-message"}
    rest = await chunks_of(c, "POST", "/v1/chat", body)
    assert rest[0] == {"type": "start", "messageId": message_id}
    types = [g["type"] for g in rest[:-1]]
    assert "tool-input-available" not in types and "tool-approval-request" not in types  # sent by the first stream
    out = next(g for g in rest[:-1] if g["type"] == "tool-output-available")
    assert out["output"] == "paid 30" and text_of(rest[:-1]) == "Done: paid 30"
    assert list(runs.values()) == [1]
    # the same answer again changes nothing; a different one is refused
    again = await chunks_of(c, "POST", "/v1/chat", body)
    assert text_of(again[:-1]) == "Done: paid 30" and list(runs.values()) == [1]
    answered["parts"][2]["approval"]["approved"] = False
    refused = await c.post("/v1/chat", json=body)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "already_answered"


async def test_ui_denied_call_streams_denied(chat: Any) -> None:
    c, sid, runs, _ = chat
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 99", "m1")]})
    asked = next(g for g in first if g != "[DONE]" and g["type"] == "tool-approval-request")
    part = {
        "type": "tool-pay",
        "toolCallId": asked["toolCallId"],
        "state": "approval-responded",
        "approval": {"id": asked["approvalId"], "approved": False, "reason": "too much"},
    }
    message = {"id": first[0]["messageId"], "role": "assistant", "parts": [part]}
    rest = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [message]})
    assert {"type": "tool-output-denied", "toolCallId": asked["toolCallId"]} in rest
    assert not any(g != "[DONE]" and g["type"] == "tool-output-error" for g in rest)
    assert not runs


async def test_ui_resume_streams_the_turn_in_progress_then_204(chat: Any) -> None:
    c, sid, _, gates = chat
    assert (await c.get(f"/v1/chat/{sid}/stream")).status_code == 204
    started = asyncio.create_task(chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("slow", "m1")]}))
    await asyncio.wait_for(gates.slow_began.wait(), 5)
    started.cancel()  # the client goes away: the turn goes on
    joined = asyncio.Event()
    resumed = asyncio.create_task(chunks_of(c, "GET", f"/v1/chat/{sid}/stream", first=joined))
    await asyncio.wait_for(joined.wait(), 5)
    gates.slow.set()
    got = await asyncio.wait_for(resumed, 10)
    assert got[0]["type"] == "start" and got[-1] == "[DONE]" and got[-2]["finishReason"] == "stop"
    assert text_of(got[:-1]) == "That took a while, but here it is: the slow reply."
    assert (await c.get(f"/v1/chat/{sid}/stream")).status_code == 204


async def test_ui_failed_turn_is_an_error_chunk(chat: Any) -> None:
    c, sid, _, _ = chat
    got = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("fail", "m1")]})
    err = next(g for g in got if g != "[DONE]" and g["type"] == "error")
    assert "the model is down" in err["errorText"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"id": "ses_nope", "messages": [user("hi", "m1")]}, 404, "session_not_found"),
        ({"messages": [user("hi", "m1")]}, 400, "invalid_request"),
        ({"id": "SID", "messages": []}, 400, "invalid_request"),
        ({"id": "SID", "messages": [user("hi", "m1")], "trigger": "regenerate-message"}, 404, "message_not_found"),
        (
            {"id": "SID", "messages": [{"id": "a", "role": "assistant", "parts": []}], "trigger": "regenerate-message"},
            400,
            "invalid_request",
        ),
        ({"id": "SID", "messages": [user("  ", "m1")]}, 400, "invalid_request"),
        ({"id": "SID", "messages": [user("hi", "bad id!")]}, 400, "invalid_message_id"),
        ({"id": "SID", "messages": [{"id": "a", "role": "assistant", "parts": []}]}, 400, "nothing_to_answer"),
    ],
)
async def test_ui_bad_requests_change_nothing(chat: Any, body: dict[str, Any], status: int, code: str) -> None:
    c, sid, _, _ = chat
    if body.get("id") == "SID":
        body = {**body, "id": sid}
    resp = await c.post("/v1/chat", json=body)
    assert resp.status_code == status and resp.json()["error"]["code"] == code
    assert (await c.get(f"/v1/sessions/{sid}/history")).json()["items"] == []


def agui_events(chunks: list[Any]) -> list[str]:
    return [e["type"] for e in chunks]


async def test_agui_text_tools_interrupt_and_resume(chat: Any) -> None:
    c, sid, runs, _ = chat

    def run(run_id: str, messages: list[Any], **extra: Any) -> dict[str, Any]:
        return {
            "threadId": sid,
            "runId": run_id,
            "messages": messages,
            "state": {},
            "tools": [],
            "context": [],
            **extra,
        }

    hello = {"id": "u1", "role": "user", "content": "weather Rome"}
    got = await chunks_of(c, "POST", "/v1/agui", run("r1", [hello]))
    types = agui_events(got)
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED"
    assert got[-1]["outcome"] == {"type": "success"}
    assert "TOOL_CALL_START" in types and "TOOL_CALL_RESULT" in types
    result = next(e for e in got if e["type"] == "TOOL_CALL_RESULT")
    assert result["content"] == "sunny in Rome"
    text = "".join(e["delta"] for e in got if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert text == "Looking it up.Done: sunny in Rome"
    assert all(isinstance(e["timestamp"], int) for e in got)

    pay = {"id": "u2", "role": "user", "content": "pay 7"}
    asked = await chunks_of(c, "POST", "/v1/agui", run("r2", [hello, pay]))
    outcome = asked[-1]["outcome"]
    assert outcome["type"] == "interrupt" and outcome["interrupts"][0]["reason"] == "tool_approval"
    interrupt = outcome["interrupts"][0]
    assert not runs or list(runs.values()) == [1]  # (weather ran once)
    resume = [{"interruptId": interrupt["id"], "status": "resolved", "payload": {"approved": True}}]
    rest = await chunks_of(c, "POST", "/v1/agui", run("r3", [hello, pay], resume=resume))
    assert agui_events(rest)[0] == "RUN_STARTED" and rest[-1]["outcome"] == {"type": "success"}
    assert "TOOL_CALL_START" not in agui_events(rest)  # the interrupted run sent it
    assert next(e for e in rest if e["type"] == "TOOL_CALL_RESULT")["content"] == "paid 7"
    assert sorted(runs.values()) == [1, 1]
    again = await chunks_of(c, "POST", "/v1/agui", run("r4", [hello, pay], resume=resume))
    assert next(e for e in again if e["type"] == "TOOL_CALL_RESULT")["content"] == "paid 7"
    assert sorted(runs.values()) == [1, 1]
    cancelled = [{"interruptId": interrupt["id"], "status": "cancelled"}]
    refused = await c.post("/v1/agui", json=run("r5", [hello, pay], resume=cancelled))
    assert refused.status_code == 409


async def test_agui_failed_turn_and_bad_input(chat: Any) -> None:
    c, sid, _, _ = chat
    got = await chunks_of(
        c,
        "POST",
        "/v1/agui",
        {"threadId": sid, "runId": "r1", "messages": [{"id": "u", "role": "user", "content": "fail"}]},
    )
    assert got[-1]["type"] == "RUN_ERROR" and got[-1]["message"] == "the model is down"
    bad = await c.post("/v1/agui", json={"threadId": sid, "runId": "r2", "messages": []})
    assert bad.status_code == 400
    other = await c.post(
        "/v1/agui", json={"threadId": "ses_x", "runId": "r", "messages": [{"id": "u", "role": "user"}]}
    )
    assert other.status_code in (400, 404)


async def test_a_browser_opens_the_frontend_routes_with_a_session_token_from_an_allowed_origin(serve: Any) -> None:
    agent, _, _ = frontend_agent()
    live = await serve(agent, api_keys=("the-key",), allowed_origins=("http://app.example",))
    async with live.client("the-key") as backend, live.client() as browser:
        sid = (await backend.post("/v1/sessions")).json()["session_id"]
        other = (await backend.post("/v1/sessions")).json()["session_id"]
        token = (await backend.post(f"/v1/sessions/{sid}/tokens")).json()["token"]
        theirs = (await backend.post(f"/v1/sessions/{other}/tokens")).json()["token"]
        body = {"id": sid, "messages": [user("hello", "m1")]}
        origin = {"Origin": "http://app.example"}

        # the preflight is answered without a key, for the allowed origin only
        pre = {**origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        ok = await browser.options("/v1/chat", headers=pre)
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
        assert ok.headers["x-request-id"].startswith("req_")
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        elsewhere = await browser.options("/v1/chat", headers={**pre, "Origin": "http://evil.example"})
        assert elsewhere.status_code == 400 and "access-control-allow-origin" not in elsewhere.headers
        assert "access-control-allow-origin" not in (await browser.options("/v1/sessions", headers=pre)).headers

        # no key or token, another session's token, a forged one: 401, nothing recorded
        for headers in ({}, {"Authorization": f"Bearer {theirs}"}, {"Authorization": "Bearer forged.token"}):
            refused = await browser.post("/v1/chat", json=body, headers={**origin, **headers})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
            assert refused.headers["x-request-id"].startswith("req_")
        assert (await backend.get(f"/v1/sessions/{sid}/history")).json()["items"] == []
        assert (
            await browser.get(f"/v1/chat/{sid}/stream", headers={"Authorization": f"Bearer {theirs}"})
        ).status_code == 401
        # the token opens this session's chat and nothing else of the API
        browser.headers["Authorization"] = f"Bearer {token}"
        async with browser.stream("POST", "/v1/chat", json=body, headers=origin) as resp:
            assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == "http://app.example"
            assert "x-vercel-ai-ui-message-stream" in resp.headers["access-control-expose-headers"].lower()
            await resp.aread()
        assert (await browser.get(f"/v1/chat/{sid}/stream")).status_code == 204
        assert (await browser.get(f"/v1/sessions/{sid}")).status_code == 401
        run = {"threadId": sid, "runId": "r1", "messages": [{"id": "u2", "role": "user", "content": "hi"}]}
        got = await chunks_of(browser, "POST", "/v1/agui", run)
        assert got[-1]["type"] == "RUN_FINISHED"
        history = (await backend.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [i["text"] for i in history] == ["hello", "Echo: hello", "hi", "Echo: hi"]


async def test_a_browser_regenerating_gets_a_token_for_the_fork(serve: Any) -> None:
    agent, _, _ = frontend_agent()
    live = await serve(agent, api_keys=("the-key",))
    async with live.client("the-key") as backend, live.client() as browser:
        sid = (await backend.post("/v1/sessions")).json()["session_id"]
        token = (await backend.post(f"/v1/sessions/{sid}/tokens")).json()["token"]
        browser.headers["Authorization"] = f"Bearer {token}"
        await chunks_of(browser, "POST", "/v1/chat", {"id": sid, "messages": [user("hello", "m1")]})
        again = {"id": sid, "messages": [user("hello", "m1")], "trigger": "regenerate-message"}
        async with browser.stream("POST", "/v1/chat", json=again) as resp:
            assert resp.status_code == 200
            fork = resp.headers["x-keel-session-id"]
            lines = [json.loads(line[6:]) async for line in resp.aiter_lines() if line.startswith("data: {")]
        keel = lines[0]["messageMetadata"]["keel"]
        assert lines[0]["type"] == "start" and keel["session_id"] == fork != sid
        assert text_of(lines) == "Echo: hello"
        # the source's token does not open the fork; the fork's does, and nothing else
        assert (await browser.get(f"/v1/chat/{fork}/stream")).status_code == 401
        browser.headers["Authorization"] = f"Bearer {keel['token']}"
        got = await chunks_of(browser, "POST", "/v1/chat", {"id": fork, "messages": [user("next", "m2")]})
        assert text_of(got[:-1]) == "Echo: next"
        assert (await browser.get(f"/v1/chat/{sid}/stream")).status_code == 401
        history = (await backend.get(f"/v1/sessions/{fork}/history")).json()["items"]
        assert [i["text"] for i in history] == ["hello", "Echo: hello", "next", "Echo: next"]


def approval_of(chunks: list[Any]) -> list[dict[str, Any]]:
    return [g for g in chunks if g != "[DONE]" and g["type"] == "tool-approval-request"]


def answered(message_id: str, asked: list[dict[str, Any]], approved: list[bool]) -> dict[str, Any]:
    parts = [
        {
            "type": "tool-pay",
            "toolCallId": a["toolCallId"],
            "state": "approval-responded",
            "approval": {"id": a["approvalId"], "approved": ok},
        }
        for a, ok in zip(asked, approved, strict=True)
    ]
    return {"id": message_id, "role": "assistant", "parts": parts}


async def test_answering_one_of_two_requests_ends_the_stream_waiting_on_the_other(chat: Any) -> None:
    c, sid, runs, _ = chat
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 1 2", "m1")]})
    asked = approval_of(first)
    assert len(asked) == 2
    rest = await asyncio.wait_for(
        chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [answered(first[0]["messageId"], asked[:1], [True])]}),
        10,
    )
    assert rest[-2] == {"type": "finish", "finishReason": "tool-calls"} and not runs
    run = {
        "threadId": sid,
        "runId": "r",
        "resume": [{"interruptId": asked[1]["approvalId"], "status": "resolved", "payload": {"approved": True}}],
    }
    done = await asyncio.wait_for(chunks_of(c, "POST", "/v1/agui", run), 10)
    assert done[-1]["outcome"] == {"type": "success"} and sorted(runs.values()) == [1, 1]


async def test_a_bad_answer_beside_a_good_one_records_neither(chat: Any) -> None:
    c, sid, runs, _ = chat
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 3", "m1")]})
    (asked,) = approval_of(first)
    bogus = {"approvalId": "req_nope", "toolCallId": "nope"}
    for run in (
        {
            "threadId": sid,
            "runId": "r",
            "resume": [
                {"interruptId": asked["approvalId"], "status": "resolved", "payload": {"approved": True}},
                {"interruptId": "req_nope", "status": "resolved", "payload": {"approved": True}},
            ],
        },
        {
            "threadId": sid,
            "runId": "r",
            "resume": [
                {"interruptId": asked["approvalId"], "status": "resolved", "payload": {"approved": True}},
                {"interruptId": asked["approvalId"], "status": "resolved", "payload": {"approved": "yes"}},
            ],
        },
    ):
        refused = await c.post("/v1/agui", json=run)
        assert refused.status_code in (400, 404), refused.text
    refused = await c.post("/v1/chat", json={"id": sid, "messages": [answered("turn_x", [asked, bogus], [True, True])]})
    assert refused.status_code == 404
    info = (await c.get(f"/v1/sessions/{sid}")).json()
    assert info["status"] == "waiting" and [p["request_id"] for p in info["pending"]] == [asked["approvalId"]]
    assert not runs


async def test_a_turn_cancelled_while_it_waits_ends_both_clients_streams(chat: Any) -> None:
    c, sid, runs, _ = chat
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 4", "m1")]})
    (asked,) = approval_of(first)
    assert (await c.post(f"/v1/sessions/{sid}/cancel")).status_code == 202
    # useChat's answer to the withdrawn request: the call is refused, the stream says interrupted
    rest = await asyncio.wait_for(
        chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [answered(first[0]["messageId"], [asked], [True])]}),
        10,
    )
    assert {"type": "tool-output-denied", "toolCallId": asked["toolCallId"]} in rest
    assert rest[-2] == {"type": "finish", "finishReason": "interrupted"} and not runs
    # AG-UI's resume of it (the client must answer every interrupt it holds) ends the run as cancelled
    run = {"threadId": sid, "runId": "r", "resume": [{"interruptId": asked["approvalId"], "status": "cancelled"}]}
    done = await asyncio.wait_for(chunks_of(c, "POST", "/v1/agui", run), 10)
    assert done[-1]["type"] == "RUN_FINISHED" and done[-1]["outcome"] == {"type": "cancelled"}


async def test_a_new_message_while_a_turn_waits_for_approval_is_refused(chat: Any) -> None:
    c, sid, _, _ = chat
    first = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 5", "m1")]})
    assert approval_of(first)
    refused = await c.post("/v1/chat", json={"id": sid, "messages": [user("hello?", "m2")]})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "awaiting_approval"
    agui_refused = await c.post(
        "/v1/agui", json={"threadId": sid, "runId": "r", "messages": [{"id": "m3", "role": "user", "content": "hi"}]}
    )
    assert agui_refused.status_code == 409
    again = await chunks_of(
        c, "POST", "/v1/chat", {"id": sid, "messages": [user("pay 5", "m1")]}
    )  # (its own resend replays)
    assert approval_of(again) == approval_of(first)
    assert (await c.get(f"/v1/sessions/{sid}")).json()["queued"] == 0


async def test_a_sent_message_edited_goes_on_in_a_fork(chat: Any) -> None:
    """useChat's edit (the same message id, other text): the session is forked before the
    message and the new text sent there; the source is left as it was."""
    c, sid, _, _ = chat
    await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("hello", "m1")]})
    await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("more", "m2")]})
    edited = await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("goodbye", "m2")], "messageId": "m2"})
    fork = edited[0]["messageMetadata"]["keel"]["session_id"]
    assert text_of(edited[:-1]) == "Echo: goodbye"
    history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    assert [i["text"] for i in history] == ["hello", "Echo: hello", "more", "Echo: more"]
    history = (await c.get(f"/v1/sessions/{fork}/history")).json()["items"]
    assert [i["text"] for i in history] == ["hello", "Echo: hello", "goodbye", "Echo: goodbye"]
    # the AG-UI run has no edit: the same message id with other text stays refused
    run = {"threadId": sid, "runId": "r9", "messages": [{"id": "m2", "role": "user", "content": "other"}]}
    refused = await c.post("/v1/agui", json=run)
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "message_edited"


async def test_resume_during_a_compaction_is_nothing_to_resume(chat: Any) -> None:
    c, sid, _, _ = chat
    await chunks_of(c, "POST", "/v1/chat", {"id": sid, "messages": [user("hello", "m1")]})
    assert (await c.post(f"/v1/sessions/{sid}/compact")).status_code == 202
    assert (await c.get(f"/v1/chat/{sid}/stream")).status_code == 204  # (a compaction is no chat turn)
