"""`GET /openapi.json`: keel's API as an OpenAPI 3.1 document, generated from the code.

Paths and methods come from the route table (every route whose handler carries an
`@operation`, `channels.spec`); bodies, answers and websocket frames are the msgspec types the
handlers decode and encode (`msgspec.json.schema_components`). Routes without an operation
are left out: the webhook channels' (Slack, Linear: the provider's signed payloads, mounted only
when configured), `/mcp` (MCP's own JSON-RPC, `channels.mcp`) and the keyless demo page. HEAD,
which Starlette answers on every GET route, is not listed. The document is public (no API key):
it describes the API, not its data."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from channels.answers import ErrorEnvelope, WsError, WsHeartbeat, WsPong
from channels.auth import protected
from channels.drain import OPEN_PATHS
from channels.spec import Operation, Returns, operation, operation_of
from harness.events import Event, MessageDelta, SessionDeleted
from harness.ids import SESSION_ID

REF = "#/components/schemas/{name}"
VERSION = "1"
# Named schemas besides the types the routes name: the events (`Event`: any committed one, by
# its `type`; each type its own schema, from the catalogue) and the websocket's frames.
NAMED: tuple[Any, ...] = (ErrorEnvelope, Event, MessageDelta, SessionDeleted, WsError, WsHeartbeat, WsPong)
PATH_PARAMS = {
    "sid": {"type": "string", "pattern": SESSION_ID.pattern},
    "wid": {"type": "string", "minLength": 1},
}
DESCRIPTION = """keel's HTTP API, websocket and event stream, generated from the code.

With `KEEL_API_KEYS` set, every `/v1` route needs `Authorization: Bearer <key>` (a keyless local
server needs none), and a session or webhook is visible only to the key that made it (any other
key gets 404). Every error is `{"error": {"code", "message"}}` (`ErrorEnvelope`).
The websocket (`GET /v1/sessions/{sid}/ws`) is described by `x-websocket`: client frames
`WsClientFrame`, server frames `WsServerFrame`. The webhook channels (Slack, Linear) are not
described here: they take the providers' own signed payloads."""


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(name=name)}


def _ops(routes: Iterable[BaseRoute]) -> list[tuple[str, str, Any, Operation]]:
    """(path, method, endpoint, operation) of every documented route, in table order."""
    out: list[tuple[str, str, Any, Operation]] = []
    for route in routes:
        if isinstance(route, Route):
            methods = sorted((route.methods or set()) - {"HEAD"})
        elif isinstance(route, WebSocketRoute):
            methods = ["GET"]
        else:
            continue
        op = operation_of(route.endpoint)
        if op is not None:
            out.extend((route.path, m.lower(), route.endpoint, op) for m in methods)
    return out


def routed(routes: Iterable[BaseRoute]) -> set[tuple[str, str]]:
    """(path, method) of every route in a route table, as the document would name them."""
    out: set[tuple[str, str]] = set()
    for route in routes:
        if isinstance(route, Route):
            out |= {(route.path, m.lower()) for m in (route.methods or set()) - {"HEAD"}}
        elif isinstance(route, WebSocketRoute):
            out.add((route.path, "get"))
    return out


def _types(ops: list[tuple[str, str, Any, Operation]]) -> list[Any]:
    found: list[Any] = list(NAMED)
    for _, _, _, op in ops:
        found += [a.type for a in op.answers if a.type is not None]
        found += [op.body] if op.body is not None else []
        found += [op.websocket[0]] if op.websocket is not None else []
    return list(dict.fromkeys(found))  # (types hash; order kept)


def _errors(path: str, op: Operation) -> dict[int, str]:
    errors = dict(op.errors)
    if op.body is not None:
        errors.setdefault(400, "`invalid_request`, `invalid_json`")
        errors.setdefault(408, "`body_timeout`: the body stalled")
        errors.setdefault(413, "`too_large`: over `KEEL_MAX_BODY_BYTES`")
    if "{" in path:
        errors.setdefault(404, "`not_found`")
    if protected(path):
        errors.setdefault(401, "`unauthorized`: no valid API key")
    if op.storage:
        errors.setdefault(503, "`unavailable`: storage did not answer; retry (Retry-After)")
    if path not in OPEN_PATHS and op.websocket is None:  # (channels.drain: a process shutting down refuses)
        draining = "`draining`: this process is shutting down; retry (Retry-After), another will answer"
        errors[503] = f"{errors[503]}; or {draining}" if 503 in errors else draining
    return errors


