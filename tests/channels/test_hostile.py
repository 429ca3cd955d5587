"""Holes a hostile client found (issue 16): each gets its 4xx or its documented close code and
changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as sync_connect

from tests.channels.slack_support import echo_agent
from tests.channels.test_http import snapshot
from tests.conftest import ValkeyServer, free_port
from tests.service import Service

pytestmark = pytest.mark.asyncio
NOT_ASCII_DIGITS = ["³", "①", "²", "٣", "１"]


async def test_numeric_queries_take_ascii_digits_only(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for digit in NOT_ASCII_DIGITS:
            for query in (f"limit={digit}", f"offset={digit}"):
                r = await c.get(f"/v1/sessions/{sid}/history?{query}")
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_query", (query, r.text)
        assert (await c.get(f"/v1/sessions/{sid}/history?limit=" + "9" * 40)).status_code == 400


async def test_event_ids_take_ascii_digits_only(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        for bad in ("٣-0", "１-0", "0-٣"):
            r = await c.get(f"/v1/sessions/{sid}/events", params={"after": bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_event_id", (bad, r.text)
            r = await c.get(f"/v1/sessions/{sid}/events", headers={"Last-Event-ID": bad.encode()})
            assert r.status_code == 400
            with pytest.raises(ConnectionClosed) as closed:
                async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws?after={bad}") as ws:
                    await asyncio.wait_for(ws.recv(), 5)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4400


async def test_an_empty_turn_id_is_invalid_and_cancels_nothing(serve: Any) -> None:
    gate = asyncio.Event()
    live = await serve(echo_agent(gate=gate))
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        await c.post(f"/v1/sessions/{sid}/messages", json={"text": "hi", "message_id": "m1"})
        r = await c.post(f"/v1/sessions/{sid}/cancel", json={"turn_id": ""})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_turn_id"
        async with connect(f"{live.ws_base}/v1/sessions/{sid}/ws") as ws:
            await ws.send('{"type": "cancel", "turn_id": "", "ref": "r1"}')
            while True:
                frame = await asyncio.wait_for(ws.recv(), 5)
                if '"error"' in frame and '"r1"' in frame:
                    assert "invalid_turn_id" in frame
                    break
        gate.set()
        done = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "hi", "message_id": "m1"})
        assert done.json()["status"] == "completed"  # not cancelled


async def test_whitespace_only_text_is_refused_like_empty_text(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        before = await redis.xlen(f"keel:{{{sid}}}:outbox")
        for text in ("", " ", "\n\t  "):
            r = await c.post(f"/v1/sessions/{sid}/messages", json={"text": text})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", repr(text)
        assert await redis.xlen(f"keel:{{{sid}}}:outbox") == before


async def test_a_client_that_sends_half_a_body_gets_a_400_not_a_traceback() -> None:
    """The body reader sees the client go mid-body (uvicorn's http.disconnect): a channel error
    (its 400 goes nowhere, and nothing is logged as an exception), not ClientDisconnect."""
    from starlette.applications import Starlette
    from starlette.requests import Request

    from channels.errors import ChannelError
    from channels.http import read_body

    app = Starlette()
    app.state.max_body = 1_000
    messages = [
        {"type": "http.request", "body": b'{"text": "hal', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", b"100")], "app": app}
    with pytest.raises(ChannelError) as refused:
        await read_body(Request(scope, receive))
    assert refused.value.status == 400 and refused.value.code == "incomplete_body"


async def test_a_body_in_parts_is_read_whole_and_one_over_the_limit_is_refused_midway() -> None:
    """The body reader joins a body sent in parts, and refuses one past the limit as soon as the
    parts pass it (without waiting for the rest), whatever the client declared."""
    from starlette.applications import Starlette
    from starlette.requests import Request

    from channels.errors import ChannelError
    from channels.http import read_body

    app = Starlette()
    app.state.max_body = 10

    def request(parts: list[bytes], declared: int) -> tuple[Request, list[dict[str, Any]]]:
        messages = [{"type": "http.request", "body": p, "more_body": n < len(parts) - 1} for n, p in enumerate(parts)]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        headers = [(b"content-length", str(declared).encode())]
        return Request(
            {"type": "http", "method": "POST", "path": "/", "headers": headers, "app": app}, receive
        ), messages

    whole, left = request([b'{"a":', b"", b"1}"], 7)
    assert await read_body(whole) == b'{"a":1}' and left == []
    over, left = request([b"12345", b"67890", b"1", b"never read"], 4)  # (a declared length that lies)
    with pytest.raises(ChannelError) as refused:
        await read_body(over)
    assert refused.value.status == 413 and refused.value.code == "too_large"
    assert [m["body"] for m in left] == [b"never read"]  # (refused at the part that passed the limit)
    declared, _ = request([b"{}"], 11)
    with pytest.raises(ChannelError) as refused:
        await read_body(declared)
    assert refused.value.status == 413


async def test_a_stalled_body_is_408_and_a_cancel_from_outside_stays_a_cancel() -> None:
    """The body's stall timer answers 408 when the body stops coming; a cancel from elsewhere
    (a shutdown) while the body is read is a cancel, not a 408, and no stall timer is left to
    cancel the task later."""
    from starlette.applications import Starlette
    from starlette.requests import Request

    from channels.errors import ChannelError
    from channels.http import read_body

    app = Starlette()
    app.state.max_body = 1_000
    app.state.body_timeout = 0.05
    never, waiting = asyncio.Event(), asyncio.Event()

    async def stalls() -> dict[str, Any]:
        waiting.set()
        await never.wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    def request() -> Request:
        return Request({"type": "http", "method": "POST", "path": "/", "headers": [], "app": app}, stalls)

    with pytest.raises(ChannelError) as refused:
        await read_body(request())
    assert refused.value.status == 408 and refused.value.code == "body_timeout"

    app.state.body_timeout = 0.2
    waiting.clear()
    reading = asyncio.create_task(read_body(request()))
    await asyncio.wait_for(waiting.wait(), 5)
    reading.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reading
    assert reading.cancelled()

    async def after_a_read() -> bool:
        parts = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive() -> dict[str, Any]:
            return parts.pop(0)

        scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "app": app}
        assert await read_body(Request(scope, receive)) == b"{}"
        await asyncio.sleep(0.3)  # (past the stall timer's time: it was stopped with the read)
        return True

    assert await after_a_read()


async def test_a_stall_s_cancel_is_counted_as_asyncio_timeout_counts_it() -> None:
    """A cancel the task caught before (still counted) does not turn a stall's 408 into a
    cancel; a stall's cancel that the receive ended its own way is taken back all the same (one
    left counted would cut the task's next timeout short)."""
    from starlette.applications import Starlette
    from starlette.requests import Request

    from channels.errors import ChannelError
    from channels.http import read_body

    app = Starlette()
    app.state.max_body = 1_000
    app.state.body_timeout = 0.05
    never = asyncio.Event()
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "app": app}

    async def stalls() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    async def turned_into_a_disconnect() -> dict[str, Any]:
        with contextlib.suppress(asyncio.CancelledError):
            await never.wait()
        return {"type": "http.disconnect"}

    async def stalls_after_a_cancel_it_caught() -> int:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()  # (caught below and not taken back: it stays counted)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(1)
        with pytest.raises(ChannelError) as refused:
            await read_body(Request(scope, stalls))
        assert refused.value.status == 408
        return task.cancelling()

    async def reads_through_a_receive_that_ends_the_cancel() -> int:
        with pytest.raises(ChannelError) as ended:
            await read_body(Request(scope, turned_into_a_disconnect))
        assert ended.value.code == "incomplete_body"
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    assert await asyncio.create_task(stalls_after_a_cancel_it_caught()) == 1
    assert await asyncio.create_task(reads_through_a_receive_that_ends_the_cancel()) == 0


