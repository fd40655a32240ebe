"""Errors and their protocol codes: the one place where exceptions become codes.

Two families, as in h11: ``ClientError`` (the request was wrong; the client
should change it) and ``ServerError`` (we could not serve a valid request).
"""

from __future__ import annotations

from wsinfer.sessions.connection import is_outage
from wsinfer.sessions.schema import ParamsError
from wsinfer.sessions.states import IllegalTransition
from wsinfer.sessions.store import ModeMismatch, SessionNotFound


class WsinferError(Exception):
    code = "internal"

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class ClientError(WsinferError):
    """The client's request is at fault."""


class BadRequest(ClientError):
    code = "bad_request"


class Unauthorized(ClientError):
    code = "unauthorized"


class NotFound(ClientError):
    code = "not_found"


class Conflict(ClientError):
    code = "conflict"


class TooLarge(ClientError):
    code = "too_large"


class Overloaded(ClientError):
    code = "overloaded"


class ServerError(WsinferError):
    """We failed to serve a valid request."""


class EngineUnavailable(ServerError):
    code = "engine_unavailable"


class InternalError(ServerError):
    code = "internal"


def to_protocol_error(exc: BaseException) -> WsinferError:
    """Map any exception raised while serving a request to a protocol error."""
    if isinstance(exc, WsinferError):
        return exc
    if isinstance(exc, SessionNotFound):
        return NotFound("no such session (or wrong token)")
    if isinstance(exc, IllegalTransition):
        return Conflict(str(exc))
    if isinstance(exc, (ModeMismatch, ParamsError)):
        return BadRequest(str(exc))
    if is_outage(exc):
        return StoreUnavailable("the session store is unreachable; try again", retry_after=1.0)
    return InternalError("internal error")


class StoreUnavailable(EngineUnavailable):
    """Redis is down or restarting: nothing can be served until it is back."""
