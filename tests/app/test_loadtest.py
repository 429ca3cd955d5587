"""deploy/loadtest keeps working: the launcher and the generator, run as a user runs them, for
two seconds on two processes (two web processes running turns; a web process and a worker),
every client's events checked against its session's outbox; and the check itself finds a lost,
a repeated and a misplaced event."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from deploy.loadtest.clients import Stats, WsClient, check
from harness.store.keys import SessionKeys
from tests.conftest import ROOT

RUN_TIMEOUT_S = 120  # about 8 s each on 2 cores


@pytest.mark.slow
@pytest.mark.parametrize("topology", [["--web", "2"], ["--web", "1", "--workers", "1"]], ids=["2 web", "web+worker"])
def test_the_load_test_runs_and_every_client_saw_its_outbox(topology: list[str]) -> None:
    argv = [sys.executable, "deploy/loadtest/load.py", *topology, "--seconds", "2", "--http", "4", "--ws", "4"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["turns_per_s"] > 0 and result["turns"] > 0, out
    assert result["errors"] == 0 and result["lost"] == 0 and result["duplicated"] == 0, out
    assert result["problems"] == [], out
    assert result["events_checked"] >= 5 * result["turns"], out  # (message.received ... turn.completed)
    cpu = result["cpu_ms_per_turn"]
    assert cpu["web"] > 0 and cpu["redis"] > 0 and cpu["generator"] > 0, out
    assert (cpu["worker"] or 0) > 0 if "--workers" in topology else cpu["worker"] is None, out


async def test_the_check_finds_lost_repeated_and_misplaced_events(redis: Any) -> None:
    sid = "ses_loadtestcheck"
    key = SessionKeys(sid).outbox
    ids = []
    for n, kind in enumerate(["session.created", "message.received", "turn.started", "turn.completed"]):
        body = b'"seq":%d,"data":{"message_id":"m1"}}' % (n + 1)
        ids.append((await redis.xadd(key, {"s": n + 1, "t": kind, "b": body})).decode())
    client = WsClient("w0", 0, Stats())
    client.sid, client.sent = sid, ["m1"]
    client.seen = [ids[0], ids[0], ids[3]]  # the first twice, the second and third never
    checked = await check([client], redis)
    assert (checked.lost, checked.duplicated, checked.problems) == (2, 1, [])
    client.seen = [ids[0], ids[2], ids[1], ids[3]]  # all once, two of them swapped
    checked = await check([client], redis)
    assert (checked.lost, checked.duplicated, checked.problems) == (0, 0, ["w0: events out of order"])
    client.seen, client.sent = ids, ["m1", "m2"]  # all there; m2 never got its turn
    checked = await check([client], redis)
    assert (checked.lost, checked.duplicated) == (0, 0)
    assert checked.problems == ["w0: 1 messages without exactly one turn.completed, e.g. m2"]
