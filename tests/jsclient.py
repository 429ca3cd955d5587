"""Running the real JavaScript clients (tests/js, installed by `make js`) from a test: a node
script as a subprocess that reports its steps as JSON lines on stdout."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

JS = Path(__file__).parent / "js"
NODE = shutil.which("node")


def skip_without_node() -> pytest.MarkDecorator:
    if NODE is None:
        return pytest.mark.skip(reason="no node on PATH: the JavaScript client tests need Node 20+")
    if not (JS / "node_modules" / ".keel-installed").exists():
        return pytest.mark.skip(reason="tests/js is not installed: run `make js`")
    return pytest.mark.skipif(False, reason="")


class NodeScript:
    """One run of a script in tests/js: `await step()` reads its next JSON line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.steps: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, script: str, *args: str) -> NodeScript:
        assert NODE is not None
        proc = await asyncio.create_subprocess_exec(
            NODE,
            str(JS / script),
            *args,
            cwd=JS,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def step(self, timeout: float = 30) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            err = await self.proc.stderr.read() if self.proc.stderr is not None else b""
            raise AssertionError(f"the script ended without a step; stderr: {err.decode()[-3000:]}")
        step: dict[str, Any] = json.loads(line)
        self.steps.append(step)
        if step["event"] == "failed":
            raise AssertionError(f"the script failed: {step['message']}")
        return step

    async def until(self, event: str, timeout: float = 30) -> dict[str, Any]:
        """Steps up to the first `event` one (an `error` step on the way is kept in `steps`)."""
        async with asyncio.timeout(timeout):
            while True:
                step = await self.step(timeout)
                if step["event"] == event:
                    return step

    def say(self, line: str = "go") -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")

    async def close(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


async def run_script(script: str, *args: str, timeout: float = 30) -> dict[str, Any]:
    """Run a script to its `done` step."""
    run = await NodeScript.start(script, *args)
    try:
        return await run.until("done", timeout)
    finally:
        await run.close()
