"""README.md's benchmark table is the one `make bench` made from deploy/bench/results.json: it
shows what was measured last, never figures typed by hand (`make bench BENCH_ARGS=--readme`
makes it again)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy" / "bench"))

from results import README, TARGETS, load, met, readme_table, render  # noqa: E402


def test_the_readme_table_is_made_from_the_results() -> None:
    table = readme_table(README.read_text())
    assert table is not None, "README.md has lost its bench: markers"
    assert table == render(load()), "README.md's table is not results.json's: make bench BENCH_ARGS=--readme"


def test_every_target_has_its_row_and_says_whether_it_is_met() -> None:
    results = load()
    rows = render(results).splitlines()
    for target in TARGETS:
        (row,) = [r for r in rows if r.startswith(f"| {target.what} |")]
        found = results.get(target.kind)
        if found is not None:
            assert row.endswith(f"| {'yes' if met(target, found[target.key]) else 'no'} |")
