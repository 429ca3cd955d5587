"""GET /metrics: the families an operator scrapes, moving by what a turn does; behind the API
keys when there are keys; a worker's on its own port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from harness import Agent, tool
from harness.errors import ModelError
from harness.models import ModelReply, ModelRequest, ScriptedModel, ToolCall
from tests.conftest import ROOT, ValkeyServer, free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def agent() -> Agent:
    @tool
    def shout(text: str) -> str:
        """Upper-case a text."""
        return text.upper()

    def script(r: ModelRequest) -> ModelReply:
        last = r.messages[-1]
        if last.role == "user" and last.text == "fail":
            raise ModelError("no", code="model_invalid_request")
        if last.role == "user" and last.text.startswith("shout "):
            return ModelReply(tool_calls=[ToolCall("shout", {"text": last.text[6:]})])
        return ModelReply(text=f"ok {last.text}")

    return Agent(instructions="m", tools=[shout], model=ScriptedModel(script))


def parse(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def scrape(c: httpx.AsyncClient) -> Samples:
    r = await c.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def moved(before: Samples, after: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in after, f"{key} not in {sorted(k for k in after if k[0].startswith(name[:12]))}"
    return after[key] - before.get(key, 0.0)


async def test_the_families_move_when_turns_run(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        before = await scrape(c)
        for family in (
            "keel_turns_total",
            "keel_job_queue_depth",
            "keel_job_queue_oldest_age_seconds",
            "keel_redis_errors_total",
            "keel_websockets_open",
            "keel_sse_streams_open",
            "keel_lease_takeovers_total",
            "keel_relay_dead_letters_total",
            "keel_relay_delivery_lag_seconds_count",
        ):
            assert any(name == family for name, _ in before), family
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi"})
        assert r.json()["status"] == "completed"
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "fail"})
        assert r.json()["status"] == "failed"
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "shout hey"})
        assert r.json()["reply"] == "ok HEY"
        async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
            await ws.recv()  # the socket is admitted and replaying: it counts as open
            during = await scrape(c)
        after = await scrape(c)

    assert moved(before, after, "keel_turns_total", outcome="completed") == 2
    assert moved(before, after, "keel_turns_total", outcome="failed") == 1
    assert moved(before, after, "keel_turns_total", outcome="cancelled") == 0
    assert moved(before, after, "keel_turn_duration_seconds_count") == 3
    assert moved(before, after, "keel_model_call_duration_seconds_count") == 4  # two for the tool turn
    assert moved(before, after, "keel_model_attempts_total", outcome="ok") == 3
    assert moved(before, after, "keel_model_attempts_total", outcome="model_invalid_request") == 1
    assert moved(before, after, "keel_tool_duration_seconds_count", tool="shout") == 1
    assert moved(before, after, "keel_tool_duration_seconds_bucket", tool="shout", le="+Inf") == 1
    # session.created, then per turn message.received, turn.started, usage.recorded and its ending
    assert moved(before, after, "keel_events_committed_total", type="session.created") == 1
    assert moved(before, after, "keel_events_committed_total", type="turn.completed") == 2
    assert moved(before, after, "keel_events_committed_total", type="turn.failed") == 1
    assert moved(before, after, "keel_events_committed_total", type="tool.completed") == 1
    # prompt-cache health: the turn calls' input tokens by agent and model, and their cached share
    labels = {"agent": "agent", "model": "scripted"}
    assert moved(before, after, "keel_prompt_input_tokens_total", **labels) > 0
    assert ("keel_prompt_cache_read_ratio", tuple(sorted(labels.items()))) in after
    assert not any(name == "keel_prompt_cache_busts_total" for name, _ in after)  # (no session's prefix changed)
    assert during[("keel_websockets_open", ())] == before[("keel_websockets_open", ())] + 1
    assert after[("keel_job_queue_depth", ())] >= 0


async def test_a_waiting_and_a_cancelled_turn(serve: Any) -> None:
    @tool(approval=True)
    def order(item: str) -> str:
        """Order something."""
        return "ordered"

    def script(r: ModelRequest) -> ModelReply:
        if r.messages[-1].role == "user" and r.messages[-1].text == "buy":
            return ModelReply(tool_calls=[ToolCall("order", {"item": "lamp"})])
        return ModelReply(text="done")

    live = await serve(Agent(instructions="g", tools=[order], model=ScriptedModel(script)))
    async with live.client() as c:
        before = await scrape(c)
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "buy"})
        assert r.json()["status"] == "waiting"
        assert (await c.post(f"/v1/sessions/{sid}/cancel", json={})).status_code == 202
        # a message queued behind the cancelled turn settles after it
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi"})
        assert r.json()["status"] == "completed"
        after = await scrape(c)
    assert moved(before, after, "keel_turns_total", outcome="waiting") == 1
    assert moved(before, after, "keel_turns_total", outcome="cancelled") == 1


async def test_an_sse_stream_counts_while_open(serve: Any) -> None:
    live = await serve(agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        before = await scrape(c)
        async with c.stream("GET", f"/v1/sessions/{sid}/events") as r:
            # (held in a name: a line iterator dropped after `break` is closed by the loop, and
            # closes the stream with it, while the scrape below runs)
            lines = r.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break  # session.created arrived: the stream is open
            during = await scrape(c)
            await lines.aclose()
    assert during[("keel_sse_streams_open", ())] == before[("keel_sse_streams_open", ())] + 1


async def test_metrics_need_a_key_when_keys_are_set(serve: Any) -> None:
    live = await serve(agent(), api_keys=("metrics-key-1",))
    async with live.client() as c:
        r = await c.get("/metrics")
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "unauthorized"
    async with live.client("metrics-key-1") as c:
        assert "keel_turns_total" in (await c.get("/metrics")).text
    open_live = await serve(agent())
    async with open_live.client() as c:
        assert (await c.get("/metrics")).status_code == 200


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def metrics_worker(valkey: ValkeyServer, tmp_path: Path) -> Iterator[int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEEL_")}
    env.update(REDIS_URL=valkey.url, KEEL_AGENT="app.demo:agent", KEEL_LOG_LEVEL="warning")
    env["KEEL_METRICS_PORT"] = str(port)
    with open(tmp_path / "worker.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.worker"], cwd=ROOT, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while not _answers(port):  # (a process starting: nothing to wait on but its port)
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "worker.log").read_text()
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        code = proc.wait(timeout=15)
    assert code == 0, (tmp_path / "worker.log").read_text()


@pytest.mark.slow
async def test_the_worker_serves_metrics_on_its_port(serve: Any, metrics_worker: int) -> None:
    from app import load_agent

    live = await serve(load_agent("app.demo:agent"), run_turns=False)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true&timeout=20", json={"text": "add 2 and 40"})
        assert r.json()["status"] == "completed", r.json()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_worker}", timeout=5) as w:
        samples = await scrape(w)  # the turn ran in the worker, so it is counted there
    assert samples[("keel_turns_total", (("outcome", "completed"),))] >= 1
    assert samples[("keel_tool_duration_seconds_count", (("tool", "add"),))] >= 1
    assert ("keel_job_queue_depth", ()) in samples
    assert ("keel_websockets_open", ()) not in samples  # a worker has no sockets
