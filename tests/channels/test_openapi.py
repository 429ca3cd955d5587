"""The OpenAPI document: valid OpenAPI 3.1, public, and following the code (every route of the
table in it, every wire type's schema the type's own). Fuzzing against it:
test_openapi_fuzz.py (HTTP, schemathesis) and test_ws_fuzz.py (websocket frames)."""

from __future__ import annotations

import inspect
import typing
from typing import Any

import msgspec
from openapi_spec_validator import validate
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from channels import answers, types
from channels.openapi import REF, document, routed
from channels.routes import routes
from harness.events import COMMITTED, LIVE
from harness.types import SessionInfo
from tests.channels.test_http import echo_agent


def documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(path, method) for path, ops in doc["paths"].items() for method in ops}


def structs(module: object) -> list[type[msgspec.Struct]]:
    return [
        v
        for v in vars(module).values()
        if inspect.isclass(v) and issubclass(v, msgspec.Struct) and v.__module__ == getattr(module, "__name__", "")
    ]


async def test_the_served_document_is_valid_openapi_3_1_and_public(serve: Any) -> None:
    live = await serve(echo_agent(), api_keys=("k1",))
    async with live.client() as c:  # no key
        r = await c.get("/openapi.json")
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        doc = r.json()
        assert (await c.get("/v1/sessions/ses_00000000000000000000000000")).status_code == 401
    validate(doc)
    assert doc["openapi"] == "3.1.0"
    assert doc == msgspec.json.decode(msgspec.json.encode(document(routes())))
    send = doc["paths"]["/v1/sessions/{sid}/messages"]["post"]
    assert set(send["responses"]) >= {"200", "202", "400", "401", "404", "413"}
    assert send["requestBody"]["content"]["application/json"]["schema"] == {"$ref": REF.format(name="SendMessage")}
    assert doc["paths"]["/openapi.json"]["get"]["security"] == []
    assert doc["paths"]["/v1/sessions/{sid}/events"]["get"]["responses"]["200"]["content"].keys() == {
        "text/event-stream"
    }
    ws = doc["paths"]["/v1/sessions/{sid}/ws"]["get"]
    assert ws["x-websocket"]["client"] == {"$ref": REF.format(name="WsClientFrame")}
    assert {"sessionToken": []} in ws["security"]


def test_every_route_of_the_table_is_in_the_document_and_nothing_else() -> None:
    table = routes()
    assert routed(table) == documented(document(table))


def test_a_route_added_without_its_operation_is_caught() -> None:
    async def undocumented(request: Request) -> Response:
        return Response()

    extra: list[BaseRoute] = [Route("/v1/sessions/{sid}/undocumented", undocumented, methods=["POST"])]
    table = [*routes(), *extra, WebSocketRoute("/v1/other-ws", undocumented)]
    missing = routed(table) - documented(document(table))
    assert missing == {("/v1/sessions/{sid}/undocumented", "post"), ("/v1/other-ws", "get")}


def test_every_wire_type_is_a_named_schema_equal_to_its_own() -> None:
    schemas = document(routes())["components"]["schemas"]
    wire = [*structs(types), *structs(answers), *COMMITTED, *LIVE, SessionInfo]
    _, own = msgspec.json.schema_components(wire, ref_template=REF)
    for t in wire:
        assert schemas.get(t.__name__) == own[t.__name__], f"{t.__name__} is not documented as it is"
    client_frames = {s["$ref"].rsplit("/", 1)[1] for s in schemas["WsClientFrame"]["anyOf"]}
    assert client_frames == {t.__name__ for t in typing.get_args(types.WsFrame)}
    server_frames = {s["$ref"].rsplit("/", 1)[1] for s in schemas["WsServerFrame"]["anyOf"]}
    assert server_frames == {"Event", "MessageDelta", "SessionDeleted", "WsError", "WsHeartbeat", "WsPong"}
    # an event is any of the catalogue's committed types, told apart by `type`
    mapping = schemas["Event"]["discriminator"]["mapping"]
    assert {t: ref.rsplit("/", 1)[1] for t, ref in mapping.items()} == {c.TYPE: c.__name__ for c in COMMITTED}
    settled = schemas["SettledTurn"]["properties"]["events"]["items"]
    assert settled == {"$ref": REF.format(name="Event")}


def test_every_operation_documents_its_errors_as_the_envelope() -> None:
    doc = document(routes())
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            for status, answer in op["responses"].items():
                if int(status) >= 400:
                    schema = answer["content"]["application/json"]["schema"]
                    assert schema == {"$ref": REF.format(name="ErrorEnvelope")}, (path, method, status)
            if path.startswith("/v1/") and "x-websocket" not in op:
                assert "401" in op["responses"], (path, method)
