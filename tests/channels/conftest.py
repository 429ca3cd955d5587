"""Fixtures of the channel tests: keel serving the Slack channel against the local Slack server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from harness import Agent
from tests.channels.slack_server import SECRET, TOKEN, FakeSlack


@pytest.fixture
async def keel(serve: Any, slack: FakeSlack) -> AsyncIterator[Any]:
    """`await keel(agent, **settings)` -> a client for keel serving the Slack channel."""
    clients: list[httpx.AsyncClient] = []

    async def start(agent: Agent, **settings: Any) -> httpx.AsyncClient:
        live = await serve(
            agent,
            slack_signing_secret=SECRET,
            slack_bot_token=TOKEN,
            slack_api_url=slack.url,
            lease_ms=1000,
            **settings,
        )
        client = live.client()
        clients.append(client)
        return client

    yield start
    for c in clients:
        await c.aclose()
