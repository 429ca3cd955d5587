"""The randomized crash soak, short: a few seeded trials, each crashing keel once (at a failpoint
or by SIGKILL) in the middle of a random workload on 1-3 sessions, recovering on a replacement,
and checking the invariants (tests/crash/soak_lib.py); and a few failover trials on a cluster of
their own (keel with KEEL_DURABILITY=replica, the primary holding the trial's sessions killed and
its replica promoted mid-workload). deploy/soak.py runs the same trials by the hundred (with
`--cluster`, all kinds on the cluster)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from tests.cluster import ValkeyCluster
from tests.conftest import ON_CLUSTER, ValkeyServer
from tests.crash.soak_lib import FAILOVER, FAILPOINTS, KINDS, ClusterFaults, make_plan, run_soak, summary, trial_line

SEED = 20240611
TRIALS = 2 * len(KINDS)  # each kind twice: every failpoint and a plain SIGKILL
BUDGET_S = 90.0  # about 45 s on 2 cores; a trial that hangs gives up after 30 s
FAILOVERS = 3  # the first failover trials of the seed's cluster plans
FAILOVER_BUDGET_S = 60.0  # about 15 s on 2 cores (and 3 s to make the cluster)


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


@pytest.mark.slow
@pytest.mark.skipif(ON_CLUSTER, reason="makes a cluster of its own")  # (once per `make test`)
async def test_failovers_keep_every_invariant(cluster: ValkeyCluster, tmp_path: Path) -> None:
    trials = [t for t in range(40) if make_plan(SEED, t, cluster=True).kind == FAILOVER][:FAILOVERS]
    started = time.monotonic()
    results = await run_soak(
        cluster.url,
        tmp_path,
        seed=SEED,
        trials=trials,
        trial_deadline=30,
        budget=FAILOVER_BUDGET_S,
        faults=ClusterFaults(cluster),
    )
    report = "\n".join([*map(trial_line, results), *summary(results, time.monotonic() - started)])
    print(report)
    violations = [v for r in results for v in r.violations]
    assert not violations, "\n".join([*violations, report])
    assert len(results) == FAILOVERS, f"the budget of {FAILOVER_BUDGET_S:.0f}s ran out\n{report}"
    assert all(r.failover is not None for r in results), report  # every one failed over
