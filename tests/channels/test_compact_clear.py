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
        assert (await c.get(f"/v1/sessions/{sid}/history")).json() == {"items": [], "next_offset": None}
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["session_id"] == sid and info["usage"]["model_calls"] == 4
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "four"})
        assert r.json()["reply"] == "re four"
        r = await c.post(f"/v1/sessions/{sid}/cancel")  # nothing is running: compact/clear are not turns
        assert r.status_code == 409
