"""API keys: every /v1 route needs one; a session is visible only to the key that created it."""

from __future__ import annotations

from typing import Any

from harness import Agent
from harness.models import ModelReply, ScriptedModel


def agent() -> Agent:
    return Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="ok")))


async def test_sessions_are_isolated_between_keys(serve: Any) -> None:
    live = await serve(agent(), api_keys=("key-alice", "key-bob"))
    async with live.client("key-alice") as alice, live.client("key-bob") as bob, live.client() as anon:
        r = await alice.post("/v1/sessions")
        assert r.status_code == 201
        sid = r.json()["session_id"]
        assert (await alice.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi"})).status_code == 200
        for path in ("", "/history", "/events"):
            r = await bob.get(f"/v1/sessions/{sid}{path}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        for path, body in (("/messages", {"text": "intrude"}), ("/compact", {}), ("/clear", {}), ("/cancel", {})):
            r = await bob.post(f"/v1/sessions/{sid}{path}", json=body)
            assert r.status_code == 404, path
        r = await anon.get(f"/v1/sessions/{sid}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        async with live.client("key-wrong") as wrong:
            assert (await wrong.post("/v1/sessions")).status_code == 401
        items = (await alice.get(f"/v1/sessions/{sid}/history")).json()["items"]
        assert [i["text"] for i in items] == ["hi", "ok"]  # bob's attempt left nothing
        assert (await anon.get("/healthz")).status_code == 200  # health needs no key


async def test_the_bearer_scheme_is_case_insensitive_and_other_schemes_fail(serve: Any) -> None:
    live = await serve(agent(), api_keys=("k1",))
    async with live.client() as c:
        assert (await c.post("/v1/sessions", headers={"Authorization": "bearer k1"})).status_code == 201
        assert (await c.post("/v1/sessions", headers={"Authorization": "Basic k1"})).status_code == 401
        assert (await c.post("/v1/sessions", headers={"Authorization": "Bearer k1x"})).status_code == 401
        # documented: spaces around the key are ignored; the key itself is compared whole
        assert (await c.post("/v1/sessions", headers={"Authorization": "BEARER    k1"})).status_code == 201
        assert (await c.post("/v1/sessions", headers={"Authorization": "Bearer k 1"})).status_code == 401
        assert (await c.post("/v1/sessions", headers={"Authorization": "Bearerk1"})).status_code == 401
