"""Schemathesis against keel (uvicorn in a thread, a real Valkey): every HTTP operation of the
document with and without an API key, then stateful runs along its links (create a session ->
message, read, cancel, compact, clear, respond, tokens...). Checks: no 5xx, only documented
statuses and media types, answers matching their schemas. The websocket is fuzzed in
test_ws_fuzz.py; the SSE stream only with sessions that do not exist (a stream of a real
session never ends)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from redis import Redis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from channels.openapi import document
from channels.routes import routes
from harness import Agent
from harness.models import ModelReply, ModelRequest, ScriptedModel
from tests.channels.threaded import ThreadedKeel
from tests.conftest import ValkeyServer

KEY = "fuzz-key"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
schema = schemathesis.openapi.from_dict(document(routes())).exclude(path_regex=r"/ws$")
EXAMPLES = 12  # per operation and auth mode: ~40 operations x examples fit in ~25 s


def agent() -> Agent:
    def script(r: ModelRequest) -> ModelReply:
        return ModelReply(text=f"re {r.messages[-1].text[:40]}")

    return Agent(instructions="fuzz", model=ScriptedModel(script))


@pytest.fixture(scope="module")
def keel(valkey: ValkeyServer) -> Iterator[ThreadedKeel]:
    Redis.from_url(valkey.url).flushall()
    with ThreadedKeel(agent(), valkey.url, api_keys=(KEY,), wait_timeout=2.0, demo_page=False) as server:
        yield server


@pytest.fixture(scope="module")
def http() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


@pytest.fixture(params=["key", "no key"])
def auth(request: pytest.FixtureRequest) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"} if request.param == "key" else {}


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much],
)
def test_every_operation_conforms(case: Any, keel: ThreadedKeel, http: requests.Session, auth: dict[str, str]) -> None:
    if not auth and "Authorization" in (case.headers or {}):
        del case.headers["Authorization"]
    case.call_and_validate(base_url=keel.base, session=http, headers=auth, checks=CHECKS, timeout=10)


def test_stateful_runs_along_the_links(keel: ThreadedKeel, http: requests.Session) -> None:
    machine = schema.exclude(path_regex=r"/events$").as_state_machine()

    class Keel(machine):  # type: ignore[misc,valid-type]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": keel.base, "session": http, "headers": {"Authorization": f"Bearer {KEY}"}}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            case.validate_response(response, checks=CHECKS)

    Keel.run(
        settings=settings(
            max_examples=40,
            stateful_step_count=8,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
    )
