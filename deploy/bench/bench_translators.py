"""The frontend translators' own cost per text delta: 20,000 `message.delta` events fed to the
AI SDK UI stream (`channels.aisdk.UiStream`) and to AG-UI (`channels.agui.AguiRun`) in a loop,
no I/O, microseconds per delta (median of --rounds).

    .venv/bin/python deploy/bench/bench_translators.py [--deltas 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from channels.agui import AguiRun
from channels.aisdk import UiStream
from harness.events import MessageDelta, MessageDeltaData


def per_delta_us(make: type[UiStream] | type[AguiRun], deltas: list[MessageDelta]) -> float:
    translator: UiStream | AguiRun = UiStream("turn_1") if make is UiStream else AguiRun("ses_1", "run_1")
    t0 = time.perf_counter()
    for d in deltas:
        translator.feed(d)
    return (time.perf_counter() - t0) / len(deltas) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--deltas", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    deltas = [
        MessageDelta(session_id="ses_1", turn_id="turn_1", at=0.0, data=MessageDeltaData("it_1", "x" * 40, 40 * i))
        for i in range(args.deltas)
    ]
    for name, make in (("AI SDK UI stream", UiStream), ("AG-UI", AguiRun)):
        runs = [per_delta_us(make, deltas) for _ in range(args.rounds)]
        print(f"{name:<18} {statistics.median(runs):6.2f} us per delta (rounds: {', '.join(f'{r:.2f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
