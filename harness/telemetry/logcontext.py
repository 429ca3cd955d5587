"""The ids a log line is about, as context variables.

The ids a log line is about, as context variables: the channel sets `request_id` (and
`session_id`) where a request or a websocket frame comes in, the runner `session_id` and
`turn_id` for each turn it runs; a log formatter (app/logs.py) reads them. Setting one costs
about what a dict write does."""

from __future__ import annotations

from contextvars import ContextVar

request_id: ContextVar[str | None] = ContextVar("keel_request_id", default=None)
session_id: ContextVar[str | None] = ContextVar("keel_session_id", default=None)
turn_id: ContextVar[str | None] = ContextVar("keel_turn_id", default=None)
