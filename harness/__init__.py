"""keel's agent harness: the public face of the durable agent loop.

keel's agent harness: the durable agent loop, in rooms by part (see docs/architecture.md "Architecture in a
page"). Imports neither `app` nor `channels`.

The public face: an agent is an `Agent` with `tool`s (`from harness import Agent, ToolContext,
tool`) and perhaps `McpServer`s (`load_mcp_config`), a `Compaction` to tune, models from
`harness.models`; a keel process runs one
`Harness`. Channels also read `harness.events` (the catalogue of events), `harness.types`,
`harness.errors` and implement `harness.relay.Destination`.
"""

from harness.loop.agent import Agent
from harness.loop.compaction import Compaction
from harness.service import Harness
from harness.service.quotas import RateLimit
from harness.tools import Tool, ToolContext, tool
from harness.tools.mcpconfig import McpConfigError, McpServer, load_mcp_config

__all__ = [
    "Agent",
    "Compaction",
    "Harness",
    "McpConfigError",
    "McpServer",
    "RateLimit",
    "Tool",
    "ToolContext",
    "load_mcp_config",
    "tool",
]
