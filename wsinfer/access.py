"""Who may use this server: API keys, Host names, browser origins and CORS.

Both doors (the ``/v1/ws`` handshake and the HTTP routes) ask the same
``Access`` with the request's headers and target, and get either nothing (go
on) or ``Denied`` (a status, a code and a message for the client). Pure: no
I/O, so every rule is testable without a socket.

Without an API key, ``Origin`` and ``Host`` are the only guards against a web
page driving a local server: the Origin check stops other sites' pages, the
Host check stops DNS rebinding (a page whose own name was re-pointed at this
server sends its own name as Host, and that is not one of ours).
"""

from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterable
from urllib.parse import parse_qs, urlsplit

from websockets.datastructures import Headers, MultipleValuesError

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
# What a browser page on an allowed origin may send and read (CORS).
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_REQUEST_HEADERS = (
    "Authorization, Content-Type, Last-Event-ID, X-Wsinfer-Session, X-Wsinfer-Token"
)
CORS_EXPOSED_HEADERS = (
    "Retry-After, X-Wsinfer-Session, X-Wsinfer-Token, X-Wsinfer-Turn, X-Wsinfer-Ignored-Fields"
)
CORS_MAX_AGE_S = 600


class Denied(Exception):
    """A request refused before any route runs it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def one_header(headers: Headers, name: str) -> str | None:
    """The value of a header that may appear at most once (a repeat is ambiguous:
    a proxy and the server could each read another one)."""
    try:
        return headers.get(name)
    except MultipleValuesError:
        raise Denied(400, f"the {name} header appears more than once", "bad_request") from None


def shorten(text: str, limit: int = 100) -> str:
    """Client input quoted in a log line or an error: short, and encodable (a lone
    surrogate, which no UTF-8 writer takes, is shown as its escape)."""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def is_public(path: str) -> bool:
    """Routes anyone who can reach the server may read: no key asked."""
    return path in ("/", "/healthz", "/metrics") or path.startswith("/static/")


def request_path(target: str) -> str:
    """The path of a request target (``Denied`` for one that is not a URL)."""
    try:
        return urlsplit(target).path
    except ValueError:  # say, "//[": an unclosed IPv6 literal
        raise Denied(400, "the request target is not a valid URL", "bad_request") from None


def query_value(target: str, name: str) -> str | None:
    """One query parameter of a request target (the first, if repeated)."""
    try:
        values = parse_qs(urlsplit(target).query).get(name)
    except ValueError:
        raise Denied(400, "the request target is not a valid URL", "bad_request") from None
    return values[0] if values else None


class Access:
    def __init__(
        self,
        api_keys: Iterable[str],
        allowed_origins: Iterable[str],
        allowed_hosts: Iterable[str],
        bind_host: str,
    ) -> None:
        self.keys = [k.encode() for k in api_keys]
        self.origins = frozenset(allowed_origins)
        self.hosts = frozenset(h.lower().rstrip(".") for h in [*allowed_hosts, bind_host])

    def check(self, headers: Headers, target: str, *, needs_key: bool) -> None:
        """Host (without keys), then Origin, then the key (where ``needs_key``)."""
        if not self.keys and not self.host_allowed(one_header(headers, "Host")):
            raise Denied(403, "host not allowed (see --allowed-host)", "forbidden")
        self.check_origin(headers)
        if needs_key and not self.authorized(headers, target):
            raise Denied(401, "bad or missing API key", "invalid_api_key")

    def check_origin(self, headers: Headers) -> None:
        origin = one_header(headers, "Origin")
        if not origin_allowed(origin, one_header(headers, "Host"), self.origins):
            raise Denied(403, "origin not allowed (see --allowed-origin)", "forbidden")

    def authorized(self, headers: Headers, target: str) -> bool:
        """``Authorization: Bearer KEY`` (the scheme in any case), or ``?token=KEY``."""
        if not self.keys:
            return True
        scheme, _, credentials = (one_header(headers, "Authorization") or "").partition(" ")
        offered = credentials.strip() if scheme.lower() == "bearer" else ""
        if not offered:
            offered = query_value(target, "token") or ""
        # Bytes: compare_digest refuses non-ASCII str, and a key is whatever was sent.
        raw = offered.encode("utf-8", "surrogatepass")
        return any(secrets.compare_digest(raw, key) for key in self.keys)

    def host_allowed(self, host: str | None) -> bool:
        """One of this server's own names: an IP literal (no DNS, so nothing to
        rebind), a localhost form, the bind address, or an ``--allowed-host``."""
        if host is None or "*" in self.hosts:
            return True  # HTTP/1.0 without Host: not a browser
        name = _hostname(host)
        if name is None:
            return False
        if name == "localhost" or name.endswith(".localhost") or name in self.hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    def cors(self, headers: Headers) -> list[tuple[str, str]]:
        """The CORS headers for a response to an allowed page of another origin."""
        origin = one_header(headers, "Origin")
        if origin is None or not origin_allowed(origin, None, self.origins):
            return []
        return [
            ("Access-Control-Allow-Origin", origin),
            ("Access-Control-Expose-Headers", CORS_EXPOSED_HEADERS),
            ("Vary", "Origin"),
        ]

    @staticmethod
    def preflight() -> list[tuple[str, str]]:
        """What a CORS preflight's answer adds to ``cors`` (its Origin was checked)."""
        return [
            ("Access-Control-Allow-Methods", CORS_METHODS),
            ("Access-Control-Allow-Headers", CORS_REQUEST_HEADERS),
            ("Access-Control-Max-Age", str(CORS_MAX_AGE_S)),
        ]


def _hostname(host: str) -> str | None:
    """The name in a Host header (no port, lower case, no trailing dot); None if malformed."""
    try:
        name = urlsplit(f"//{host.strip()}").hostname
    except ValueError:
        return None
    return name.rstrip(".") if name else None


def origin_allowed(origin: str | None, host: str | None, allowed: frozenset[str]) -> bool:
    """May a page from ``origin`` use this server?

    Browsers send ``Origin`` on every WebSocket handshake and cross-origin
    request and let any page connect anywhere, so without this check (and with
    no API key) any web page could drive a local server. Allowed: no Origin
    (not a browser), the server's own origin (its chat page), localhost pages,
    and ``allowed`` (``*``: every origin).
    """
    if origin is None:
        return True
    if "*" in allowed or origin in allowed:
        return True
    try:
        parts = urlsplit(origin)
        hostname = parts.hostname
    except ValueError:
        return False
    if parts.scheme not in ("http", "https"):
        return False  # "null" (sandboxed or file pages) and the like
    if hostname in LOCAL_HOSTS:
        return True
    return host is not None and parts.netloc.lower() == host.strip().lower()
