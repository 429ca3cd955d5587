"""keel's OpenTelemetry spans, with the GenAI semantic conventions, or none at all.

Tracing is on when the standard variables ask for an OTLP exporter (`OTEL_EXPORTER_OTLP_ENDPOINT`
or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), `OTEL_SDK_DISABLED` is not true and the SDK is installed
(`keel[otel]`); `configure` is called once per process by the app. Off, every `span` is one
shared no-op context and `traceparent` is "": nothing of OpenTelemetry is imported.

The spans (names and attributes as the GenAI conventions have them): the HTTP request (server
span, the app's middleware), per run of a turn `invoke_agent <agent>`, per model attempt
`chat <model>`, per tool call `execute_tool <tool>`. A message carries the W3C `traceparent` of
the request that sent it (stored with it), and every run of its turn, in whichever process and
after any takeover, is that request's child: one trace from the request to the reply. Message
and tool contents are recorded only with `KEEL_TRACE_CONTENT=1`, redacted as the logs are.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

TRACEPARENT = re.compile(r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
CONTENT_CHARS = 4_000  # a content attribute's length at most (with KEEL_TRACE_CONTENT)
_NULL: contextlib.nullcontext[None] = contextlib.nullcontext()


class _State:
    tracer: Tracer | None = None
    provider: Any = None  # the SDK's TracerProvider, flushed at shutdown
    content = False
    redact: Any = None  # text -> text, the logs' redaction


_state = _State()


def enabled() -> bool:
    return _state.tracer is not None


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for traces (an OTLP endpoint, the SDK not disabled)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(env: Mapping[str, str], *, service: str = "keel", redact: Any = None) -> bool:
    """Set this process's tracing up from the standard OTEL_* variables (the exporter, the
    sampler, the batch processor read them themselves); True if it is on. ImportError, naming
    the extra, if traces are asked for without the SDK."""
    if not wanted(env):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:  # pragma: no cover - the extra is in the dev install
        raise ImportError("OTEL_EXPORTER_OTLP_ENDPOINT is set: tracing needs pip install 'keel[otel]'") from exc
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME") or service})
    provider = TracerProvider(resource=resource)  # (the sampler from OTEL_TRACES_SAMPLER)
    # (the endpoint from `env`; the rest of the exporter's settings it reads from the process's)
    traces = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env["OTEL_EXPORTER_OTLP_ENDPOINT"].rstrip("/") + "/v1/traces"
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces)))
    _state.provider = provider
    _state.tracer = provider.get_tracer("keel")
    _state.content = env.get("KEEL_TRACE_CONTENT", "") == "1"
    _state.redact = redact
    return True


def shutdown() -> None:
    """Export what is left, and stop (a process that ends)."""
    if _state.provider is not None:
        _state.provider.shutdown()
    _state.tracer = _state.provider = None


def span(
    name: str,
    attributes: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
    *,
    parent: str = "",
    server: bool = False,
    signals: tuple[type[BaseException], ...] = (),
) -> contextlib.AbstractContextManager[Span | None]:
    """A span as the current one for the block (None when tracing is off): a child of the
    current span, or of `parent` (a traceparent) when given. An exception leaving the block
    sets `error.type` and the error status, but one of `signals` (a cancel, a hand-over: not
    failures) and a task's cancellation, which are noted as `keel.stopped`. `attributes` may be
    a function that makes them: a turn's spans then cost no dict while tracing is off."""
    if _state.tracer is None:
        return _NULL
    if callable(attributes):
        attributes = attributes()
    return _started(_state.tracer, name, attributes or {}, parent=parent, server=server, signals=signals)


@contextlib.contextmanager
def _started(
    tracer: Tracer,
    name: str,
    attributes: Mapping[str, Any],
    *,
    parent: str,
    server: bool,
    signals: tuple[type[BaseException], ...],
) -> Iterator[Span]:
    from opentelemetry.trace import SpanKind

    context = _context_of(parent) if parent else None
    kind = SpanKind.SERVER if server else SpanKind.INTERNAL
    with tracer.start_as_current_span(
        name,
        context=context,
        kind=kind,
        attributes=dict(attributes),
        record_exception=False,
        set_status_on_exception=False,
    ) as current:
        stops: tuple[type[BaseException], ...] = (asyncio.CancelledError, *signals)
        try:
            yield current
        except BaseException as exc:
            if isinstance(exc, stops):
                current.set_attribute("keel.stopped", type(exc).__name__)
            else:
                failed(current, type(exc).__qualname__)
            raise


def failed(current: Span | None, error_type: str) -> None:
    """Mark the span failed (`error.type`), for an outcome that is not an exception."""
    if current is not None:
        from opentelemetry.trace import Status, StatusCode

        current.set_attribute("error.type", error_type)
        current.set_status(Status(StatusCode.ERROR, error_type))


def record(current: Span | None, attributes: Mapping[str, Any]) -> None:
    """Attributes known only once the work is done (tokens, the response's model)."""
    if current is not None:
        current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def content(current: Span | None, key: str, text: str) -> None:
    """A content attribute (a prompt, a tool's arguments or result), only with KEEL_TRACE_CONTENT=1."""
    if current is not None and _state.content:
        shown = _state.redact(text) if _state.redact is not None else text
        current.set_attribute(key, shown[:CONTENT_CHARS])


def traceparent() -> str:
    """The current span's W3C traceparent ("" when there is none, or tracing is off)."""
    if _state.tracer is None:
        return ""
    from opentelemetry.trace import get_current_span

    ctx = get_current_span().get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def _context_of(parent: str) -> Any:
    """The context whose current span is the remote one `parent` names (None if it is no
    traceparent: the span is then a root)."""
    if not TRACEPARENT.match(parent):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": parent})


def headers() -> dict[str, str]:
    """The traceparent header for an outgoing request (none when there is no current span)."""
    current = traceparent()
    return {"traceparent": current} if current else {}
