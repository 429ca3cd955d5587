"""Logging for a keel process: text lines (`KEEL_LOG_FORMAT=text`, the default) or one JSON
object per line (`json`): `time`, `level`, `logger`, `message`, and `session_id`, `turn_id`,
`request_id` when the line is about one (`harness.telemetry.logcontext`), `exc` for a traceback.

Every line, uvicorn's access and error lines included (uvicorn gets no logging config of its
own: its loggers reach the root handler installed here), goes through `Redactor` last: the
process's secrets (API keys, signing secrets, bot and provider keys, the token secret) are
replaced wherever they appear, and so is anything shaped like one (`whsec_...` webhook secrets,
Slack `xox.-` tokens, `sk-...` keys, a `?token=` in a path, a Bearer credential). The cheap
checks come first: a line with none of the markers costs a few substring tests.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Iterable

import msgspec

from app.settings import Settings
from harness.telemetry.logcontext import request_id, session_id, turn_id

REDACTED = "[redacted]"
# (a marker to look for first, the pattern that finds the secret)
SHAPES = (
    ("whsec_", re.compile(r"whsec_[A-Za-z0-9+/=_\-]+")),
    ("xox", re.compile(r"(?<![A-Za-z0-9])xox[a-z]-[A-Za-z0-9\-]+")),
    ("sk-", re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{8,}")),
    ("token=", re.compile(r"(token=)[^&\s\"']+")),
    ("key=", re.compile(r"(key=)[^&\s\"']+")),
    ("secret=", re.compile(r"(secret=)[^&\s\"']+")),
    ("earer", re.compile(r"([Bb]earer\s+)[^\s\"',]+")),
)
_enc = msgspec.json.Encoder()


def secrets_of(settings: Settings, env: dict[str, str]) -> list[str]:
    """Every secret value this process knows of."""
    values: list[str | None] = [
        *settings.api_keys,
        settings.token_secret,
        settings.slack_signing_secret,
        settings.slack_bot_token,
        settings.linear_webhook_secret,
        settings.linear_api_key,
        env.get("ANTHROPIC_API_KEY"),
        env.get("OPENAI_API_KEY"),
    ]
    return sorted({v for v in values if v}, key=len, reverse=True)  # (whatever their length)


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self.secrets = list(secrets)

    def __call__(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        for marker, pattern in SHAPES:
            if marker in text:
                text = pattern.sub(lambda m: (m.group(1) if m.re.groups else "") + REDACTED, text)
        return text


class TextFormatter(logging.Formatter):
    def __init__(self, redact: Redactor) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.redact = redact

    def format(self, record: logging.LogRecord) -> str:
        return self.redact(super().format(record))


class JsonFormatter(logging.Formatter):
    def __init__(self, redact: Redactor) -> None:
        super().__init__()
        self.redact = redact

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, str] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": self.redact(record.getMessage()),
        }
        for key, var in (("session_id", session_id), ("turn_id", turn_id), ("request_id", request_id)):
            value = var.get()
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exc"] = self.redact(self.formatException(record.exc_info))
        return _enc.encode(line).decode()


def configure(settings: Settings, env: dict[str, str]) -> None:
    """The root logger of this process: one handler on stderr, the chosen format, redacted."""
    redact = Redactor(secrets_of(settings, env))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(redact) if settings.log_format == "json" else TextFormatter(redact))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # (no handlers of their own: they reach ours)
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
