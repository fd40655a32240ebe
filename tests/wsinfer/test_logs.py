"""What an operator reads: JSON logs that stay JSON, one end line per turn, level names
checked, and start-up failures as one clear line with a non-zero exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.models import tiny_model_dir
from tests.stack import Client, Logged, port_from_banner, wait_for_engine

TURN_END_FIELDS = {"session", "turn", "tokens", "duration_s", "ttft_s", "finish_reason"}


def wsinfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wsinfer", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # nothing listens there once closed


# --- level names -------------------------------------------------------------------


@pytest.mark.parametrize("command", ["frontend", "engine", "serve"])
def test_an_unknown_log_level_is_refused_with_the_valid_names(command: str) -> None:
    result = wsinfer(command, "--log-level", "verbose")
    assert result.returncode == 2
    assert "unknown log level 'verbose'" in result.stderr
    assert "debug, info, warning, error, critical" in result.stderr
    assert "Traceback" not in result.stderr


def test_level_names_are_case_insensitive_and_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from wsinfer.cli import build_parser

    assert build_parser().parse_args(["frontend", "--log-level", "WARNING"]).log_level == "warning"
    monkeypatch.setenv("WSINFER_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["frontend"])


# --- start-up failures ----------------------------------------------------------------


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_a_busy_port_is_one_line_and_exit_1(
    busy_port: int, redis_url: str, log_format: str
) -> None:
    result = wsinfer(
        "frontend", "--port", str(busy_port), "--redis-url", redis_url, "--log-format", log_format
    )
    assert result.returncode == 1
    line = one_line(result)
    assert f"cannot listen on 127.0.0.1:{busy_port}" in line and "in use" in line
    if log_format == "json":
        assert json.loads(line)["level"] == "error"


def test_serve_on_a_busy_port_fails_before_starting_an_engine(
    busy_port: int, tmp_path: Path
) -> None:
    result = wsinfer(
        "serve", "--port", str(busy_port), "--model", "fake:10", "--log-level", "warning",
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{busy_port}" in one_line(result)


@pytest.mark.parametrize("command", ["frontend", "engine"])
def test_an_unreachable_redis_is_one_line_and_exit_1(command: str, closed_port: int) -> None:
    url = f"redis://user:secret@127.0.0.1:{closed_port}/0"
    # No --model: the engine must fail before it loads anything.
    result = wsinfer(
        command, "--redis-url", url, *(["--port", "0"] if command == "frontend" else [])
    )
    assert result.returncode == 1
    line = one_line(result)
    assert f"cannot reach Redis at redis://user:***@127.0.0.1:{closed_port}/0" in line
    assert "secret" not in line


def test_a_busy_engine_metrics_port_is_one_line_and_exit_1(busy_port: int, redis_url: str) -> None:
    result = wsinfer(
        "engine", "--redis-url", redis_url, "--model", "fake:10", "--metrics-port", str(busy_port),
        "--log-level", "warning",
    )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{busy_port} for metrics" in one_line(result)


def test_a_bad_fake_spec_is_refused_by_the_parser() -> None:
    result = wsinfer("engine", "--model", "fake:quick")
    assert result.returncode == 2 and "fake:TOKENS_PER_S" in result.stderr


# --- JSON everywhere ---------------------------------------------------------------------


def test_stdlib_logging_warnings_and_crashes_come_out_as_json() -> None:
    code = (
        "import logging, warnings\n"
        "from wsinfer.logs import configure_logging\n"
        "configure_logging('json', 'info')\n"
        "logging.getLogger('websockets.server').error('handshake failed')\n"
        "warnings.warn('old API')\n"
        "raise RuntimeError('boom')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    records = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    assert [r["event"] for r in records][0] == "handshake failed"
    assert records[0]["logger"] == "websockets.server" and records[0]["level"] == "error"
    assert "old API" in records[1]["event"] and records[1]["level"] == "warning"
    assert records[2]["event"] == "uncaught exception" and "boom" in records[2]["exception"]
    assert result.returncode != 0


async def test_with_json_logs_every_line_is_json_and_a_turn_ends_in_one_line(
    tmp_path: Path, redis_url: str
) -> None:
    # The real transformers model: its loading messages and progress bars must not leak.
    common = ("--redis-url", redis_url, "--log-format", "json")
    engine = Logged.spawn(
        tmp_path, "engine", "engine", "--model", str(tiny_model_dir()), "--engine-id", "e1", *common
    )
    frontend = Logged.spawn(tmp_path, "frontend", "frontend", "--port", "0", *common)
    try:
        wait_for_engine(redis_url, "e1", engine.process)
        frontend.wait_for("frontend listening")
        port = port_from_banner(frontend.stdout.read_text(), "frontend")
        client = await Client.open(port)
        session: dict[str, str] = {}
        for _ in range(2):  # a second turn of the same session is not a takeover
            await client.send(type="generate", prompt="Hi", params={"max_new_tokens": 6}, **session)
            messages = await client.until("done")
            session = {"session": messages[0]["session"], "token": messages[0]["token"]}
        await client.send(type="nonsense")
        assert (await client.recv())["type"] == "error"
        await client.close()
        engine.wait_for("turn finished", turn=2)
    finally:
        frontend.stop()  # (SIGTERM ends a frontend without a word)
        assert engine.stop() == 0
    records = engine.records() + frontend.records()  # raises on any line that is not JSON
    ends = [r for r in records if r["event"] == "turn finished"]
    assert [r["turn"] for r in ends] == [1, 2]
    assert all(r.keys() >= TURN_END_FIELDS and r["tokens"] == 6 for r in ends)
    assert all(r["finish_reason"] == "length" and r["ttft_s"] > 0 for r in ends)
    assert not any("takeover" in r for r in records)
    assert any(r["event"] == "model loaded" for r in records)