def _response(answer: Returns, schema: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": answer.description}
    if schema is not None:
        out["content"] = {answer.media: {"schema": schema}}
    return out


def _operation_id(endpoint: Any) -> str:
    return f"{endpoint.__module__.rsplit('.', 1)[-1]}_{endpoint.__name__}"


def document(routes: Iterable[BaseRoute]) -> dict[str, Any]:
    """The OpenAPI 3.1 document of a route table."""
    ops = _ops(routes)
    types = _types(ops)
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    schema_of = dict(zip(types, schemas, strict=True))
    components = dict(sorted(components.items()))
    components["Event"] = schema_of[Event]
    components["WsServerFrame"] = {
        "anyOf": [_ref(n) for n in ("Event", "MessageDelta", "SessionDeleted", "WsError", "WsHeartbeat", "WsPong")]
    }
    paths: dict[str, dict[str, Any]] = {}
    for path, method, endpoint, op in ops:
        params = [
            {"name": name, "in": "path", "required": True, "schema": schema}
            for name, schema in PATH_PARAMS.items()
            if "{" + name + "}" in path
        ]
        params += [
            {"name": p.name, "in": p.where, "required": False, "schema": dict(p.schema), "description": p.description}
            for p in op.params
        ]
        responses: dict[str, Any] = {}
        for answer in op.answers:
            responses[str(answer.status)] = _response(answer, schema_of.get(answer.type))
            links = {
                _operation_id(e): {"operationId": _operation_id(e), "parameters": dict(answer.provides)}
                for p, _, e, o in ops
                if o.websocket is None and answer.provides and all("{" + n + "}" in p for n in answer.provides)
            }
            if links:
                responses[str(answer.status)]["links"] = links
        for status, codes in sorted(_errors(path, op).items()):
            responses[str(status)] = {
                "description": codes,
                "content": {"application/json": {"schema": _ref("ErrorEnvelope")}},
            }
        entry: dict[str, Any] = {
            "operationId": _operation_id(endpoint),
            "summary": op.summary,
            "tags": [op.tag],
            "responses": responses,
        }
        if op.description:
            entry["description"] = op.description
        if params:
            entry["parameters"] = params
        if op.body is not None:
            entry["requestBody"] = {
                "required": not op.body_optional,
                "content": {"application/json": {"schema": schema_of[op.body]}},
            }
        if not protected(path):
            entry["security"] = []
        if op.websocket is not None:
            client, server = op.websocket
            components["WsClientFrame"] = schema_of[client]
            entry["x-websocket"] = {"client": _ref("WsClientFrame"), "server": _ref(server)}
            entry["security"] = [{"apiKey": []}, {"sessionToken": []}]
        paths.setdefault(path, {})[method] = entry
    return {
        "openapi": "3.1.0",
        "info": {"title": "keel", "version": VERSION, "description": DESCRIPTION},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "apiKey": {"type": "http", "scheme": "bearer", "description": "An API key from KEEL_API_KEYS"},
                "sessionToken": {
                    "type": "apiKey",
                    "in": "query",
                    "name": "token",
                    "description": "The websocket only: a token from POST /v1/sessions/{sid}/tokens",
                },
            },
        },
        "security": [{"apiKey": []}],
    }


@operation(
    "This document",
    Returns(200, dict[str, Any], "The OpenAPI 3.1 document (public: no API key)"),
    storage=False,
    tag="meta",
)
async def serve_openapi(request: Request) -> Response:
    made: bytes | None = getattr(request.app.state, "openapi", None)
    if made is None:
        made = request.app.state.openapi = msgspec.json.encode(document(request.app.routes))
    return Response(made, media_type="application/json")
