"""wsinfer.clients: Python client for the wsinfer WebSocket protocol.

This folder (``clients/``) installs as ``wsinfer.clients`` (pyproject's
``package-dir``): import it as ``from wsinfer.clients import connect`` (or
``wsinfer.connect``), never as ``clients``.

``connect`` (asyncio) is the main entry point; ``wsinfer.clients.sync`` wraps
it for code without an event loop, and ``wsinfer.clients.chat`` is the
``wsinfer chat`` terminal UI. The browser client lives in ``browser/``.
"""

from __future__ import annotations

from wsinfer.clients.client import Client, ReconnectPolicy, connect
from wsinfer.clients.errors import (
    BadRequest,
    ClientClosed,
    Conflict,
    ConnectionLost,
    EngineUnavailable,
    InternalError,
    NotFound,
    Overloaded,
    RequestError,
    ServerError,
    TooLarge,
    Unauthorized,
    WsinferError,
)
from wsinfer.clients.turn import Conversation, Turn
from wsinfer.contract import Usage

__all__ = [
    "BadRequest",
    "Client",
    "ClientClosed",
    "Conflict",
    "ConnectionLost",
    "Conversation",
    "EngineUnavailable",
    "InternalError",
    "NotFound",
    "Overloaded",
    "ReconnectPolicy",
    "RequestError",
    "ServerError",
    "TooLarge",
    "Turn",
    "Unauthorized",
    "Usage",
    "WsinferError",
    "connect",
]
