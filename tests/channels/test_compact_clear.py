"""POST /compact and /clear over HTTP: 202 at once, the work queued behind the session's turns,
its events on the session's stream."""

from __future__ import annotations

import json
from typing import Any

from harness import Agent, Compaction
from harness.models import ModelReply, ModelRequest, ScriptedModel


def agent() -> Agent:
    def script(r: ModelRequest) -> ModelReply:
        return ModelReply(text="SUMMARY" if r.purpose == "compaction" else f"re {r.messages[-1].text}")

    return Agent(instructions="t", model=ScriptedModel(script), compaction=Compaction(keep_turns=1))


async def read_events(c: Any, sid: str, until: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    async with c.stream("GET", f"/v1/sessions/{sid}/events") as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if out[-1]["type"] == until:
                    return out
    raise AssertionError("the stream ended")


async def test_compact_then_clear_over_http(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for text in ("one", "two", "three"):
            assert (await c.post(f"/v1/sessions/{sid}/messages", json={"text": text})).status_code == 202
        r = await c.post(f"/v1/sessions/{sid}/compact")  # queued behind the three turns
        assert r.status_code == 202
        compact_id = r.json()["turn_id"]
        events = await read_events(c, sid, "session.waiting")
        types = [e["type"] for e in events]
        assert types.count("turn.completed") == 3 and types.index("compaction.requested") > max(
            i for i, t in enumerate(types) if t == "turn.completed"
        )
        assert [(e["type"], e["turn_id"]) for e in events if e["turn_id"] == compact_id] == [
            ("compaction.requested", compact_id),
            ("usage.recorded", compact_id),
            ("compaction.completed", compact_id),
            ("session.waiting", compact_id),
        ]
        items = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [(i["kind"], i["text"]) for i in items] == [
            ("summary", "[summary of the earlier conversation]\nSUMMARY"),
            ("message", "three"),
            ("message", "re three"),
        ]
        r = await c.post(f"/v1/sessions/{sid}/clear", json={})
        assert r.status_code == 202
        events = await read_events(c, sid, "context.cleared")
        assert events[-1]["data"] == {"items": 3}
        empty = {"items": [], "next_offset": None, "next_cursor": None}
        assert (await c.get(f"/v1/sessions/{sid}/history")).json() == empty
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["session_id"] == sid and info["usage"]["model_calls"] == 4
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "four"})
        assert r.json()["reply"] == "re four"
        r = await c.post(f"/v1/sessions/{sid}/cancel")  # nothing is running: compact/clear are not turns
        assert r.status_code == 409


async def test_history_pages_by_cursor_never_span_a_compaction(serve: Any) -> None:
    """Pages read by `next_cursor` are one history's: a compaction between two pages makes the
    next one 409 `history_replaced` (read again from the start), where an offset would read on
    into the new history and miss its newest items."""
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for text in ("one", "two", "three"):
            assert (await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": text})).status_code == 200
        first = (await c.get(f"/v1/sessions/{sid}/history", params={"limit": 4})).json()
        assert [i["text"] for i in first["items"]] == ["one", "re one", "two", "re two"]
        assert first["next_offset"] == 4 and first["next_cursor"] == "4"
        rest = (await c.get(f"/v1/sessions/{sid}/history", params={"cursor": first["next_cursor"]})).json()
        assert [i["text"] for i in rest["items"]] == ["three", "re three"] and rest["next_cursor"] is None
        compact = (await c.post(f"/v1/sessions/{sid}/compact")).json()["turn_id"]
        events = await read_events(c, sid, "session.waiting")
        assert events[-1]["turn_id"] == compact
        r = await c.get(f"/v1/sessions/{sid}/history", params={"cursor": first["next_cursor"], "limit": 4})
        assert r.status_code == 409 and r.json()["error"]["code"] == "history_replaced"
        # read again from the start: the new history, page by page, then cursors into it
        now = (await c.get(f"/v1/sessions/{sid}/history", params={"limit": 1})).json()
        assert now["items"][0]["kind"] == "summary" and now["next_offset"] == 1
        tail = (await c.get(f"/v1/sessions/{sid}/history", params={"cursor": now["next_cursor"]})).json()
        assert [i["text"] for i in tail["items"]] == ["three", "re three"]
        for bad, code in (({"cursor": "x"}, "invalid_cursor"), ({"cursor": "1", "offset": "1"}, "invalid_query")):
            r = await c.get(f"/v1/sessions/{sid}/history", params=bad)
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
