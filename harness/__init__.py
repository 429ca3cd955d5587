"""keel's agent harness: the durable agent loop. Imports neither `app` nor `channels`."""

from harness.loop.agent import Agent
from harness.service import Harness
from harness.tools import Tool, ToolContext, tool

__all__ = ["Agent", "Harness", "Tool", "ToolContext", "tool"]
