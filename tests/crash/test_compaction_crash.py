"""A crash between the summary and the commit of the compacted history: the replacement
compacts again and the conversation is neither lost nor duplicated."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from redis.asyncio import Redis

from tests.conftest import ValkeyServer, free_port
from tests.service import EventTail, Service

MESSAGES = 8


@pytest.fixture
async def service(valkey: ValkeyServer, redis: Redis, tmp_path: Path) -> AsyncIterator[Service]:
    svc = Service(
        tmp_path,
        free_port(),
        REDIS_URL=valkey.url,
        KEEL_AGENT="tests.crash_agent:compacting",
        KEEL_LEASE_MS="1000",
        KEEL_TEST_LOG=str(tmp_path / "calls.jsonl"),
    )
    yield svc
    svc.stop()


async def send_all(c: httpx.AsyncClient, sid: str) -> None:
    for n in range(MESSAGES):
        body = {"text": f"note {n} " + "x" * 120, "message_id": f"m{n}"}
        try:
            assert (await c.post(f"/v1/sessions/{sid}/messages", json=body)).status_code == 202
        except httpx.HTTPError:
            return  # the service died


@pytest.mark.slow
async def test_a_crash_before_the_compacted_history_commits(service: Service, tmp_path: Path) -> None:
    service.start(KEEL_FAILPOINTS="compaction.before_commit=exit")
    async with httpx.AsyncClient(base_url=service.base, timeout=10) as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        tail = EventTail(service.base, sid)
        tail.start()
        try:
            await send_all(c, sid)  # queued as fast as they go; they run in order until the crash
            assert service.wait_exit() == 137, service.log.read_text()
            assert len([e for e in tail.events if e["type"] == "turn.completed"]) < MESSAGES
            service.start()
            await send_all(c, sid)  # as a client would: again, same message ids (each is one turn)
            await tail.wait_for("turn.completed", count=MESSAGES)
            info = (await c.get(f"/v1/sessions/{sid}")).json()
            history = (await c.get(f"/v1/sessions/{sid}/history")).json()["items"]
        finally:
            await tail.stop()
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    summaries = [x for x in calls if x["purpose"] == "compaction"]
    types = [e["type"] for e in tail.events]
    assert len({e["id"] for e in tail.events}) == len(tail.events)  # every event once
    assert types.count("turn.completed") == MESSAGES  # every message answered once
    assert types.count("compaction.requested") == types.count("compaction.completed") + 1  # the lost one
    assert len(summaries) == types.count("compaction.completed") + 1 >= 2
    # every attempt counts, the summary lost in the crash too; the turn's own call was counted when
    # the turn began and the crash came before it was made: at most one more per crash (README)
    assert len(calls) <= info["usage"]["model_calls"] <= len(calls) + 1
    assert info["status"] == "idle"
    # the active history: one summary, then whole turns, each stored once, the newest verbatim
    assert [i["kind"] for i in history].count("summary") == 1 and history[0]["kind"] == "summary"
    assert len({i["id"] for i in history}) == len(history)
    users = [i["text"].split(" ")[1] for i in history if i["kind"] == "message" and i["role"] == "user"]
    assert users == [str(n) for n in range(MESSAGES - len(users), MESSAGES)] and len(users) >= 2
