"""`make slack-demo` works on a fresh machine: keel in Slack, against the local Slack server."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.service import ROOT


@pytest.mark.slow
def test_the_slack_demo_plays_a_whole_conversation() -> None:
    r = subprocess.run(
        [sys.executable, "deploy/slack_demo.py"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "  keel posts: The add tool says: 5" in lines
    assert any(
        line.startswith("  keel posts: keel wants to run `place_order`") and "[Approve]" in line for line in lines
    )
    assert any(line.startswith("  keel updates its post: Approved by <@U0ALICE>") for line in lines)
    assert "  keel posts: The place_order tool says: ordered the desk lamp (pretend)" in lines
