"""Tools from typed Python functions (`@tool`), and the context a tool gets.

Tools from typed Python functions: the JSON schema comes from the signature (via msgspec),
the description from the docstring, and arguments are validated against the same types."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, get_type_hints, overload

import msgspec

from harness.models.base import ToolSpec

Approval = bool | Callable[[str, dict[str, Any]], bool]


class ToolContext(msgspec.Struct, frozen=True):
    """Passed to a tool that declares a parameter of this type. `call_id` is the tool call's
    idempotency key: a tool with outside effects can use it to deduplicate a re-run."""

    session_id: str
    turn_id: str
    call_id: str


class Tool:
    """A callable the model may invoke. Build with `@tool`; an Agent wraps bare functions. A
    running call finishes even when its turn is cancelled (`interruptible` False)."""

    interruptible = False

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None, approval: Approval = False) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.approval = approval
        self.is_async = inspect.iscoroutinefunction(fn)
        hints = get_type_hints(fn, include_extras=True)  # keep Annotated limits
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        self._context_param: str | None = None
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {self.name}: *args/**kwargs are not supported")
            annotation = hints.get(pname, Any)
            if annotation is ToolContext:
                self._context_param = pname
                continue
            if param.default is inspect.Parameter.empty:
                fields.append((pname, annotation))
            else:
                fields.append((pname, annotation, param.default))
        self._args_type = msgspec.defstruct(f"{self.name}_args", fields, forbid_unknown_fields=True)
        self.spec = ToolSpec(name=self.name, description=inspect.getdoc(fn) or "", parameters=_schema(self._args_type))

    def needs_approval(self, arguments: dict[str, Any]) -> bool:
        if callable(self.approval):
            return bool(self.approval(self.name, arguments))
        return self.approval

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        """Check arguments against the signature; raises msgspec.ValidationError."""
        args = msgspec.convert(arguments, self._args_type)
        return {f: getattr(args, f) for f in args.__struct_fields__}

    async def invoke(self, arguments: dict[str, Any], context: ToolContext) -> Any:
        kwargs = self.validate(arguments)
        if self._context_param is not None:
            kwargs[self._context_param] = context
        if self.is_async:
            return await self.fn(**kwargs)
        # In a thread: a slow sync tool must not stop the event loop (and with it the lease
        # renewals of every turn in this process).
        return await asyncio.to_thread(self.fn, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


def _schema(args_type: type) -> dict[str, Any]:
    schema = msgspec.json.schema(args_type)
    defs: dict[str, Any] = schema.pop("$defs", {})
    name = args_type.__name__
    body: dict[str, Any] = dict(defs.pop(name, {"type": "object", "properties": {}}))
    body.pop("title", None)
    if defs:
        body["$defs"] = defs
    return body


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(*, name: str | None = None, approval: Approval = False) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None, /, *, name: str | None = None, approval: Approval = False
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """`@tool` or `@tool(approval=True)`: turn a typed function into a Tool."""
    if fn is not None:
        return Tool(fn)

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(f, name=name, approval=approval)

    return wrap
