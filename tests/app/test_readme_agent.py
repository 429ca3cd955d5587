"""The agent module "Your own agent" (docs/agents.md, linked from the README) shows runs as
printed: its imports are keel's public face (`harness`, `harness.models`), so an agent written
for keel before its harness moved into rooms runs unchanged."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from app import load_agent
from tests.conftest import ROOT


def readme_agent() -> str:
    section = (ROOT / "docs" / "agents.md").read_text().split("# Your own agent", 1)[1]
    found = re.search(r"```python\n(# myagent\.py\n.*?)```", section, re.S)
    assert found is not None, "the agent module of docs/agents.md"
    return found.group(1)


async def test_the_readme_agent_module_runs_as_printed(
    tmp_path: Path, make_harness: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "myagent.py").write_text(readme_agent())
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        agent = load_agent("myagent:agent")  # KEEL_AGENT=myagent:agent
        h = await make_harness(agent)
        sid = await h.sessions.create("ada")
        turn = await h.sessions.submit_and_wait(sid, "ada", "where is 17?", context=None, message_id=None, timeout=10)
        assert turn.status == "completed" and turn.reply == "order 17: shipped"  # its tool ran, its reply came back
        assert [e.type for e in turn.events].count("tool.completed") == 1
    finally:
        sys.modules.pop("myagent", None)
