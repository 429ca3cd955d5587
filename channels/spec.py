"""What the OpenAPI document says about one route, kept beside its handler: `@operation(...)`
records an `Operation` for the handler function, and `channels.openapi` turns the route table
plus these records into the document. A route whose handler has none is not in the document
(the drift test in tests/channels/test_openapi.py fails for such a route of the API).

Bodies, answers and frames are msgspec types (the ones the handler decodes or encodes), so
their schemas come from the code. Errors are named by status with the codes they carry; the
generator adds what every route of its kind can answer: 401 on a route behind the API key,
400/408/413 on one that reads a body, 503 on one that reads storage."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Param:
    """A query parameter or header: its JSON schema, as the handler checks it."""

    name: str
    schema: Mapping[str, Any]
    description: str
    where: Literal["query", "header"] = "query"


@dataclass(frozen=True)
class Returns:
    """A successful answer: its status, its msgspec type (None: no body) and media type."""

    status: int
    type: Any
    description: str
    media: str = "application/json"
    # path parameters this answer provides, as OpenAPI runtime expressions: the document links
    # this operation to every operation with such a parameter (stateful testing follows them)
    provides: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Operation:
    summary: str
    answers: tuple[Returns, ...]
    errors: Mapping[int, str] = field(default_factory=dict)  # status -> the codes it carries
    body: Any = None  # the msgspec type of the JSON body
    body_optional: bool = False  # an empty body is as good as {}
    params: tuple[Param, ...] = ()
    storage: bool = True  # reads or writes Redis: 503 when it does not answer
    tag: str = "sessions"
    description: str = ""
    websocket: tuple[Any, Any] | None = None  # (client frame type, server frame schema name)


_operations: dict[Callable[..., Any], Operation] = {}


def operation(summary: str, *answers: Returns, **details: Any) -> Callable[[F], F]:
    """Record what the document says about the decorated handler."""
    op = Operation(summary, answers, **details)

    def mark(fn: F) -> F:
        _operations[fn] = op
        return fn

    return mark


def operation_of(endpoint: Callable[..., Any]) -> Operation | None:
    return _operations.get(endpoint)
