"""`python -m app.relay`: the delivery relay's dead letters, for an operator.

    python -m app.relay dead [--destination slack]          list them (JSON lines)
    python -m app.relay retry [--destination slack] [--session S [--event E]]
                                                            deliver them again

A retried event is reconciled with the destination first (a post that did arrive is not made
twice) and delivered by whichever keel process serves that destination, out of order by then.
REDIS_URL names the Redis (with the embedded Valkey, the URL `python -m app` logs at start)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import msgspec

from harness.store import Client, DeadLetter, Deliveries, connect


async def list_dead(redis: Client, destination: str) -> list[DeadLetter]:
    return await Deliveries(redis, None).dead(destination)


async def retry_dead(redis: Client, destination: str, session: str | None = None, event: str | None = None) -> int:
    deliveries = Deliveries(redis)
    letters = [
        d
        for d in await deliveries.dead(destination)
        if (session is None or d.session_id == session) and (event is None or d.event_id == event)
    ]
    return await deliveries.retry(destination, letters)


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.relay", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["dead", "retry"])
    parser.add_argument("--destination", default="slack")
    parser.add_argument("--session")
    parser.add_argument("--event")
    args = parser.parse_args(argv)
    url = os.environ.get("REDIS_URL")
    if not url:
        print("python -m app.relay needs REDIS_URL", file=sys.stderr)
        return 1
    redis = connect(url)
    try:
        if args.command == "dead":
            for letter in await list_dead(redis, args.destination):
                print(msgspec.json.encode(letter).decode())
        else:
            print(f"{await retry_dead(redis, args.destination, args.session, args.event)} queued for delivery")
    finally:
        await redis.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
