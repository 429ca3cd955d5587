"""keel driven by the real JavaScript clients: the AI SDK's DefaultChatTransport in a chat built
on `ai`'s AbstractChat (and readUIMessageStream), and @ag-ui/client's HttpAgent, from the
pinned packages in tests/js. Every chunk passed the `ai` package's own schema (its transport
throws on one that does not) and every AG-UI stream the client's verifier, without a warning."""

from __future__ import annotations

from typing import Any

import pytest

from tests.frontend_agent import frontend_agent
from tests.jsclient import NodeScript, run_script, skip_without_node

pytestmark = skip_without_node()


@pytest.fixture
async def keel(serve: Any) -> Any:
    agent, runs, gates = frontend_agent()
    live = await serve(agent)
    c = live.client()

    async def session() -> str:
        sid: str = (await c.post("/v1/sessions")).json()["session_id"]
        return sid

    yield live, c, session, runs, gates
    await c.aclose()


def assistant(done: dict[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = done["messages"][-1]
    assert message["role"] == "assistant"
    return message


async def history_texts(c: Any, sid: str) -> list[tuple[str, str]]:
    items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    return [(i["role"], i["text"]) for i in items]


async def test_use_chat_text(keel: Any) -> None:
    live, c, session, _, _ = keel
    sid = await session()
    done = await run_script("chat.mjs", "text", live.base, sid)
    assert done["status"] == "ready" and done["error"] is None and done["warnings"] == []
    assert [m["role"] for m in done["messages"]] == ["user", "assistant"]
    assert assistant(done)["text"] == "Echo: hello from useChat"
    assert sum(1 for ch in done["chunks"] if ch["type"] == "text-delta") > 1  # it streamed
    user_id = done["messages"][0]["id"]
    items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
    assert items[0]["text"] == "hello from useChat" and items[1]["text"] == "Echo: hello from useChat"
    assert user_id  # (the message's id is keel's message_id: a resend is one message)


async def test_use_chat_regenerate_streams_a_new_reply_from_a_fork(keel: Any) -> None:
    """`regenerate()`: keel forks the session before the last message and sends it again there;
    the new assistant message names the fork (its metadata), the source keeps both turns."""
    live, c, session, _, _ = keel
    sid = await session()
    done = await run_script("chat.mjs", "regenerate", live.base, sid)
    assert done["status"] == "ready" and done["error"] is None and done["warnings"] == []
    assert [(m["role"], m["text"]) for m in done["messages"]] == [
        ("user", "hello one"),
        ("assistant", "Echo: hello one"),
        ("user", "hello two"),
        ("assistant", "Echo: hello two"),
    ]
    fork = assistant(done)["metadata"]["keel"]["session_id"]
    assert fork != sid
    both = [
        ("user", "hello one"),
        ("assistant", "Echo: hello one"),
        ("user", "hello two"),
        ("assistant", "Echo: hello two"),
    ]
    assert await history_texts(c, fork) == both
    assert await history_texts(c, sid) == both  # the source as it was (the same replies: the agent echoes)
    source_turns = (await c.get(f"/v1/sessions/{sid}")).json()["usage"]["model_calls"]
    assert source_turns == 2 and (await c.get(f"/v1/sessions/{fork}")).json()["usage"]["model_calls"] == 1


async def test_use_chat_tools(keel: Any) -> None:
    live, _, session, runs, _ = keel
    done = await run_script("chat.mjs", "tools", live.base, await session())
    message = assistant(done)
    (part,) = message["tools"]
    assert part["type"] == "tool-weather" and part["state"] == "output-available"
    assert part["input"] == {"city": "Lisbon"} and part["output"] == "sunny in Lisbon"
    assert message["text"] == "Looking it up.Done: sunny in Lisbon"
    assert list(runs.values()) == [1]


@pytest.mark.parametrize("answer", ["approve", "deny"])
async def test_use_chat_approval_round_trip(keel: Any, answer: str) -> None:
    live, c, session, runs, _ = keel
    sid = await session()
    done = await run_script("chat.mjs", answer, live.base, sid)
    assert done["status"] == "ready" and done["error"] is None
    message = assistant(done)
    assert [m["role"] for m in done["messages"]] == ["user", "assistant"]  # one assistant message, continued
    (part,) = message["tools"]
    if answer == "approve":
        assert part["state"] == "output-available" and part["output"] == "paid 42"
        assert list(runs.values()) == [1]
        assert message["text"] == "I will pay.Done: paid 42"
    else:
        assert part["state"] == "output-denied" and not runs
    assert (await c.get(f"/v1/sessions/{sid}")).json()["status"] == "idle"
    # the answer again, as a client that retried would send it: nothing more runs
    asked = next(ch for ch in done["chunks"] if ch["type"] == "tool-approval-request")
    again = {
        "id": sid,
        "messages": [
            {
                "id": message["id"],
                "role": "assistant",
                "parts": [
                    {
                        **part,
                        "state": "approval-responded",
                        "approval": {"id": asked["approvalId"], "approved": answer == "approve"},
                    }
                ],
            }
        ],
        "trigger": "submit-message",
    }
    async with c.stream("POST", "/v1/chat", json=again) as resp:
        assert resp.status_code == 200
        await resp.aread()
    assert sum(runs.values()) == (1 if answer == "approve" else 0)


async def test_use_chat_resumes_after_the_page_dropped_mid_turn(keel: Any) -> None:
    live, c, session, _, gates = keel
    sid = await session()
    run = await NodeScript.start("chat.mjs", "drop-and-resume", live.base, sid)
    try:
        await run.until("resumed")
        gates.slow.set()
        run.say()
        done = await run.until("done")
    finally:
        await run.close()
    assert done["status"] == "ready" and done["error"] is None, done
    (message,) = done["messages"]  # the reloaded page holds the resumed message only
    reply = "That took a while, but here it is: the slow reply."
    assert message["text"] == reply
    assert ("assistant", reply) in await history_texts(c, sid)
    assert (await c.get(f"/v1/chat/{sid}/stream")).status_code == 204


async def test_use_chat_resume_with_nothing_running_is_ready(keel: Any) -> None:
    live, _, session, _, _ = keel
    done = await run_script("chat.mjs", "resume", live.base, await session())
    assert done["status"] == "ready" and done["messages"] == [] and done["chunks"] == []


async def test_read_ui_message_stream(keel: Any) -> None:
    live, _, session, _, _ = keel
    done = await run_script("chat.mjs", "read", live.base, await session())
    (message,) = done["messages"]
    assert message["text"] == "Looking it up.Done: sunny in Porto"
    assert message["tools"][0]["output"] == "sunny in Porto"
