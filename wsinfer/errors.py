"""Protocol errors: each class carries its one ``ErrorCode``.

Two families, as in h11: ``ClientError`` (the request was wrong; the client
should change it) and ``ServerError`` (we could not serve a valid request).
Which family a code belongs to is ``contract.ERROR_CLASSES``'s to say: a class
put in the other one fails when it is defined.
Pure: no Redis, no I/O, so the sans-I/O protocol can raise and test them. The
I/O layer (``handlers.to_protocol_error``) turns the store's own exceptions
and outages into these.
"""

from __future__ import annotations

from typing import Any

from wsinfer.contract import ERROR_CLASSES, ErrorCode, ErrorFault, check_error_family


class WsinferError(Exception):
    code = ErrorCode.INTERNAL
    fault: ErrorFault | None = None  # each family sets its own

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.fault is not None and "code" in vars(cls):  # a code class, in its family
            check_error_family(cls.__name__, cls.code, cls.fault)

    @property
    def retryable(self) -> bool:
        """Whether the same request, sent again later, may succeed."""
        return ERROR_CLASSES[self.code].retryable


class ClientError(WsinferError):
    """The client's request is at fault."""

    fault = ErrorFault.REQUEST


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


class ServerError(WsinferError):
    """We failed to serve a valid request."""

    fault = ErrorFault.SERVICE


class Overloaded(ServerError):
    code = ErrorCode.OVERLOADED


class EngineUnavailable(ServerError):
    code = ErrorCode.ENGINE_UNAVAILABLE


class InternalError(ServerError):
    code = ErrorCode.INTERNAL


class StoreUnavailable(EngineUnavailable):
    """Redis is down or restarting: nothing can be served until it is back."""
