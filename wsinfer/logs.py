"""structlog setup shared by every wsinfer process.

With ``--log-format json`` every line a process writes is one JSON object:
structlog's own events, the standard library's ``logging`` (websockets,
asyncio, redis), ``warnings``, transformers' messages (``route_library_logs``)
and an uncaught exception's traceback all go through the same renderer.
Progress bars are shown only on a terminal.

A log line never fails the work that writes it. An engine outlives a ``wsinfer
serve`` stopped with Ctrl-C, to finish the turns it runs, and the reader of its
stderr may be gone by then (a closed terminal, ``| tee`` stopped by the same
Ctrl-C): a line written then raised BrokenPipeError inside the engine's step,
and the turns it was running failed. Past the first failed write the lines go
nowhere: there is no one left to read them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone
from types import TracebackType
from typing import Any, TextIO, cast

import structlog

LEVELS = ("debug", "info", "warning", "error", "critical")
_CONFIGURED = {"format": "console"}


def parse_level(text: str) -> str:
    """A log level name (any case); ValueError naming the valid ones otherwise."""
    level = text.strip().lower()
    if level not in LEVELS:
        raise ValueError(f"unknown log level {text!r}: use one of {', '.join(LEVELS)}")
    return level


def _renderer(log_format: str) -> Any:
    if log_format == "json":
        return structlog.processors.JSONRenderer()
    return structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())


class SafeStream:
    """A text stream whose writes never raise: once one fails (its reader gone, the
    file closed), the rest are dropped."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except (OSError, ValueError):  # EPIPE, EIO; ValueError: closed
                self.gone = True
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self.gone = True

    def isatty(self) -> bool:
        try:
            return not self.gone and self.stream.isatty()
        except (OSError, ValueError):
            return False

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, ...: the stream's
        return getattr(self.stream, name)


def configure_logging(log_format: str = "console", level: str = "info") -> None:
    """JSON lines for machines, aligned key=value for people; both on stderr."""
    if not isinstance(sys.stderr, SafeStream):  # Python's own writes too (warnings)
        sys.stderr = cast(TextIO, SafeStream(sys.stderr))
    numeric = logging.getLevelNamesMapping()[parse_level(level).upper()]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = _renderer(log_format)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, sys.stderr)),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(log_format, shared, renderer, numeric)
    _CONFIGURED["format"] = log_format
    if log_format == "json":
        sys.excepthook = _log_uncaught


def _route_stdlib(log_format: str, shared: list[Any], renderer: Any, level: int) -> None:
    """Standard-library records and warnings through the same renderer."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries are chatty at INFO; their warnings and errors are what matter
    # (all of it at --log-level debug).
    root.setLevel(logging.DEBUG if level <= logging.DEBUG else max(level, logging.WARNING))
    logging.captureWarnings(True)


def route_library_logs() -> None:
    """transformers logs through its own handler and draws progress bars: stop both."""
    if not sys.stderr.isatty():
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the frontend-only install has no transformers
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    if not sys.stderr.isatty():
        hf_logging.disable_progress_bar()


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    structlog.get_logger("wsinfer").critical("uncaught exception", exc_info=(kind, exc, tb))


def announce(message: str, **fields: Any) -> None:
    """A line for whoever started the process (on stdout): the address it serves.

    Plain text on a console, one JSON object (``event`` = the message) with JSON logs.
    """
    if _CONFIGURED["format"] == "json":
        stamp = datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
        record = {"event": message, **fields, "level": "info", "timestamp": stamp}
        print(json.dumps(record), flush=True)
    else:
        print(message, flush=True)
