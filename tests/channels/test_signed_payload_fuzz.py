"""Signed Slack and Linear payloads fuzzed with hypothesis: the payloads the channel tests send
(events, clicks, agent session events), then changed at any field at any depth (a value
replaced by null, a bool, a number, a string, a list or an object, nested or nested too deeply
to decode; a field dropped or added), posted signed as the platforms sign them. No answer is a
5xx; an answer of 4xx is keel's error envelope and wrote nothing: no session, no message, no
job. keel runs no turns here (a worker would), so nothing but the requests writes sessions."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis import Redis, RedisCluster

from channels.webhooks.linear import session_for as linear_session
from channels.webhooks.slack import session_for as slack_session
from harness import Agent
from harness.models import ModelReply, ScriptedModel
from tests.channels import linear_server, slack_server
from tests.channels.linear_server import FakeLinear, created, prompted
from tests.channels.slack_server import BOT, FakeSlack, event_body
from tests.channels.threaded import ThreadedKeel
from tests.conftest import ON_CLUSTER, ValkeyServer

FUZZ = settings(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
DEEP = "\u0000deep\u0000"  # a value written nested deeper than any decoder recurses
REFUSALS = {"invalid_payload", "invalid_signature"}

Path = tuple[str | int, ...]


@pytest.fixture(scope="module")
def fakes() -> Iterator[tuple[FakeSlack, FakeLinear]]:
    slack, linear = FakeSlack().start(), FakeLinear().start()
    yield slack, linear
    slack.stop()
    linear.stop()


@pytest.fixture(scope="module")
def redis(valkey: ValkeyServer) -> Iterator[Any]:
    client = RedisCluster.from_url(valkey.url) if ON_CLUSTER else Redis.from_url(valkey.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def keel(valkey: ValkeyServer, redis: Any, fakes: tuple[FakeSlack, FakeLinear]) -> Iterator[httpx.Client]:
    slack, linear = fakes
    agent = Agent(instructions="t", model=ScriptedModel(lambda r: ModelReply(text="unused")))
    with (
        ThreadedKeel(
            agent,
            valkey.url,
            run_turns=False,
            demo_page=False,
            slack_signing_secret=slack_server.SECRET,
            slack_bot_token=slack_server.TOKEN,
            slack_api_url=slack.url,
            linear_webhook_secret=linear_server.SECRET,
            linear_api_key=linear_server.API_KEY,
            linear_api_url=linear.url,
        ) as server,
        httpx.Client(base_url=server.base, timeout=10) as client,
    ):
        yield client


def footprint(redis: Any) -> dict[str, int]:
    """What a request may write: each session (its meta) and the lengths of its inbox, outbox,
    message ids, history and decisions; the turn jobs. (The relays' own keys are not in it: they
    move in the background, for the sessions the accepted payloads made.)"""
    found = redis.keys("keel:*", target_nodes="primaries") if ON_CLUSTER else redis.keys("keel:*")
    keys = sorted(k.decode() for k in found)
    sizes = {"xlen": ("outbox", "stream"), "llen": ("inbox", "history"), "hlen": ("mids", "decisions")}
    counted = [(k, verb) for k in keys for verb, ends in sizes.items() if k.rsplit(":", 1)[-1] in ends]
    pipe = redis.pipeline()
    for key, verb in counted:
        getattr(pipe, verb)(key)
    out = {key: int(n) for (key, _), n in zip(counted, pipe.execute(), strict=True) if "{relay}" not in key}
    out.update({k: 1 for k in keys if k.endswith(":meta")})
    return out


# ---- the payloads, as the channel tests send them ---------------------------------------------


def slack_events(root: str) -> list[dict[str, Any]]:
    """A mention starting a thread at `root`, a reply in that thread, a direct message, an edit,
    the URL challenge."""
    reply = root.replace(".000100", ".000200")
    bodies = [
        event_body(f"<@{BOT}> hello there", ts=root),
        event_body("and more", ts=reply, kind="message", thread_ts=root),
        event_body("hi in private", ts=root, kind="message", channel="D0DM", channel_type="im"),
        event_body("edited", ts=reply, kind="message", subtype="message_changed", channel_type="im"),
    ]
    return [json.loads(b) for b in bodies] + [{"type": "url_verification", "token": "x", "challenge": "abc123"}]


def slack_click() -> dict[str, Any]:
    """A click on an approve button (its value decoded: it is fuzzed too, then encoded)."""
    return {
        "type": "block_actions",
        "team": {"id": slack_server.TEAM, "domain": "test"},
        "user": {"id": "U0ALICE", "team_id": slack_server.TEAM},
        "api_app_id": "A0APP",
        "container": {"type": "message", "message_ts": "1700000031.000100", "channel_id": "C0GENERAL"},
        "channel": {"id": "C0GENERAL"},
        "message": {"ts": "1700000031.000100", "thread_ts": "1700000030.000100", "text": "wipe?"},
        "trigger_id": "1.2.3",
        "actions": [
            {
                "action_id": "keel_approve",
                "block_id": "b",
                "value": {"s": "ses_fuzz", "r": "req_fuzz", "a": "U0ALICE"},
                "type": "button",
                "action_ts": "1700000032.000100",
            }
        ],
    }


def linear_events(tag: str) -> list[dict[str, Any]]:
    """Two sessions made (`tag` names them), a prompt, a stop, an approval in words."""
    bodies = [
        created(f"as-{tag}-1", context="Issue ENG-1: the build is red"),
        created(f"as-{tag}-2", comment=None),
        prompted(f"as-{tag}-1", f"act-{tag}-1", "and now?"),
        prompted(f"as-{tag}-1", f"act-{tag}-2", "Stop", signal="stop"),
        prompted(f"as-{tag}-2", f"act-{tag}-3", "approve"),
    ]
    return [json.loads(b) for b in bodies]


# ---- changed at any field ---------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def paths(value: Any, at: Path = ()) -> list[Path]:
    """Every node of a JSON value, the root first."""
    found = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            found += paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += paths(v, (*at, i))
    return found


def put(root: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return root


def drop(root: Any, path: Path) -> Any:
    if not path:
        return root
    parent = root
    for step in path[:-1]:
        parent = parent[step]
    del parent[path[-1]]
    return root


def get(root: Any, path: Path) -> Any:
    for step in path:
        root = root[step]
    return root


@st.composite
def changed(draw: st.DrawFn, base: Any) -> Any:
    """`base` with one to three of its fields changed: replaced by any JSON value (or one nested
    too deeply), wrapped in a list or an object, dropped, or given a sibling."""
    value = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths(value)[1:] or [()]))  # (a whole body not an object: test_slack, test_linear)
        how = draw(st.sampled_from(["replace"] * 8 + ["deep", "wrap", "wrap", "drop", "drop", "add"]))
        if how == "replace":
            value = put(value, path, draw(json_values))
        elif how == "deep":
            value = put(value, path, DEEP)
        elif how == "wrap":
            old = get(value, path)
            value = put(value, path, draw(st.sampled_from([[old], {"x": old}])))
        elif how == "drop":
            value = drop(value, path)
        elif isinstance(node := get(value, path), dict):
            node[draw(st.text(min_size=1, max_size=8))] = draw(json_values)
        elif isinstance(node, list):
            node.append(draw(json_values))
    return value


def encode(value: Any) -> bytes:
    deep = "[" * 5000 + "]" * 5000
    return json.dumps(value).replace(json.dumps(DEEP), deep).encode()


def slack_click_form(payload: Any) -> bytes:
    """The click as Slack posts it: its button's value a JSON string, the payload a form field."""
    payload = copy.deepcopy(payload)
    try:
        action = payload["actions"][0]
        if isinstance(action["value"], dict):
            action["value"] = encode(action["value"]).decode()
    except (KeyError, IndexError, TypeError):
        pass
    return urlencode({"payload": encode(payload).decode()}).encode()


