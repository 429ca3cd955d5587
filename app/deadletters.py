"""`python -m app.deadletters`: the delivery relay's dead letters, for an operator.

    python -m app.deadletters dead [--destination slack] [--session S [--event E]]   list them (JSON lines)
    python -m app.deadletters retry [--destination slack] [--session S [--event E]]  deliver them again

A retried event is reconciled with the destination first (a post that did arrive is not made
twice) and delivered by whichever keel process serves that destination, out of order by then.
REDIS_URL names the Redis (with the embedded Valkey, the URL `python -m app` logs at start).
Destinations: `slack`, `linear`, or an event webhook's `wh:<id>`."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import msgspec

from harness import Harness


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.deadletters", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["dead", "retry"])
    parser.add_argument("--destination", default="slack")
    parser.add_argument("--session")
    parser.add_argument("--event")
    args = parser.parse_args(argv)
    url = os.environ.get("REDIS_URL")
    if not url:
        print("python -m app.deadletters needs REDIS_URL", file=sys.stderr)
        return 1
    harness = Harness.connect(url, None, run_turns=False)  # (runs nothing: it only reads and queues)
    webhooks = harness.webhooks
    try:
        if args.command == "dead":
            for letter in await webhooks.dead_letters(args.destination, session=args.session, event=args.event):
                print(msgspec.json.encode(letter).decode())
        else:
            n = await webhooks.retry_dead_letters(args.destination, session=args.session, event=args.event)
            print(f"{n} queued for delivery")
    finally:
        await harness.stop()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
