"""Model spec strings (`anthropic:<model>`, `openai:<model>`, ...) made into models.

Model spec strings: `"anthropic:claude-sonnet-4-5"`, `"openai:gpt-5"`, `"openai-chat:<model>"`
(Chat Completions, for OpenAI-compatible servers). Keys and endpoints come from the SDKs' own
variables; `check` says what is missing before anything runs, `resolve` makes the model."""

from __future__ import annotations

import os
from collections.abc import Mapping

from harness.models.base import Model

KEYS = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY", "openai-chat": "OPENAI_API_KEY"}
EXTRAS = {"anthropic": "anthropic", "openai": "openai", "openai-chat": "openai"}


def check(spec: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(provider, model) of a spec, or ValueError with a one-line reason (unknown provider, no
    model name, the provider's key unset)."""
    env = os.environ if env is None else env
    provider, _, model = spec.partition(":")
    if provider not in KEYS:
        raise ValueError(
            f"model {spec!r}: the provider is one of {', '.join(KEYS)} (as in anthropic:claude-sonnet-4-5)"
        )
    if not model:
        raise ValueError(f"model {spec!r} names no model (as in {provider}:<model name>)")
    if not env.get(KEYS[provider]):
        raise ValueError(f"model {spec!r} needs {KEYS[provider]} (the {EXTRAS[provider]} SDK's variable)")
    return provider, model


def resolve(spec: str) -> Model:
    provider, model = check(spec)
    try:
        if provider == "anthropic":
            from harness.models.anthropic import AnthropicModel

            return AnthropicModel(model)
        from harness.models.openai import OpenAIModel

        return OpenAIModel(model, api="chat" if provider == "openai-chat" else "responses")
    except ImportError as exc:
        raise ValueError(
            f"model {spec!r} needs the {EXTRAS[provider]} SDK: pip install 'keel[{EXTRAS[provider]}]'"
        ) from exc
