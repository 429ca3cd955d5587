"""A process's tracing, set up from the standard OTEL_* variables (`harness.telemetry.tracing`),
its content attributes redacted as the logs are; exported and stopped when the process ends."""

from __future__ import annotations

from collections.abc import Mapping

from app.logs import Redactor, secrets_of
from app.settings import Settings
from harness.telemetry import tracing


def start(settings: Settings, env: Mapping[str, str], *, service: str = "keel") -> bool:
    """Tracing for this process if the environment asks for it; whether it is on."""
    return tracing.configure(env, service=service, redact=Redactor(secrets_of(settings, dict(env))))


def stop() -> None:
    tracing.shutdown()
