"""keel's processes set their garbage collector for many short-lived objects (app/heap.py):
the startup heap frozen, the first generation collected at KEEL_GC_THRESHOLD objects."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.heap import THRESHOLD
from app.settings import Settings, SettingsError
from tests.conftest import ROOT, ValkeyServer, free_port
from tests.service import Service, Worker

SETTLE = """
import gc, json, sys
from app import heap
before = gc.get_threshold()
heap.settle(int(sys.argv[1]))
print(json.dumps({"before": before, "after": gc.get_threshold(), "frozen": gc.get_freeze_count()}))
"""


def settled(threshold: int) -> dict[str, list[int] | int]:
    """What `settle(threshold)` leaves in a fresh interpreter (not this test process's)."""
    out = subprocess.run(
        [sys.executable, "-c", SETTLE, str(threshold)], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    got: dict[str, list[int] | int] = json.loads(out)
    return got


def test_the_setting() -> None:
    assert Settings().gc_threshold == Settings.from_env({}).gc_threshold == THRESHOLD == 50_000
    assert Settings.from_env({"KEEL_GC_THRESHOLD": "20000"}).gc_threshold == 20_000
    assert Settings.from_env({"KEEL_GC_THRESHOLD": "0"}).gc_threshold == 0  # Python's own settings
    for bad in ("-1", "1e5", "many"):
        with pytest.raises(SettingsError, match="KEEL_GC_THRESHOLD"):
            Settings.from_env({"KEEL_GC_THRESHOLD": bad})


def test_settle_freezes_the_startup_heap_and_raises_the_first_threshold_only() -> None:
    got = settled(12_345)
    before, after = got["before"], got["after"]
    assert isinstance(before, list) and isinstance(after, list)
    assert after == [12_345, *before[1:]]  # (the older generations' ratios stay Python's)
    assert isinstance(got["frozen"], int) and got["frozen"] > 1_000  # the modules imported so far, at least


def test_zero_leaves_the_collector_as_python_sets_it() -> None:
    got = settled(0)
    assert got["after"] == got["before"] and got["frozen"] == 0


def test_the_web_process_and_the_worker_settle_as_configured(tmp_path: Path, valkey: ValkeyServer) -> None:
    said = "a collection every 12345 young objects"
    svc = Service(tmp_path, free_port(), REDIS_URL=valkey.url, KEEL_LOG_LEVEL="debug", KEEL_GC_THRESHOLD="12345")
    worker = Worker(tmp_path, valkey.url, KEEL_LOG_LEVEL="debug", KEEL_GC_THRESHOLD="12345")
    try:
        svc.start()
        worker.start()
    finally:
        svc.stop()
        worker.stop()
    assert said in svc.log.read_text()
    assert said in worker.log.read_text()