async def test_queued_counts_the_messages_behind_a_paused_turn(serve: Any) -> None:
    live = await serve(echo_agent())
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
        r = await c.post(f"/v1/sessions/{sid}/messages?wait=true", json={"text": "wipe disk"})
        assert r.json()["status"] == "waiting"
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["status"] == "waiting" and info["queued"] == 0  # (it said 1)
        await c.post(f"/v1/sessions/{sid}/messages", json={"text": "and then"})
        assert (await c.get(f"/v1/sessions/{sid}")).json()["queued"] == 1


async def test_a_body_that_stalls_mid_way_gets_408(serve: Any, redis: Redis) -> None:
    live = await serve(echo_agent(), body_timeout=0.5)
    async with live.client() as c:
        sid = (await c.post("/v1/sessions")).json()["session_id"]
    before = await redis.xlen(f"keel:{{{sid}}}:outbox")
    reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
    try:
        writer.write(
            f"POST /v1/sessions/{sid}/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            'Content-Length: 100\r\n\r\n{"text": "hal'.encode()
        )
        await writer.drain()  # ... and nothing more
        status = await asyncio.wait_for(reader.readline(), 10)
        assert status.startswith(b"HTTP/1.1 408"), status
    finally:
        writer.close()
    assert await redis.xlen(f"keel:{{{sid}}}:outbox") == before


