"""Event envelopes: how an event is stored in a session's outbox stream and how it reaches a
client. Stored as fields `s` (seq), `t` (type) and `b` (the envelope's JSON after `session_id`:
`"turn_id":...,"at":...,"data":...}`); a reader puts `id`, `seq`, `type` and `session_id` in
front, so every delivery of an event, read back or handed over by the process that wrote it, is
the same bytes."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

_enc = msgspec.json.Encoder()
_data_dec = msgspec.json.Decoder(dict[str, Any])


def event_body(turn_id: str | None, data: dict[str, Any], at: float | None = None) -> bytes:
    """The stored tail of an envelope: `"turn_id":...,"at":...,"data":...}`."""
    at = time.time() if at is None else at
    tid = b"null" if turn_id is None else _enc.encode(turn_id)
    return b'"turn_id":' + tid + b',"at":' + _enc.encode(round(at, 6)) + b',"data":' + _enc.encode(data) + b"}"


class StoredEvent(NamedTuple):
    """A committed event: in the session's outbox stream under `id`, replayed on resume."""

    id: str
    type: str
    raw: bytes  # the envelope as JSON, byte-identical on every delivery
    seq: int  # the per-session counter: consecutive, so a gap shows


class LiveEvent(NamedTuple):
    """A transient event (`message.delta`): handed to the readers connected now, in every
    process, never stored or replayed; it has no id and no seq. `item_id`: the item it is part of."""

    type: str
    raw: bytes
    item_id: str


def delta(sid: str, turn_id: str, item_id: str, text: str, offset: int) -> LiveEvent:
    """A piece of a reply's text: `offset` is where it starts in the item's text (characters)."""
    body = event_body(turn_id, {"item_id": item_id, "delta": text, "offset": offset})
    return LiveEvent(
        "message.delta", b'{"type":"message.delta","session_id":' + _enc.encode(sid) + b"," + body, item_id
    )


def session_deleted(sid: str, reason: str) -> LiveEvent:
    """The last thing a reader of a session gets when the session ends: `reason` "deleted" (a
    DELETE, told to every process) or "gone" (the reader found it no longer there: deleted while
    the notice was lost, or expired). Transient, as a delta: never stored, no id."""
    body = event_body(None, {"reason": reason})
    return LiveEvent("session.deleted", b'{"type":"session.deleted","session_id":' + _enc.encode(sid) + b"," + body, "")


class _Part(msgspec.Struct):
    item_id: str = ""


class _Live(msgspec.Struct):
    type: str
    data: _Part


_live_dec = msgspec.json.Decoder(_Live)


def live_event(raw: bytes) -> LiveEvent:
    """A live event as another process sent it (its envelope, as `delta` made it)."""
    head = _live_dec.decode(raw)
    return LiveEvent(head.type, raw, head.data.item_id)


def completed_item(event: StoredEvent) -> str | None:
    """The item a message.completed event completes (None for any other event)."""
    if event.type != "message.completed":
        return None
    return _live_dec.decode(event.raw).data.item_id


def envelope(sid: str, eid: bytes, fields: dict[bytes, bytes]) -> StoredEvent:
    """An event as read back from the outbox stream."""
    return made(sid, eid.decode(), int(fields[b"s"]), fields[b"t"].decode(), fields[b"b"])


def made(sid: str, eid: str, seq: int, etype: str, body: bytes) -> StoredEvent:
    """An event as its commit wrote it: the same bytes a read of the outbox gives."""
    head = b'{"id":"%s","seq":%d,"type":"%s","session_id":' % (eid.encode(), seq, etype.encode())
    raw = head + _enc.encode(sid) + b"," + body
    return StoredEvent(eid, etype, raw, seq)


def written(sid: str, ids: Sequence[str], first_seq: int, events: Sequence[tuple[str, bytes]]) -> list[StoredEvent]:
    """The events a script emitted, in order (their seqs are consecutive from `first_seq`)."""
    return [
        made(sid, eid, first_seq + n, etype, body)
        for n, (eid, (etype, body)) in enumerate(zip(ids, events, strict=True))
    ]


def decode_data(raw: bytes) -> dict[str, Any]:
    return _data_dec.decode(raw)
