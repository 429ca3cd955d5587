"""Settings from the environment. Every variable is listed in docs/configuration.md."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path

from app.heap import THRESHOLD as GC_THRESHOLD
from harness import McpConfigError, McpServer, RateLimit, load_mcp_config
from harness.models.spec import check as check_model

DEMO_AGENT = "app.demo:agent"


class SettingsError(ValueError):
    """A setting has a value keel cannot use; the message names it."""


def _int(env: dict[str, str], name: str, default: int, low: int = 1) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a whole number, not {raw!r}") from None
    if value < low:
        raise SettingsError(f"{name} must be at least {low}")
    return value


def _float(env: dict[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, not {raw!r}") from None
    if not value > 0:
        raise SettingsError(f"{name} must be positive")
    return value


def _flag(env: dict[str, str], name: str, *, default: bool) -> bool:
    raw = (env.get(name) or "").lower()
    if raw == "":
        return default
    if raw not in ("1", "0", "true", "false"):
        raise SettingsError(f"{name} must be 1 or 0")
    return raw in ("1", "true")


def _mcp(env: dict[str, str]) -> tuple[McpServer, ...]:
    path = env.get("KEEL_MCP_CONFIG")
    if not path:
        return ()
    try:
        return tuple(load_mcp_config(path, env))
    except McpConfigError as exc:
        raise SettingsError(str(exc)) from None


def _url(env: dict[str, str], name: str, default: str, *, slash: bool = True) -> str:
    raw = env.get(name) or default
    if not raw.startswith(("https://", "http://")):
        raise SettingsError(f"{name} must be an http(s) URL, not {raw!r}")
    return raw + "/" if slash and not raw.endswith("/") else raw


def _rate(env: dict[str, str], name: str, default: str = "off") -> RateLimit | None:
    raw = env.get(name, "").strip() or default
    if raw.lower() == "off":
        return None
    try:
        return RateLimit.parse(raw)
    except ValueError as exc:
        raise SettingsError(f"{name}: {exc}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


TOKENS_PER_SESSION = RateLimit(60, 60)
DAY_MS = 86_400_000
SESSION_TTL_DAYS = 30  # a session nobody wrote to for a month is let go (KEEL_SESSION_TTL_DAYS)


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None
    data_dir: Path = Path(".keel")
    agent: str = DEMO_AGENT
    model: str | None = None
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_body: int = 1_048_576
    body_timeout: float = 30.0
    run_turns: bool = True
    runner_concurrency: int = 256
    lease_ms: int = 5_000
    event_retention: int = 10_000
    event_retention_ms: int = DAY_MS  # events also leave the outbox once this old (hours in the environment)
    idempotency_ms: int = DAY_MS  # a message id is remembered (a repeat is the same message) this long
    wait_timeout: float = 60.0
    sse_heartbeat: float = 15.0
    log_level: str = "info"
    log_format: str = "text"
    metrics_port: int = 0
    ws_max_frame: int = 65_536
    ws_heartbeat: float = 15.0
    ws_send_queue: int = 256
    ws_slow_s: float = 10.0
    allowed_origins: tuple[str, ...] = ()
    token_secret: str | None = field(default=None, repr=False)
    token_ttl: int = 900
    demo_page: bool = True
    slack_signing_secret: str | None = field(default=None, repr=False)
    slack_bot_token: str | None = field(default=None, repr=False)
    slack_api_url: str = "https://slack.com/api/"
    slack_approvers: frozenset[str] = frozenset()
    linear_webhook_secret: str | None = field(default=None, repr=False)
    linear_api_key: str | None = field(default=None, repr=False)
    linear_api_url: str = "https://api.linear.app/graphql"
    webhook_allow_private: bool = False
    webhook_retry_hours: float = 24.0
    webhook_timeout: float = 15.0
    rate_limit: RateLimit | None = None  # per API key: sessions, messages, compactions, tokens
    token_rate: RateLimit | None = TOKENS_PER_SESSION  # browser tokens minted per session
    max_queued: int = 100  # messages waiting behind a session's current turn
    max_readers: int = 32  # SSE streams and websockets on one session, per process
    max_token_sockets: int = 8  # websockets opened with one session token, per process
    job_shards: int = 0  # turn job streams (0: 1 on one server, 8 on a cluster)
    drain_s: float = 10.0  # SIGTERM: the drain's bound, then the process exits
    durability: str = "primary"  # "replica": every commit waits for a replica before it is acknowledged
    # a session left alone this long expires, all of it (0: never); days in the environment,
    # ms here (tests use a few)
    session_ttl_ms: int = SESSION_TTL_DAYS * DAY_MS
    mcp_servers: tuple[McpServer, ...] = ()  # KEEL_MCP_CONFIG's, added to the agent's tools
    gc_threshold: int = GC_THRESHOLD  # young objects that set off a collection (0: Python's own settings)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ) if env is None else env
        keys = tuple(k.strip() for k in env.get("KEEL_API_KEYS", "").split(",") if k.strip())
        settings = cls(
            host=env.get("KEEL_HOST") or "127.0.0.1",
            port=_int(env, "KEEL_PORT", 8000, low=0),
            redis_url=env.get("REDIS_URL") or None,
            data_dir=Path(env.get("KEEL_DATA_DIR") or ".keel"),
            agent=env.get("KEEL_AGENT") or DEMO_AGENT,
            model=env.get("KEEL_MODEL") or None,
            api_keys=keys,
            max_body=_int(env, "KEEL_MAX_BODY_BYTES", 1_048_576),
            body_timeout=_float(env, "KEEL_BODY_TIMEOUT_S", 30.0),
            run_turns=_flag(env, "KEEL_RUN_TURNS", default=True),
            runner_concurrency=_int(env, "KEEL_RUNNER_CONCURRENCY", 256),
            lease_ms=_int(env, "KEEL_LEASE_MS", 5_000, low=500),
            event_retention=_int(env, "KEEL_EVENT_RETENTION", 10_000, low=100),
            event_retention_ms=max(1, round(_float(env, "KEEL_EVENT_RETENTION_HOURS", 24.0) * 3_600_000)),
            idempotency_ms=max(1, round(_float(env, "KEEL_IDEMPOTENCY_HOURS", 24.0) * 3_600_000)),
            wait_timeout=_float(env, "KEEL_WAIT_TIMEOUT", 60.0),
            sse_heartbeat=_float(env, "KEEL_SSE_HEARTBEAT", 15.0),
            log_level=(env.get("KEEL_LOG_LEVEL") or "info").lower(),
            log_format=(env.get("KEEL_LOG_FORMAT") or "text").lower(),
            metrics_port=_int(env, "KEEL_METRICS_PORT", 0, low=0),
            ws_max_frame=_int(env, "KEEL_WS_MAX_FRAME", 65_536, low=1024),
            ws_heartbeat=_float(env, "KEEL_WS_HEARTBEAT", 15.0),
            ws_send_queue=_int(env, "KEEL_WS_SEND_QUEUE", 256),
            ws_slow_s=_float(env, "KEEL_WS_SLOW_S", 10.0),
            allowed_origins=tuple(o.strip() for o in env.get("KEEL_ALLOWED_ORIGINS", "").split(",") if o.strip()),
            token_secret=env.get("KEEL_TOKEN_SECRET") or None,
            token_ttl=_int(env, "KEEL_TOKEN_TTL", 900, low=10),
            demo_page=_flag(env, "KEEL_DEMO_PAGE", default=not keys),
            slack_signing_secret=env.get("SLACK_SIGNING_SECRET") or None,
            slack_bot_token=env.get("SLACK_BOT_TOKEN") or None,
            slack_api_url=_url(env, "KEEL_SLACK_API_URL", "https://slack.com/api/"),
            linear_webhook_secret=env.get("LINEAR_WEBHOOK_SECRET") or None,
            linear_api_key=env.get("LINEAR_API_KEY") or None,
            linear_api_url=_url(env, "KEEL_LINEAR_API_URL", "https://api.linear.app/graphql", slash=False),
            webhook_allow_private=_flag(env, "KEEL_WEBHOOK_ALLOW_PRIVATE", default=False),
            webhook_retry_hours=_float(env, "KEEL_WEBHOOK_RETRY_HOURS", 24.0),
            webhook_timeout=_float(env, "KEEL_WEBHOOK_TIMEOUT_S", 15.0),
            slack_approvers=frozenset(u.strip() for u in env.get("KEEL_SLACK_APPROVERS", "").split(",") if u.strip()),
            rate_limit=_rate(env, "KEEL_RATE_LIMIT"),
            token_rate=_rate(env, "KEEL_TOKEN_RATE_LIMIT", str(TOKENS_PER_SESSION)),
            max_queued=_int(env, "KEEL_MAX_QUEUED", 100, low=1),
            max_readers=_int(env, "KEEL_MAX_SESSION_EVENTS_READERS", 32, low=1),
            max_token_sockets=_int(env, "KEEL_MAX_TOKEN_SOCKETS", 8, low=1),
            job_shards=_int(env, "KEEL_JOB_SHARDS", 0, low=0),
            drain_s=_float(env, "KEEL_DRAIN_S", 10.0),
            durability=(env.get("KEEL_DURABILITY") or "primary").lower(),
            session_ttl_ms=_int(env, "KEEL_SESSION_TTL_DAYS", SESSION_TTL_DAYS, low=0) * DAY_MS,
            mcp_servers=_mcp(env),
            gc_threshold=_int(env, "KEEL_GC_THRESHOLD", GC_THRESHOLD, low=0),
        )
        if settings.event_retention_ms < settings.idempotency_ms:
            raise SettingsError(
                "KEEL_EVENT_RETENTION_HOURS must be at least KEEL_IDEMPOTENCY_HOURS: a message sent again within "
                "its id's window is answered from its turn's events, which must still be kept"
            )
        if settings.durability not in ("primary", "replica"):
            raise SettingsError(f"KEEL_DURABILITY must be primary or replica, not {settings.durability!r}")
        if settings.log_format not in ("text", "json"):
            raise SettingsError(f"KEEL_LOG_FORMAT must be text or json, not {settings.log_format!r}")
        if bool(settings.linear_webhook_secret) != bool(settings.linear_api_key):
            raise SettingsError("the Linear channel needs both LINEAR_WEBHOOK_SECRET and LINEAR_API_KEY")
        if bool(settings.slack_signing_secret) != bool(settings.slack_bot_token):
            raise SettingsError("the Slack channel needs both SLACK_SIGNING_SECRET and SLACK_BOT_TOKEN")
        if settings.model is not None:
            try:
                check_model(settings.model, env)
            except ValueError as exc:
                raise SettingsError(f"KEEL_MODEL: {exc}") from None
        if not settings.api_keys and not is_loopback(settings.host):
            raise SettingsError(
                f"KEEL_API_KEYS is unset: keel serves without auth only on loopback, not on KEEL_HOST={settings.host}"
            )
        return settings
