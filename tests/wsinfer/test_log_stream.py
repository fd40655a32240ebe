"""A log line never fails the work that writes it, whoever stopped reading."""

from __future__ import annotations

import logging
import os
import sys

import pytest
import structlog

from wsinfer.logs import SafeStream, configure_logging


def test_writes_to_a_pipe_nobody_reads_are_dropped_not_raised() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone (a terminal closed, `| tee` stopped)
    stream = SafeStream(os.fdopen(write, "w", buffering=1))
    assert stream.write("a line\n") == len("a line\n")
    assert stream.gone
    assert stream.write("another\n") == len("another\n")
    stream.flush()
    assert not stream.isatty()


def test_a_closed_file_is_gone_too() -> None:
    read, write = os.pipe()
    inner = os.fdopen(write, "w")
    inner.close()
    stream = SafeStream(inner)
    stream.write("x")
    stream.flush()
    assert stream.gone
    os.close(read)


def test_structlog_and_logging_lines_into_a_broken_pipe_raise_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    read, write = os.pipe()
    os.close(read)
    monkeypatch.setattr(sys, "stderr", os.fdopen(write, "w", buffering=1))
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure_logging("json", "info")
        assert isinstance(sys.stderr, SafeStream)
        structlog.get_logger("wsinfer.test").info("into nothing", n=1)
        logging.getLogger("wsinfer.stdlib").warning("into nothing either")
        assert sys.stderr.gone
        configure_logging("json", "info")
        assert not isinstance(sys.stderr.stream, SafeStream)  # wrapped once, not twice
    finally:  # the next tests log as they did
        structlog.reset_defaults()
        root.handlers[:], root.level = handlers, level
        logging.captureWarnings(False)
