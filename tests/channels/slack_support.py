"""What the Slack tests share: an agent, signed requests to keel, and ways to wait for the
relay (never by sleeping)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from redis.asyncio import Redis

from harness import Agent, tool
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from tests.channels.slack_server import FakeSlack, signed

RELAY_JOBS = "keel:{relay}:stream"


def echo_agent(ran: list[str] | None = None, gate: asyncio.Event | None = None) -> Agent:
    """Replies "re:<text>"; "wipe X" asks for approval to run the `wipe` tool (recorded in `ran`);
    with `gate`, every model call waits for it."""
    ran = ran if ran is not None else []

    @tool(approval=True)
    def wipe(target: str) -> str:
        """Wipe a target."""
        ran.append(target)
        return f"wiped {target}"

    async def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if gate is not None:
            await gate.wait()
        if last.role == "user" and last.text.startswith("wipe "):
            return ModelReply(tool_calls=[ToolCall("wipe", {"target": last.text[5:]})])
        if last.role == "tool":
            return ModelReply(text=f"done: {last.text}")
        return ModelReply(text=f"re:{last.text}")

    return Agent(instructions="t", tools=[wipe], model=ScriptedModel(script))


async def post_event(c: httpx.AsyncClient, body: bytes, **headers: str) -> httpx.Response:
    return await c.post(
        "/v1/slack/events", content=body, headers={"Content-Type": "application/json", **signed(body, **headers)}
    )


async def click(c: httpx.AsyncClient, body: bytes, **kw: Any) -> httpx.Response:
    return await c.post(
        "/v1/slack/interactivity",
        content=body,
        headers={"Content-Type": "application/x-www-form-urlencoded", **signed(body, **kw)},
    )


def replies(slack: FakeSlack, thread: str) -> list[str]:
    return [m.text for m in slack.posts(thread)]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 15.0, what: str = "") -> None:
    """Wait until `check()` holds, looking every 20 ms, failing after `timeout` seconds."""
    async with asyncio.timeout(timeout):
        while not await check():  # noqa: ASYNC110 (a condition in Redis: there is no event to wait on)
            await asyncio.sleep(0.02)


async def relay_done(redis: Redis, timeout: float = 20.0) -> None:
    """Every relay job taken and acknowledged: the relays have nothing left to do (a job that
    fails is never acknowledged, so this also waits out a relay that keeps failing)."""

    async def drained() -> bool:
        return int(await redis.xlen(RELAY_JOBS)) == 0

    await eventually(drained, timeout)


async def dead_letters(redis: Redis, timeout: float = 15.0) -> list[Any]:
    """The dead letters, once there is one."""
    from harness.store import Deliveries

    found: list[Any] = []

    async def some() -> bool:
        found[:] = await Deliveries(redis).dead("slack")
        return bool(found)

    await eventually(some, timeout)
    return found
