"""MCP servers as an agent is given them: `McpServer`, read from the file MCP clients already use.

`KEEL_MCP_CONFIG=<path>` names a JSON file `{"mcpServers": {"<name>": {...}}}`. A server is
either `{"command", "args", "env"}` (started as a subprocess, spoken to over stdio) or `{"url",
"headers"}` (streamable HTTP). keel's own keys, all optional: `"allow"` (only these tools),
`"block"` (not these), `"approval"` (`"destructive"`, the default: a tool whose annotations do
not say `readOnlyHint: true` asks a person first; `"always"`; `"never"`; or an object of tool
name -> one of those, `"*"` for the rest), `"timeout_s"` (a call's bound, 60 by default).
`${VAR}` in an `env` or `headers` value (and in `command`, `args` and `url`) is taken from keel's
environment, so secrets stay out of the file. Anything else is an error that names the server
and the key (a key of the other transport too). This module reads and
checks; `harness.tools.mcp` connects.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import msgspec

Approval = Literal["destructive", "always", "never"]
APPROVALS: frozenset[str] = frozenset({"destructive", "always", "never"})
NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")  # a server's name: the prefix of its tools' names
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_STDIO_KEYS = {"command", "args", "env"}
_HTTP_KEYS = {"url", "headers"}
_KEYS = {*_STDIO_KEYS, *_HTTP_KEYS, "allow", "block", "approval", "timeout_s", "type"}
_TYPES = {"stdio": "stdio", "http": "http", "streamable-http": "http", "streamableHttp": "http"}
DEFAULT_TIMEOUT_S = 60.0


class McpConfigError(ValueError):
    """The configuration cannot be used; the message names the server and what is wrong."""


class McpServer(msgspec.Struct, frozen=True, kw_only=True):
    """One MCP server an agent takes tools from. Make one with `McpServer.stdio(...)` or
    `McpServer.http(...)`, or read them from a file with `load_mcp_config`."""

    name: str
    command: str = ""  # stdio: the program to start ...
    args: tuple[str, ...] = ()  # ... its arguments
    env: Mapping[str, str] = {}  # ... and its environment (besides PATH and HOME)
    url: str = ""  # streamable HTTP: the server's endpoint ...
    headers: Mapping[str, str] = {}  # ... and the headers each request carries
    allow: tuple[str, ...] | None = None  # only these tools (None: all)
    block: tuple[str, ...] = ()  # not these
    approval: Approval | Mapping[str, Approval] = "destructive"
    timeout_s: float = DEFAULT_TIMEOUT_S

    @classmethod
    def stdio(cls, name: str, command: str, args: list[str] | tuple[str, ...] = (), **keys: Any) -> McpServer:
        return check(cls(name=name, command=command, args=tuple(args), **keys))

    @classmethod
    def http(cls, name: str, url: str, headers: Mapping[str, str] | None = None, **keys: Any) -> McpServer:
        return check(cls(name=name, url=url, headers=dict(headers or {}), **keys))

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command else "http"

    def approval_of(self, tool: str) -> Approval:
        """How a call of `tool` is approved."""
        if isinstance(self.approval, str):
            return self.approval
        return self.approval.get(tool, self.approval.get("*", "destructive"))

    def offers(self, tool: str) -> bool:
        """Whether the agent takes `tool` from this server (`allow`, `block`)."""
        return (self.allow is None or tool in self.allow) and tool not in self.block


def check(server: McpServer) -> McpServer:
    """`server` if it can be used, else McpConfigError naming what is wrong."""
    where = f"MCP server {server.name!r}"
    if not NAME.match(server.name):
        raise McpConfigError(f"{where}: a name is 1 to 32 of A-Z a-z 0-9 _ -")
    if bool(server.command) == bool(server.url):
        raise McpConfigError(f"{where}: give either a command (stdio) or a url (streamable HTTP)")
    if server.url and not server.url.startswith(("http://", "https://")):
        raise McpConfigError(f"{where}: url must be http:// or https://, not {server.url[:40]!r}")
    modes = [server.approval] if isinstance(server.approval, str) else list(server.approval.values())
    if any(mode not in APPROVALS for mode in modes):
        raise McpConfigError(f"{where}: approval is one of destructive, always, never (or an object of them)")
    if not 0 < server.timeout_s <= 3600:
        raise McpConfigError(f"{where}: timeout_s is a number of seconds above 0, at most 3600")
    return server


def load_mcp_config(path: str | Path, environ: Mapping[str, str] | None = None) -> list[McpServer]:
    """The servers of a `{"mcpServers": {...}}` file, checked; `${VAR}` in `env` and `headers`
    values from `environ` (keel's environment by default)."""
    env = os.environ if environ is None else environ
    try:
        raw = msgspec.json.decode(Path(path).read_bytes())
    except OSError as exc:
        raise McpConfigError(f"KEEL_MCP_CONFIG: cannot read {path}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise McpConfigError(f"KEEL_MCP_CONFIG: {path} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != {"mcpServers"} or not isinstance(raw["mcpServers"], dict):
        raise McpConfigError(f'KEEL_MCP_CONFIG: {path} holds one object, {{"mcpServers": {{"<name>": {{...}}}}}}')
    return [_server(name, entry, env) for name, entry in raw["mcpServers"].items()]


def _server(name: str, entry: Any, env: Mapping[str, str]) -> McpServer:
    where = f"MCP server {name!r}"
    if not isinstance(entry, dict):
        raise McpConfigError(f"{where}: an entry is an object")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise McpConfigError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(sorted(_KEYS))})")
    fields = dict(entry)
    transport = "http" if "url" in fields else "stdio"
    kind = fields.pop("type", None)  # (as some clients write it: checked against the entry, not needed)
    if kind is not None and kind not in _TYPES:
        raise McpConfigError(f"{where}: type is stdio or http, not {kind!r}")
    if kind is not None and _TYPES[kind] != transport:
        has = "a url" if transport == "http" else "no url"
        raise McpConfigError(f"{where}: type {kind!r} does not fit an entry with {has}")
    other = sorted(set(fields) & (_STDIO_KEYS if transport == "http" else _HTTP_KEYS))
    if other and ("url" in fields) != ("command" in fields):
        raise McpConfigError(f"{where}: {other[0]!r} is for {'stdio' if transport == 'http' else 'HTTP'} servers")
    for key in ("env", "headers"):
        if key in fields:
            fields[key] = _expanded(where, key, fields[key], env)
    for key in ("command", "url"):
        if isinstance(fields.get(key), str):
            fields[key] = _sub(where, key, fields[key], env)
    if isinstance(fields.get("args"), list):
        fields["args"] = [_sub(where, "args", a, env) if isinstance(a, str) else a for a in fields["args"]]
    try:
        return check(msgspec.convert({"name": name, **fields}, McpServer))
    except msgspec.ValidationError as exc:
        raise McpConfigError(f"{where}: {exc}") from None


def _expanded(where: str, key: str, values: Any, env: Mapping[str, str]) -> dict[str, str]:
    if not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values()):
        raise McpConfigError(f"{where}: {key} is an object of strings")
    return {name: _sub(where, key, value, env) for name, value in values.items()}


def _sub(where: str, key: str, value: str, env: Mapping[str, str]) -> str:
    """`value` with each `${VAR}` taken from `env` (McpConfigError naming one it lacks)."""

    def var(m: re.Match[str]) -> str:
        if m.group(1) not in env:
            raise McpConfigError(f"{where}: {key} names ${{{m.group(1)}}}, which keel's environment does not have")
        return env[m.group(1)]

    return _VAR.sub(var, value)
