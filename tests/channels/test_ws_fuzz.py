"""The websocket fuzzed with hypothesis: frames built from the OpenAPI document's frame schemas
(valid, and valid ones broken one way or another), arbitrary text, JSON and bytes. The socket
is only ever closed with the codes the README lists, every server frame matches
`WsServerFrame`, and a bad frame gets an error frame and changes nothing in Redis."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import msgspec
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis import Redis
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from channels.openapi import document
from channels.routes import routes
from channels.types import ws_frame_decoder
from channels.websocket import MAX_BAD_FRAMES
from harness import Agent
from harness.models import ModelReply, ScriptedModel
from tests.channels.threaded import ThreadedKeel
from tests.conftest import ValkeyServer

KEY = "ws-fuzz-key"
MAX_FRAME = 1024
SCHEMAS: dict[str, Any] = document(routes())["components"]["schemas"]
SERVER_FRAME = {"$ref": "#/components/schemas/WsServerFrame", "components": {"schemas": SCHEMAS}}
CLIENT_FRAMES = [s["$ref"].rsplit("/", 1)[1] for s in SCHEMAS["WsClientFrame"]["anyOf"]]
README_CLOSE_CODES = {4401, 4403, 4404, 4400, 4429, 1009, 1003, 1008, 1013, 1012}
TAGS = {SCHEMAS[name]["properties"]["type"]["enum"][0] for name in CLIENT_FRAMES}
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck))


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of the JSON schemas msgspec emits for the frames (enum, string with minLength and
    pattern, array, object, anyOf, null, $ref)."""
    if "$ref" in schema:
        return from_schema(SCHEMAS[schema["$ref"].rsplit("/", 1)[1]])
    if "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "string":
        text = st.text(min_size=schema.get("minLength", 0), max_size=40)
        return text.filter(str.strip) if "pattern" in schema else text
    if kind == "array":
        return st.lists(from_schema(schema["items"]), max_size=4)
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", ()))
        props = schema["properties"]
        return st.fixed_dictionaries(
            {k: from_schema(v) for k, v in props.items() if k in required},
            optional={k: from_schema(v) for k, v in props.items() if k not in required},
        )
    if kind == "object":
        return st.dictionaries(
            st.text(min_size=1, max_size=10), from_schema(schema["additionalProperties"]), max_size=3
        )
    raise AssertionError(f"no strategy for {schema}")


valid_frames = st.sampled_from(CLIENT_FRAMES).flatmap(lambda name: from_schema(SCHEMAS[name]))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)


@st.composite
def broken_frames(draw: st.DrawFn) -> dict[str, Any]:
    """A frame from the schemas, then broken: a required field dropped, a field unknown or of a
    type no frame takes, or a type no frame has."""
    name = draw(st.sampled_from(CLIENT_FRAMES))
    frame = dict(draw(from_schema(SCHEMAS[name])))
    required = SCHEMAS[name]["required"]
    how = draw(st.sampled_from(["drop", "unknown", "wrong", "tag"]))
    if how == "drop":
        del frame[draw(st.sampled_from(required))]
    elif how == "unknown":
        frame[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in SCHEMAS[name]["properties"]))] = 1
    elif how == "wrong":
        frame[draw(st.sampled_from(sorted(SCHEMAS[name]["properties"])))] = {"x": [1]}
    else:
        frame["type"] = draw(st.text(max_size=10).filter(lambda t: t not in TAGS))
    return frame


# refused on an idle session without requests: an unknown request, nothing to cancel, a bad id
refused_frames = st.one_of(
    from_schema(SCHEMAS["WsRespond"]),
    st.builds(
        lambda rid, decision: {"type": "respond", "request_id": rid, "decision": decision},
        st.text(max_size=12),
        st.sampled_from(["approve", "deny"]),
    ),
    from_schema(SCHEMAS["WsCancel"]),
    st.builds(
        lambda text, mid: {"type": "message", "text": text, "message_id": mid},
        st.text(min_size=1, max_size=10).filter(str.strip),
        st.text(min_size=1, max_size=10).filter(lambda m: not m.isascii() or " " in m or "/" in m),
    ),
)


def with_ref(frame: dict[str, Any], ref: str | None) -> str:
    return json.dumps(frame if ref is None else {**frame, "ref": ref})


refs = st.none() | st.text(max_size=8)
undecodable = st.one_of(
    st.text(max_size=50), json_values.map(json.dumps), st.builds(with_ref, broken_frames(), refs)
).filter(lambda t: not decodes(t))
bad_text = st.one_of(undecodable, st.builds(with_ref, refused_frames, refs))


def agent() -> Agent:
    return Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text=f"re {r.messages[-1].text[:20]}")))


@pytest.fixture(scope="module")
def keel(valkey: ValkeyServer) -> Iterator[ThreadedKeel]:
    Redis.from_url(valkey.url).flushall()
    with ThreadedKeel(agent(), valkey.url, api_keys=(KEY,), ws_max_frame=MAX_FRAME, demo_page=False) as server:
        yield server


