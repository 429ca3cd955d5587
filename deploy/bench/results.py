"""`make bench`'s results (deploy/bench/results.json): the targets keel is held to, and the
table README.md shows, made from the file (a test keeps the two the same)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
README = HERE.parents[1] / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


class Target(NamedTuple):
    kind: str  # the measurement (results.json's key)
    key: str  # the figure in it
    what: str  # its row in the table
    at_most: bool  # the figure must be at most `limit` (else at least)
    limit: float
    show: str  # how the keel and baseline figures read


TARGETS = (
    Target("inprocess", "seq_p50_ratio", "in-process, sequential p50 (keel / floor)", True, 1.5, "ms"),
    Target("inprocess", "turns_per_s_ratio", "in-process, turns/s at 50 sessions (keel / floor)", False, 0.6, "tps"),
    Target("http", "seq_p50_ratio", "HTTP, sequential p50 (keel / bare)", True, 1.3, "ms"),
    Target("http", "turns_per_s_ratio", "HTTP, turns/s at 100 sessions (keel / bare)", False, 0.8, "tps"),
    Target("cluster", "cpu_ratio", "CPU a turn, cluster / one Valkey (the web process)", True, 1.2, "cpu"),
    Target("memory", "bytes_per_turn", "Redis bytes a turn, 1,000-turn session, windows passed", True, 500.0, "bytes"),
)


def met(target: Target, value: float) -> bool:
    return value <= target.limit if target.at_most else value >= target.limit


def _figures(target: Target, found: dict[str, Any]) -> tuple[str, str]:
    """The keel and the baseline figures behind a ratio, as the row shows them."""
    match target.kind, target.show:
        case "inprocess", "ms":
            return f"{found['keel_seq_p50_ms']:.2f} ms", f"floor {found['floor_seq_p50_ms']:.2f} ms"
        case "inprocess", _:
            return f"{found['keel_turns_per_s']:,.0f}", f"floor {found['floor_turns_per_s']:,.0f}"
        case "http", "ms":
            return f"{found['keel_seq_p50_ms']:.2f} ms", f"bare {found['bare_seq_p50_ms']:.2f} ms"
        case "http", _:
            return f"{found['keel_turns_per_s']:,.0f}", f"bare {found['bare_turns_per_s']:,.0f}"
        case "cluster", _:
            return f"{found['cluster_cpu_ms_per_turn']:.2f} ms", f"one Valkey {found['server_cpu_ms_per_turn']:.2f} ms"
        case _:
            return f"{found['bytes_per_turn']:,.0f} bytes", "-"


def render(results: dict[str, Any]) -> str:
    """The table of every target: keel's figure, the baseline's, the ratio, the target, met."""
    lines = [
        "| measure | keel | baseline | figure | target | met |",
        "|---|---:|---:|---:|---:|:-:|",
    ]
    dates = set()
    for t in TARGETS:
        found = results.get(t.kind)
        if found is None:
            lines.append(f"| {t.what} | | | not measured | {'<=' if t.at_most else '>='} {t.limit:g} | |")
            continue
        dates.add(f"{found['date']}, {found['commit']}")
        value = found[t.key]
        keel, base = _figures(t, found)
        figure = f"{value:,.0f}" if t.kind == "memory" else f"x{value:.2f}"
        limit = f"{t.limit:,.0f}" if t.kind == "memory" else f"x{t.limit:g}"
        lines.append(
            f"| {t.what} | {keel} | {base} | {figure} | {'<=' if t.at_most else '>='} {limit} "
            f"| {'yes' if met(t, value) else 'no'} |"
        )
    runs = results.get("runs", 3)
    lines.append("")
    lines.append(
        f"`{results.get('command', 'make bench')}` ({'; '.join(sorted(dates))}): medians of {runs} "
        "runs' ratios, each taken within one run; deploy/bench/results.json has every run."
    )
    return "\n".join(lines)


def readme_table(text: str) -> str | None:
    """The table between README.md's bench markers, if it has them."""
    found = re.search(re.escape(BEGIN) + r"\n?(.*?)\n?" + re.escape(END), text, re.S)
    return found.group(1) if found else None


def write_readme(results: dict[str, Any]) -> None:
    text = README.read_text()
    if readme_table(text) is None:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    block = f"{BEGIN}\n{render(results)}\n{END}"
    README.write_text(re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S))


def load() -> dict[str, Any]:
    found: dict[str, Any] = json.loads(RESULTS.read_text())
    return found
