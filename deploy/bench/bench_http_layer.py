"""keel's HTTP layer alone, against a bare Starlette endpoint's, in one process: no server, no
Redis, no turn.

    python deploy/bench/bench_http_layer.py [--requests 5000] [--rounds 5]

keel's app (`app.create_app`: its middleware, routing, the `POST .../messages?wait=true`
endpoint with its body, query and owner handling, and its response) is called as ASGI with a
harness that answers at once; the bare app (one Starlette route that reads the JSON body and
answers JSON, as bench_http.py's bare endpoint does around its two Redis calls) likewise. The
two alternate, round by round, on uvloop. It prints each one's median microseconds a request
and their difference: what keel's HTTP handling adds to a turn before any of its work. One
`RESULT {json}` line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # (the repository: keel's `app`)

from app import create_app
from app.settings import Settings
from harness.types import TurnResult

BODY = b'{"text":"hello"}'
SID = "ses_" + "0" * 26


class _Sessions:
    async def admissible(self, sid: str, owner: str, message_id: str | None = None) -> None:
        return None

    async def submit_and_wait(self, sid: str, owner: str, text: str, **_: Any) -> TurnResult:
        return TurnResult(sid, "msg_1", "completed", "hi there", [])


class _Quotas:
    async def admit(self, owner: str) -> None:
        return None


class _Harness:
    sessions = _Sessions()
    quotas = _Quotas()


def keel_app() -> Any:
    app = create_app(Settings(), redis_url="redis://127.0.0.1:1", agent=None)  # (no lifespan: never started)
    app.state.harness = _Harness()
    return app


def bare_app() -> Starlette:
    async def turn(request: Request) -> Response:
        sid = request.path_params["sid"]
        text = json.loads(await request.body())["text"]
        return JSONResponse({"session_id": sid, "status": "completed", "reply": f"hi ({len(text)})", "event": "1-0"})

    return Starlette(routes=[Route("/turn/{sid}", turn, methods=["POST"])])


def scope(path: str, query: bytes) -> dict[str, Any]:
    headers = [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def timed(app: Any, path: str, query: bytes, n: int) -> float:
    """Microseconds a request, over `n` requests."""
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": BODY, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    began = time.perf_counter()
    for _ in range(n):
        sent.clear()
        await app(scope(path, query), receive, send)
        if sent[0]["status"] != 200:
            raise RuntimeError(f"{path}: {sent}")
    return (time.perf_counter() - began) / n * 1e6


async def measure(requests: int, rounds: int) -> dict[str, Any]:
    keel, bare = keel_app(), bare_app()
    ways = {"keel": (keel, f"/v1/sessions/{SID}/messages", b"wait=true"), "bare": (bare, f"/turn/{SID}", b"")}
    got: dict[str, list[float]] = {name: [] for name in ways}
    for app, path, query in ways.values():  # (warm-up)
        await timed(app, path, query, requests // 5)
    for _ in range(rounds):
        for name, (app, path, query) in ways.items():
            got[name].append(await timed(app, path, query, requests))
    keel_us, bare_us = statistics.median(got["keel"]), statistics.median(got["bare"])
    return {"keel_us": keel_us, "bare_us": bare_us, "added_us": keel_us - bare_us, "rounds": got}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=5000, help="requests a round (default 5000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds, alternating (default 5)")
    args = ap.parse_args()
    result = uvloop.run(measure(args.requests, args.rounds))
    print(
        f"keel {result['keel_us']:.1f} us a request, bare {result['bare_us']:.1f}: keel adds {result['added_us']:.1f}"
    )
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
