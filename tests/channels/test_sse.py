"""SSE: replay from the start or after an id, then live; heartbeats; every event once."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel


async def read_sse(lines: AsyncIterator[str], until: str, limit: int = 100) -> tuple[list[dict[str, Any]], int]:
    """Parse SSE messages until an event of type `until`; returns (events, heartbeats)."""
    events: list[dict[str, Any]] = []
    beats = 0
    fields: dict[str, str] = {}
    async for line in lines:
        if line.startswith(":"):
            beats += 1
        elif line == "":
            if "data" in fields:
                env = json.loads(fields["data"])
                assert env["id"] == fields["id"] and env["type"] == fields["event"]
                events.append(env)
                if env["type"] == until or len(events) >= limit:
                    return events, beats
            fields = {}
        else:
            name, _, value = line.partition(": ")
            fields[name] = value
    return events, beats


async def test_replay_resume_and_live(serve: Any) -> None:
    gate = asyncio.Event()

    async def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].text == "slow":
            await gate.wait()
        return ModelReply(text="re:" + r.messages[-1].text)

    live = await serve(Agent(instructions="t", model=ScriptedModel(script)))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "one"})
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            first, _ = await asyncio.wait_for(read_sse(resp.aiter_lines(), "turn.completed"), 5)
        types = [e["type"] for e in first]
        assert types[0] == "session.created" and types[-1] == "turn.completed"
        assert [e["seq"] for e in first] == list(range(1, len(first) + 1))

        # resume after the 3rd event with Last-Event-ID, then see a live turn arrive
        after = first[2]["id"]
        async with c.stream("GET", f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": after}) as resp:
            await c.post(f"/v1/sessions/{sid}/messages", json={"text": "slow"})
            gate.set()
            lines = resp.aiter_lines()
            events, _ = await asyncio.wait_for(read_sse(lines, "turn.completed", limit=len(first) - 3), 5)
            rest, _ = await asyncio.wait_for(read_sse(lines, "turn.completed"), 5)
        assert [e["id"] for e in events[: len(first) - 3]] == [e["id"] for e in first[3:]]
        replayed_and_live = events + rest
        ids = [e["id"] for e in replayed_and_live]
        assert len(ids) == len(set(ids))  # no duplicates
        assert replayed_and_live[-1]["data"]["reply"] == "re:slow"

        # ?after= does the same as Last-Event-ID; redelivery is byte-identical
        async with c.stream("GET", f"/v1/sessions/{sid}/events?after={after}") as resp:
            again, _ = await asyncio.wait_for(read_sse(resp.aiter_lines(), "turn.completed"), 5)
        assert again == events[: len(again)]

        # an EventSource reconnects to its first URL (?after=) with a newer Last-Event-ID: the newer wins
        newer = first[-1]["id"]
        headers = {"Last-Event-ID": newer}
        async with c.stream("GET", f"/v1/sessions/{sid}/events?after={after}", headers=headers) as resp:
            resumed, _ = await asyncio.wait_for(read_sse(resp.aiter_lines(), "turn.completed"), 5)
        assert resumed == rest


async def test_heartbeats_keep_an_idle_stream_alive(serve: Any) -> None:
    live = await serve(Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="x"))), sse_heartbeat=0.1)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as resp:
            beats = 0
            async with asyncio.timeout(5):
                async for line in resp.aiter_lines():
                    beats += line.startswith(":")
                    if beats >= 2:
                        break
        assert beats >= 2
