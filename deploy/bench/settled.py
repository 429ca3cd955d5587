"""Runs a benchmark script in a process whose garbage collector is set as keel's own processes
set theirs (`app.heap.settle` at KEEL_GC_THRESHOLD's default), so that a baseline and keel
compare their code, not their collectors.

    python deploy/bench/settled.py SCRIPT [ARGS...]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the repository: keel's `app`)

from app import heap

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: settled.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))  # (as `python SCRIPT` would)
    heap.settle(heap.THRESHOLD)
    runpy.run_path(script, run_name="__main__")