@pytest.fixture(scope="module")
def redis(valkey: ValkeyServer) -> Iterator[Redis]:
    client = Redis.from_url(valkey.url)
    yield client
    client.close()


def new_session(keel: ThreadedKeel) -> str:
    r = requests.post(f"{keel.base}/v1/sessions", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 201
    sid: str = r.json()["session_id"]
    return sid


@contextlib.contextmanager
def socket(keel: ThreadedKeel, sid: str) -> Iterator[ClientConnection]:
    url = f"{keel.ws_base}/v1/sessions/{sid}/ws"
    with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        yield ws


def until_pong(ws: ClientConnection, ref: str) -> list[dict[str, Any]]:
    """Frames until the pong of `ref`, each checked against the document's WsServerFrame."""
    frames: list[dict[str, Any]] = []
    while True:
        frame = json.loads(ws.recv(timeout=10))
        jsonschema.validate(frame, SERVER_FRAME)
        if frame["type"] == "pong" and frame["ref"] == ref:
            return frames
        if frame["type"] != "heartbeat":
            frames.append(frame)


def snapshot(redis: Redis) -> dict[bytes, Any]:
    """Every key's value (as test_http.snapshot), a stream's as its entries and its groups'
    positions and pending counts: an idle runner's blocking reads only refresh when its
    consumer was last seen; a session's `readers` left out (which processes listen)."""
    out: dict[bytes, Any] = {}
    for key in redis.keys("*"):
        if key.endswith(b":readers"):
            continue
        if redis.type(key) == b"stream":
            groups = [(g["name"], g["last-delivered-id"], g["pending"]) for g in redis.xinfo_groups(key)]
            out[key] = (redis.xrange(key), groups)
        else:
            out[key] = redis.dump(key)
    return out


@pytest.fixture(scope="module")
def idle(keel: ThreadedKeel) -> Iterator[ClientConnection]:
    """A socket on a session where nothing ever happens."""
    with socket(keel, new_session(keel)) as ws:
        yield ws


@settings(FUZZ, max_examples=150)
@given(text=bad_text.filter(lambda t: len(t) <= MAX_FRAME))
def test_a_bad_frame_gets_an_error_frame_and_changes_nothing(idle: ClientConnection, redis: Redis, text: str) -> None:
    before = snapshot(redis)
    idle.send(text)
    idle.send(json.dumps({"type": "ping", "ref": "sync"}))
    answers = until_pong(idle, "sync")
    assert len(answers) == 1 and answers[0]["type"] == "error", (text, answers)
    if decodes(text):  # well formed, refused: its ref comes back
        assert answers[0].get("ref") == ws_frame_decoder.decode(text).ref
    else:
        assert answers[0]["error"]["code"] == "invalid_frame"
    assert snapshot(redis) == before


def decodes(text: str) -> bool:
    try:
        ws_frame_decoder.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False
    return True


def expected_close(frames: list[str | bytes]) -> set[int | None]:
    """The close codes the README allows for this sequence (None: the socket stays open). keel
    reads frames in order; uvicorn refuses a frame over the size limit as it arrives, so an
    oversized frame sent in the same burst may close the socket (1009) before keel has read
    the frames ahead of it, and uvicorn then drops the connection at once, so the client may
    see no close frame at all (None)."""
    bad = 0
    early: set[int | None] = set()
    if any(isinstance(f, str) and len(f) > MAX_FRAME for f in frames):
        early = {1009, None}
    for frame in frames:
        if isinstance(frame, bytes):
            return {1003, *early}
        if len(frame) > MAX_FRAME:
            return {1009, None}
        if decodes(frame):
            bad = 0  # (a ping: the strategy draws no other valid frame)
        else:
            bad += 1
            if bad > MAX_BAD_FRAMES:
                return {1008, *early}
    return {None}


ping = st.builds(with_ref, st.just({"type": "ping"}), refs)
closing = st.one_of(
    st.binary(max_size=20),
    st.integers(MAX_FRAME + 1, MAX_FRAME * 3).map(lambda n: json.dumps({"type": "message", "text": "x" * n})),
)
arbitrary = st.one_of(undecodable, ping, closing)
bad_run = st.lists(undecodable.filter(lambda t: len(t) <= MAX_FRAME), min_size=MAX_BAD_FRAMES - 2, max_size=24)
then_closing = st.builds(lambda before, last: [*before, last], st.lists(undecodable | ping, max_size=5), closing)


@settings(FUZZ, max_examples=40)
@given(frames=st.lists(arbitrary, max_size=24) | bad_run | then_closing)
def test_only_the_readme_close_codes(keel: ThreadedKeel, frames: list[str | bytes]) -> None:
    with socket(keel, new_session(keel)) as ws:
        sent: list[str | bytes] = []
        try:
            for frame in frames:
                ws.send(frame)
                sent.append(frame)
            ws.send(json.dumps({"type": "ping", "ref": "end"}))
            until_pong(ws, "end")
            code = None
        except ConnectionClosed as closed:
            code = closed.rcvd.code if closed.rcvd is not None else None
    assert code in README_CLOSE_CODES | {None}
    assert code in expected_close(sent), (sent, code)
