"""Client exceptions, and the one place that maps protocol error codes to them.

Two families, as in h11: ``RequestError`` means the request itself was wrong
(fix the call, retrying will not help), ``ServerError`` means the service could
not do it right now (retrying later may): which family a code belongs to, and
whether it is ``retryable``, is ``contract.ERROR_CLASSES``'s to say (a class put
in the other family fails when it is defined). ``ConnectionLost`` is the client's
own: the connection dropped and could not be restored in time; it and
``ClientClosed`` carry the client-local codes of ``wsinfer.contract.ClientErrorCode``,
which the browser client uses for the same situations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from wsinfer.contract import (
    ClientErrorCode,
    ErrorCode,
    ErrorFault,
    check_error_family,
    error_class,
)


class WsinferError(Exception):
    """Base of every error the client raises; ``code`` is the protocol code."""

    code = "error"
    family: ErrorFault | None = None  # RequestError's and ServerError's

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.family is not None:
            check_error_family(cls.__name__, cls.code, cls.family)

    @property
    def fault(self) -> ErrorFault | None:
        """The request's or the service's, for a code the server sends (else None)."""
        kind = error_class(self.code)
        return kind.fault if kind else None

    @property
    def retryable(self) -> bool:
        """Whether the same request, sent again later, may succeed."""
        kind = error_class(self.code)
        return kind.retryable if kind else False

    def __init__(
        self,
        message: str = "",
        *,
        code: str | None = None,
        retry_after: float | None = None,
        session: str | None = None,
    ) -> None:
        super().__init__(message or self.code)
        self.message = message
        if code is not None:
            self.code = code
        self.retry_after = retry_after
        self.session = session

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" if self.message else self.code


class RequestError(WsinferError):
    """The server refused the request as given; retrying it unchanged will not help."""

    family = ErrorFault.REQUEST


class BadRequest(RequestError):
    code = ErrorCode.BAD_REQUEST.value


class Unauthorized(RequestError):
    code = ErrorCode.UNAUTHORIZED.value


class NotFound(RequestError):
    code = ErrorCode.NOT_FOUND.value


class Conflict(RequestError):
    code = ErrorCode.CONFLICT.value


class TooLarge(RequestError):
    code = ErrorCode.TOO_LARGE.value


class ServerError(WsinferError):
    """The service could not serve the request now; ``retry_after`` hints when to retry."""

    family = ErrorFault.SERVICE


class Overloaded(ServerError):
    code = ErrorCode.OVERLOADED.value


class EngineUnavailable(ServerError):
    code = ErrorCode.ENGINE_UNAVAILABLE.value


class InternalError(ServerError):
    code = ErrorCode.INTERNAL.value


class ConnectionLost(WsinferError):
    """The connection dropped and reconnecting failed (or was disabled)."""

    code = ClientErrorCode.CONNECTION_LOST.value

    @property
    def retryable(self) -> bool:
        return True  # the turn may still run: resume it once the server answers


class ClientClosed(WsinferError):
    """The client was closed while the call was waiting."""

    code = ClientErrorCode.CLIENT_CLOSED.value


_BY_CODE: dict[str, type[WsinferError]] = {
    cls.code: cls
    for cls in (
        BadRequest,
        Unauthorized,
        NotFound,
        Conflict,
        TooLarge,
        Overloaded,
        EngineUnavailable,
        InternalError,
    )
}


def error_from_wire(fields: Mapping[str, Any], session: str | None = None) -> WsinferError:
    """Build the exception for an ``error`` message or a ``done.error`` map.

    Unknown codes still raise (as the base class) so that a newer server's
    codes are never silently dropped.
    """
    code = str(fields.get("code") or ErrorCode.INTERNAL.value)
    message = str(fields.get("message") or "")
    retry_after = fields.get("retry_after")
    if not isinstance(retry_after, (int, float)) or isinstance(retry_after, bool):
        retry_after = None
    cls = _BY_CODE.get(code, WsinferError)
    return cls(
        message,
        code=code,
        retry_after=retry_after,
        session=fields.get("session") or session,
    )
