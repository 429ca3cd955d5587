"""A rolling restart under load (issue 15, item 5; tests/app/rolling.py): two web processes and a
worker restarted one after the other while HTTP+SSE and websocket clients run turns against both
ports: 0 events lost, 0 duplicated, 0 errors a client saw beyond the 503s it retried; every turn
a draining process was running went to another at once (a lapsed lease would take 20 s)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tests.app.rolling import rolling_restart
from tests.conftest import ValkeyServer

BUDGET_S = 60.0  # about 25 s on 2 cores


@pytest.mark.slow
async def test_a_rolling_restart_under_load_loses_and_repeats_nothing(
    valkey: ValkeyServer, redis: Redis, tmp_path: Path
) -> None:
    started = time.monotonic()
    tally = await rolling_restart(valkey.url, tmp_path, clients=4, rounds=2, say=print)
    took = time.monotonic() - started
    report = "\n".join([*tally.lines(), f"{took:.1f}s"])
    print(report)
    assert tally.errors == [], report
    assert tally.lost == 0 and tally.duplicated == 0, report
    assert [code for _, _, code in tally.drains] == [0] * 6, report  # 2 rounds of 3 processes, each exit 0
    assert tally.turns > 0 and tally.events > 0, report
    assert tally.reopened_1012 > 0 and tally.sse_ended > 0, report  # the restarts did reach the clients
    assert took < BUDGET_S, report