# (the values, not their bodies: a falsifying example nested too deeply reads as DEEP); a few
# threads and sessions only, so that a changed payload is often one for a conversation keel has
roots = st.integers(0, 4).map(lambda n: f"17000003{n:02d}.000100")
slack_requests = st.one_of(
    st.tuples(st.just("events"), st.builds(slack_events, roots).flatmap(st.sampled_from).flatmap(changed)),
    st.tuples(st.just("interactivity"), st.builds(slack_click).flatmap(changed)),
)
linear_requests = (
    st.builds(linear_events, st.integers(0, 4).map(lambda n: f"fuzz{n}")).flatmap(st.sampled_from).flatmap(changed)
)


def check(keel: httpx.Client, redis: Any, route: str, body: bytes, headers: dict[str, str]) -> None:
    before = footprint(redis)
    try:
        r = keel.post(route, content=body, headers=headers)
    except httpx.TransportError as exc:  # (a traceback in keel may reset the connection)
        pytest.fail(f"no answer ({exc!r}) to {body[:500]!r}")
    event(f"{route}: {r.status_code}")
    assert r.status_code < 500, (body[:500], r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.status_code in (400, 401), (body[:500], r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]["code"] in REFUSALS, r.text
        assert isinstance(r.json()["error"]["message"], str)
        assert footprint(redis) == before, body[:500]


def slack_signed(route: str) -> Callable[[bytes], dict[str, str]]:
    kind = "application/json" if route.endswith("events") else "application/x-www-form-urlencoded"
    return lambda body: {"Content-Type": kind, **slack_server.signed(body)}


@settings(FUZZ, max_examples=120)
@given(sent=slack_requests)
def test_a_signed_slack_payload_is_never_a_5xx_and_a_refused_one_writes_nothing(
    keel: httpx.Client, redis: Any, sent: tuple[str, Any]
) -> None:
    route, payload = sent
    body = encode(payload) if route == "events" else slack_click_form(payload)
    check(keel, redis, f"/v1/slack/{route}", body, slack_signed(route)(body))


@settings(FUZZ, max_examples=80)
@given(payload=linear_requests)
def test_a_signed_linear_payload_is_never_a_5xx_and_a_refused_one_writes_nothing(
    keel: httpx.Client, redis: Any, payload: Any
) -> None:
    body = encode(payload)
    check(keel, redis, "/v1/linear/webhook", body, linear_server.signed(body))


def test_the_payloads_fuzzed_are_taken_as_they_are(keel: httpx.Client, redis: Any) -> None:
    """The fuzz starts from payloads keel takes and acts on (a fuzz from payloads refused
    whatever the change would test nothing)."""
    ts = f"{int(time.time())}.000100"
    for payload in slack_events(ts):
        body = encode(payload)
        assert keel.post("/v1/slack/events", content=body, headers=slack_signed("events")(body)).status_code == 200
    click = slack_click_form(slack_click())
    r = keel.post("/v1/slack/interactivity", content=click, headers=slack_signed("interactivity")(click))
    assert r.status_code == 200
    tag = f"base{time.monotonic_ns()}"
    for payload in linear_events(tag):
        body = encode(payload)
        assert keel.post("/v1/linear/webhook", content=body, headers=linear_server.signed(body)).status_code == 200
    made = footprint(redis)
    for sid in (slack_session(slack_server.TEAM, "C0GENERAL", ts), linear_session(f"as-{tag}-1")):
        assert made[f"keel:{{{sid}}}:meta"] == 1 and made[f"keel:{{{sid}}}:inbox"] >= 1
