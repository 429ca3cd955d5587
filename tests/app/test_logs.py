"""KEEL_LOG_FORMAT=json: a whole run of `python -m app` with every kind of secret set; every line
is one JSON object, a turn's lines name its session and turn, a request's its request id, and
no secret is in the log or in any error body."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.logs import REDACTED, Redactor
from harness import Agent, tool
from harness.errors import ModelError
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from tests.conftest import free_port
from tests.service import Service

_failed_once: set[str] = set()


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def _script(r: ModelRequest) -> ModelReply:
    if r.turn_id not in _failed_once:  # each turn's first attempt fails, as a provider may
        _failed_once.add(r.turn_id)
        raise ModelError(
            f"Incorrect API key provided: {os.environ.get('OPENAI_API_KEY')}",
            code="model_overloaded",
            retryable=True,
            retry_after=0.0,
        )
    last = r.messages[-1]
    if last.role == "user" and last.text == "add":
        return ModelReply(tool_calls=[ToolCall("add", {"a": 2, "b": 40})])
    return ModelReply(text=f"re: {last.text}")


agent = Agent(instructions="logs", tools=[add], model=ScriptedModel(_script))  # KEEL_AGENT=tests.app.test_logs:agent


def _secret(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


@pytest.mark.slow
async def test_a_json_log_names_its_ids_and_holds_no_secret(tmp_path: Path) -> None:
    key, other_key = _secret("key-"), _secret("key-")
    env = {
        "KEEL_LOG_FORMAT": "json",
        "KEEL_LOG_LEVEL": "info",
        "KEEL_AGENT": "tests.app.test_logs:agent",
        "KEEL_API_KEYS": f"{key},{other_key}",
        "KEEL_TOKEN_SECRET": _secret("tok-"),
        "SLACK_SIGNING_SECRET": _secret("slk-"),
        "SLACK_BOT_TOKEN": _secret("xoxb-"),
        "KEEL_SLACK_API_URL": f"http://127.0.0.1:{free_port()}/api/",  # nobody: auth.test fails, logged
        "LINEAR_WEBHOOK_SECRET": _secret("lin-"),
        "LINEAR_API_KEY": _secret("lin_api_"),
        "KEEL_LINEAR_API_URL": f"http://127.0.0.1:{free_port()}/graphql",
        "OPENAI_API_KEY": _secret("sk-proj-"),
        "ANTHROPIC_API_KEY": _secret("sk-ant-"),
        "KEEL_WEBHOOK_ALLOW_PRIVATE": "1",
    }
    service = Service(tmp_path, free_port(), **env)
    bodies: list[str] = []  # every error body the run got
    found: dict[str, Any] = {}
    service.start()
    try:
        async with httpx.AsyncClient(base_url=service.base, headers={"Authorization": f"Bearer {key}"}) as c:
            r = await c.post("/v1/sessions", headers={"X-Request-ID": "client-req-17"})
            assert r.headers["x-request-id"] == "client-req-17"
            sid = r.json()["session_id"]
            r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "add"})
            assert r.json()["reply"] == "re: 42", r.json()
            assert r.headers["x-request-id"].startswith("req_")  # none given: one made
            r = await c.post("/v1/webhooks", json={"url": "http://127.0.0.1:1/hook", "events": ["*"]})
            assert r.status_code == 201, r.text
            found["whsec"] = r.json()["secret"]
            token = (await c.post(f"/v1/sessions/{sid}/tokens")).json()["token"]
            found["token"] = token
            async with connect(f"ws://127.0.0.1:{service.port}/v1/sessions/{sid}/ws?token={token}") as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "message", "text": "over the socket"}))
                async with asyncio.timeout(20):
                    while '"turn.completed"' not in str(await ws.recv()):
                        pass
            with pytest.raises(ConnectionClosed) as closed:
                async with connect(f"ws://127.0.0.1:{service.port}/v1/sessions/{sid}/ws?token={token}x") as ws:
                    await ws.recv()
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
            for headers, path in (
                ({"Authorization": f"Bearer {key}x"}, f"/v1/sessions/{sid}"),  # a wrong key
                ({"Authorization": f"Bearer {key}"}, f"/v1/sessions/{sid}/nope"),
                ({"x-slack-signature": "v0=00", "x-slack-request-timestamp": "1"}, "/v1/slack/events"),
                ({"linear-signature": "00"}, "/v1/linear/webhook"),
            ):
                r = await c.request("GET" if path.endswith("nope") else "POST", path, headers=headers, content=b"{}")
                assert r.status_code >= 400
                bodies.append(r.text)
            r = await c.get(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {other_key}"})
            assert r.status_code == 404
            bodies.append(r.text)
            assert (await c.get("/metrics", headers={"Authorization": "Bearer wrong"})).status_code == 401
    finally:
        service.stop()

    every_secret = [
        key,
        other_key,
        *(env[k] for k in env if "SECRET" in k or "TOKEN" in k or k.endswith("API_KEY")),
        found["whsec"],
        found["token"],
    ]
    check_log(service.log.read_text(), sid, every_secret, bodies)


def check_log(text: str, sid: str, every_secret: list[str], bodies: list[str]) -> None:
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is JSON
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    turn_lines = [line for line in lines if line["logger"] == "keel.model"]
    assert len(turn_lines) >= 2, text  # each turn's failed first attempt (one over HTTP, one over the socket)
    assert all(line.get("session_id") == sid and line["turn_id"].startswith("turn_") for line in turn_lines)
    requested = [line for line in lines if line.get("request_id") == "client-req-17"]
    assert requested and requested[0]["logger"] == "uvicorn.access", text
    assert any("?token=[redacted]" in line["message"] for line in lines), text  # the socket's line, redacted
    for secret in every_secret:
        assert secret not in text, f"a secret in the log: {secret[:6]}..."
        for body in bodies:
            assert secret not in body


def test_secret_shapes_are_redacted_wherever_they_appear() -> None:
    redact = Redactor(["configured-key-123"])
    line = (
        'GET /ws?after=1-0&token=abc.def "Authorization: Bearer k-1" whsec_Zm9vYmFy xoxb-1-2-abc '
        "sk-proj-abcdefgh12 configured-key-123 task-runner-12345678"
    )
    assert redact(line) == (
        f'GET /ws?after=1-0&token={REDACTED} "Authorization: Bearer {REDACTED}" {REDACTED} {REDACTED} '
        f"{REDACTED} {REDACTED} task-runner-12345678"
    )
