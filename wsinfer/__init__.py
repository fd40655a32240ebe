"""wsinfer: WebSocket-first streaming LLM inference with resumable sessions.

This folder holds the frontend and the CLI; pyproject's ``package-dir`` also
installs the top-level ``engine/``, ``sessions/`` and ``clients/`` folders
under this package (``wsinfer.engine``, ``wsinfer.sessions``,
``wsinfer.clients``), so generic names never land in a user's environment.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["__version__", "connect"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import wsinfer` in the engine or frontend does not pull in
    # the client (and vice versa).
    if name == "connect":
        from wsinfer.clients.client import connect

        return connect
    raise AttributeError(name)
