"""Protocol errors: each class carries its one ``ErrorCode``.

Two families, as in h11: ``ClientError`` (the request was wrong; the client
should change it) and ``ServerError`` (we could not serve a valid request).
Pure: no Redis, no I/O, so the sans-I/O protocol can raise and test them. The
I/O layer (``handlers.to_protocol_error``) turns the store's own exceptions
and outages into these.
"""

from __future__ import annotations

from wsinfer.contract import ErrorCode


class WsinferError(Exception):
    code = ErrorCode.INTERNAL

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class ClientError(WsinferError):
    """The client's request is at fault."""


class BadRequest(ClientError):
    code = ErrorCode.BAD_REQUEST


class Unauthorized(ClientError):
    code = ErrorCode.UNAUTHORIZED


class NotFound(ClientError):
    code = ErrorCode.NOT_FOUND


class Conflict(ClientError):
    code = ErrorCode.CONFLICT


class TooLarge(ClientError):
    code = ErrorCode.TOO_LARGE


class Overloaded(ClientError):
    code = ErrorCode.OVERLOADED


class ServerError(WsinferError):
    """We failed to serve a valid request."""


class EngineUnavailable(ServerError):
    code = ErrorCode.ENGINE_UNAVAILABLE


class InternalError(ServerError):
    code = ErrorCode.INTERNAL


class StoreUnavailable(EngineUnavailable):
    """Redis is down or restarting: nothing can be served until it is back."""
