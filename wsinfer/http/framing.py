"""What a request head must keep before anything acts on it, sans I/O.

h11 refuses a head still arriving once it is over 16 KiB, but parses a
complete one of any size: a 100 KB URL or 10,000 headers sent in one read
would pass. The same limits are checked here on the parsed head, so they hold
however the bytes were split. A request framed two ways (Content-Length and
chunked) is refused: a proxy in front may read it the other way (request
smuggling, RFC 9112 section 6.1).
"""

from __future__ import annotations

import h11

# h11's limit on an incomplete head (DEFAULT_MAX_INCOMPLETE_EVENT_SIZE): the same here.
MAX_HEAD_BYTES = 16 * 1024
MAX_TARGET_BYTES = 8 * 1024  # websockets' longest request line
MAX_HEADERS = 100


class Refusal(Exception):
    """A request the HTTP layer answers itself (raised: the connection closes after it)."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after


def check_head(event: h11.Request) -> None:
    """Raise ``Refusal`` for a head over the limits or with two framings."""
    size = len(event.method) + len(event.target) + 12
    size += sum(len(name) + len(value) + 4 for name, value in event.headers)
    if size > MAX_HEAD_BYTES:
        raise Refusal(431, f"the request head is over {MAX_HEAD_BYTES} bytes")
    if len(event.headers) > MAX_HEADERS:
        raise Refusal(431, f"the request has over {MAX_HEADERS} header fields")
    if len(event.target) > MAX_TARGET_BYTES:
        raise Refusal(414, f"the URL is over {MAX_TARGET_BYTES} bytes")
    names = {name for name, _ in event.headers}
    if b"transfer-encoding" in names and b"content-length" in names:
        raise Refusal(400, "a request may not have both Content-Length and Transfer-Encoding")
