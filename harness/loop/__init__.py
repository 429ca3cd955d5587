"""The agent loop: what an agent is and how one turn of it runs.

The agent loop: the Agent that defines it, one turn (model steps, tool calls, commits), one
model step's attempts, prompt assembly with page and runtime context, compaction, the manual
compact and clear, and the values a step comes to."""
