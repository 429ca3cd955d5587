"""The randomized crash soak, short: a few seeded trials, each crashing keel once (at a failpoint
or by SIGKILL) in the middle of a random workload on 1-3 sessions, recovering on a replacement,
and checking the invariants (tests/crash/soak_lib.py). deploy/soak.py runs the same trials by the
hundred."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tests.conftest import ValkeyServer
from tests.crash.soak_lib import FAILPOINTS, KINDS, run_soak, summary, trial_line

SEED = 20240611
TRIALS = 2 * len(KINDS)  # each kind twice: every failpoint and a plain SIGKILL
BUDGET_S = 90.0  # about 25 s on 2 cores; a trial that hangs gives up after 30 s


@pytest.mark.slow
async def test_random_crashes_keep_every_invariant(valkey: ValkeyServer, redis: Redis, tmp_path: Path) -> None:
    started = time.monotonic()
    results = await run_soak(valkey.url, tmp_path, seed=SEED, trials=range(TRIALS), trial_deadline=30, budget=BUDGET_S)
    report = "\n".join([*map(trial_line, results), *summary(results, time.monotonic() - started)])
    print(report)
    violations = [v for r in results for v in r.violations]
    assert not violations, "\n".join([*violations, report])
    assert len(results) == TRIALS, f"the budget of {BUDGET_S:.0f}s ran out\n{report}"
    assert {r.plan.kind for r in results} == set(KINDS), report
    unfired = [r.plan.describe() for r in results if r.plan.kind in FAILPOINTS and not r.fired]
    assert not unfired, report  # a failpoint trial that never crashed tested nothing