def send_over_the_limit(url: str) -> ConnectionClosed:
    """Sends 16 MB as 16 KB fragments and reads until the connection closes; returns how it closed.

    The client is websockets' threaded one: the asyncio client, on CPython's selector loop, can end
    in an AttributeError of the loop's own (its transport drains a buffered close, then is aborted;
    the same race as anyio#1250), which says nothing about keel."""
    with pytest.raises(ConnectionClosed) as closed, sync_connect(url, max_size=None, close_timeout=10) as ws:
        ws.send("x" * 16_384 for _ in range(1_000))
        while True:  # (the session's replay may come first)
            ws.recv(timeout=10)
    return closed.value


async def test_a_fragmented_message_over_the_limit_is_closed_1009_not_reset(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path
) -> None:
    """16 MB sent as 16 KB fragments to keel in a process of its own: the client gets close 1009
    (keel closed the socket under the client's in-flight data: a TCP reset, no close code), and
    nothing changes."""
    svc = Service(tmp_path, free_port(), REDIS_URL=valkey.url, KEEL_AGENT="tests.crash_agent:agent")
    svc.start()
    try:
        async with httpx.AsyncClient(base_url=svc.base) as c:
            sid = (await c.post("/v1/sessions")).json()["session_id"]
        before = await snapshot(redis)
        for _ in range(3):
            closed = await asyncio.to_thread(send_over_the_limit, f"ws://127.0.0.1:{svc.port}/v1/sessions/{sid}/ws")
            assert closed.rcvd is not None and closed.rcvd.code == 1009, closed
        assert await snapshot(redis) == before
    finally:
        svc.stop()


async def raw_handshake(port: int, path: str, extra: str = "") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n".encode()
    )
    answer = await asyncio.wait_for(reader.read(), 10)  # the whole answer, to the server's close
    writer.close()
    return answer


async def test_an_oversized_websocket_handshake_gets_an_answer(serve: Any) -> None:
    """A request line or a header over 8 KB on the websocket route got no answer at all."""
    live = await serve(echo_agent())
    long_line = await raw_handshake(live.port, "/v1/sessions/x/ws?after=" + "1" * 9_000)
    assert long_line.startswith(b"HTTP/1.1 414 ") and b'"code": "uri_too_long"' in long_line
    big_header = await raw_handshake(live.port, "/v1/sessions/x/ws", "X-Big: " + "b" * 9_000 + "\r\n")
    assert big_header.startswith(b"HTTP/1.1 431 ") and b'"code": "headers_too_large"' in big_header


async def test_a_socket_whose_tasks_fail_together_leaves_no_exception_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reader, writer and follower ending at once (a burst of frames ending the socket): each
    one's exception is read, none is logged as "Task exception was never retrieved"."""
    import gc

    from starlette.websockets import WebSocketDisconnect

    from channels.websocket import Connection

    async def ends(self: Connection, *args: Any) -> None:
        raise WebSocketDisconnect(1009)

    for name in ("_follow", "_write", "_read", "_drained"):  # (all four: a bare Connection has no drain)
        monkeypatch.setattr(Connection, name, ends)
    unread: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unread.append(context))
    try:
        conn = Connection.__new__(Connection)
        with pytest.raises(WebSocketDisconnect):
            await conn.run("0-0")
        del conn
        gc.collect()
    finally:
        loop.set_exception_handler(before)
    assert [c["message"] for c in unread] == []
