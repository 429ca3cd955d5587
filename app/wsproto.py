"""uvicorn's sans-I/O websocket protocol with two holes closed (issue 16):

- A message refused mid-way (over the size limit, however fragmented, or malformed) is closed
  with its code (1009, 1002, ...) and then a half-close, reading and discarding what the client
  still has in flight until it closes (at most `LINGER_S`). uvicorn closed the socket at once:
  the client's unread data made the kernel answer with a reset, and the client never saw 1009.
- A handshake the parser refuses (a request line or a header over 8 KB, too many headers,
  not HTTP) gets an HTTP answer in keel's error shape (414, 431, 400); it got none and hung.
"""

from __future__ import annotations

import json

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import HeaderLineTooLong, RequestLineTooLong, TooManyHeaders

LINGER_S = 5.0  # after a close for a bad message: how long the client's remaining bytes are read


def _refusal(exc: BaseException | None) -> tuple[int, str, str, str]:
    """(status, reason phrase, code, message) for a handshake the parser refused."""
    if isinstance(exc, RequestLineTooLong):
        return 414, "URI Too Long", "uri_too_long", "the request line is longer than 8192 bytes"
    if isinstance(exc, HeaderLineTooLong | TooManyHeaders):
        return (
            431,
            "Request Header Fields Too Large",
            "headers_too_large",
            "a header line is over 8192 bytes or there are over 128",
        )
    return 400, "Bad Request", "invalid_request", "not a valid HTTP request"


class KeelWebSocketProtocol(WebSocketsSansIOProtocol):
    """What `app.__main__.uvicorn_options` passes uvicorn as `ws`."""

    lingering = False

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            return  # the message was refused and closed: the rest of it is dropped unread
        if not self.handshake_initiated:
            self.conn.receive_data(data)
            if self.conn.handshake_exc is not None:
                self._refuse_handshake()
                return
            self.handle_events()
            return
        super().data_received(data)

    def handle_parser_exception(self) -> None:
        close = self.conn.close_sent
        code, reason = (close.code, close.reason) if close is not None else (1002, "protocol error")
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the close frame, then FIN: the client reads both
        self.close_timer = self.loop.call_later(LINGER_S, self.transport.abort)

    def _refuse_handshake(self) -> None:
        status, phrase, code, message = _refusal(self.conn.handshake_exc)
        self.conn.data_to_send()  # (websockets' own plain-text answer, replaced by keel's)
        body = json.dumps({"error": {"code": code, "message": message}}).encode()
        head = (
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.handshake_complete = self.close_sent = self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.close_timer = self.loop.call_later(LINGER_S, self.transport.abort)
