"""`python -m app.worker`: a turn runner without HTTP, against the REDIS_URL the web process uses."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from uvicorn.loops.auto import auto_loop_factory

from app import build_harness, heap
from app import traces as app_tracing
from app.__main__ import prepare
from app.logs import configure as configure_logs
from app.metrics import serve_worker_metrics
from app.settings import Settings, SettingsError

log = logging.getLogger("keel.worker")


async def run(settings: Settings, url: str) -> None:
    harness = build_harness(settings, url, run_turns=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await harness.start()
    log.info("worker running turns")
    if settings.metrics_port:
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
        await serve_worker_metrics(harness, settings, stop)
    else:
        await stop.wait()
    log.info("worker draining (at most %.1f s)", settings.drain_s)
    try:  # the turns running here go to other processes at once (docs/production.md: Process lifecycle)
        handed = await harness.hand_over(settings.drain_s)
        log.info("drained: %d turns handed over", handed)
    except Exception as exc:  # (Redis gone: the jobs stay pending, and are reclaimed)
        log.warning("drain: handing the turns over failed: %s", exc)
    await harness.stop()


# The worker's event loop, chosen as uvicorn chooses the web process's (`loop="auto"`): uvloop
# where it is installed (uvicorn[standard] brings it), else asyncio's own. The worker's CPU a
# sequential turn is 6-8% lower on uvloop (docs/benchmarks.md, "The worker's event loop").
new_loop = auto_loop_factory()


def main() -> int:
    try:
        settings = Settings.from_env()
        if settings.redis_url is None:
            raise SettingsError("the worker needs REDIS_URL: the embedded Valkey belongs to one web process")
        configure_logs(settings, dict(os.environ))
        app_tracing.start(settings, os.environ, service=os.environ.get("OTEL_SERVICE_NAME") or "keel-worker")
        url, _ = prepare(settings, runs_turns=True)
    except (SettingsError, ImportError) as exc:
        print(f"keel worker: {exc}", file=sys.stderr)
        return 1
    heap.settle(settings.gc_threshold)
    try:
        with asyncio.Runner(loop_factory=new_loop) as runner:
            runner.run(run(settings, url))
    finally:
        app_tracing.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
