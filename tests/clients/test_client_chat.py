"""`wsinfer chat` driven through pipes, against the stand-in server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time
from typing import Any

import pytest

from wsinfer.clients import chat

pytestmark = pytest.mark.timeout(60)


def words(n: int) -> str:
    return "".join(f"w{i} " for i in range(1, n + 1))


def args_for(url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    chat.add_arguments(parser)
    return parser.parse_args(["--url", url, *extra])


async def run_chat(url: str, script: str, *extra: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await chat._run(args_for(url, *extra), io.StringIO(script), out, err)
    return code, out.getvalue(), err.getvalue()


async def test_multi_turn_chat_through_a_pipe(fake_server: Any) -> None:
    code, out, err = await run_chat(
        fake_server.url, "hello\n\nagain\n/quit\nnot sent\n", "--max-new-tokens", "3"
    )
    assert code == 0
    assert out == f"{words(3)}\n{words(3)}\n"
    generates = [m for m in fake_server.received if m["type"] == "generate"]
    assert len(generates) == 2
    assert generates[1]["session"] == generates[0].get("session", generates[1]["session"])
    assert generates[0]["params"] == {"max_new_tokens": 3}


async def test_params_and_system_prompt(fake_server: Any) -> None:
    script = "hi\n"
    extra = ("--temperature", "0", "--system", "sys", "--codec", "json")
    await run_chat(fake_server.url, script, *extra)
    (generate,) = [m for m in fake_server.received if m["type"] == "generate"]
    assert generate["params"] == {"temperature": 0.0}
    assert generate["messages"][0] == {"role": "system", "content": "sys"}
    assert fake_server.subprotocols_seen == ["wsinfer.v1.json"]


async def test_pause_resume_and_stop_commands(fake_server: Any) -> None:
    fake_server.delay = 0.01
    script = "one\n/pause\n/resume\ntwo\n/stop\n"
    code, out, err = await run_chat(fake_server.url, script, "--max-new-tokens", "40")
    assert code == 0
    first, second, _ = out.split("\n")
    assert first == words(40)  # paused and resumed: still whole, nothing twice
    assert second == words(len(second.split()))
    assert "paused at token" in err and "stopped" in err
    kinds = [m["type"] for m in fake_server.received]
    assert kinds.count("pause") == kinds.count("resume") == kinds.count("stop") == 1


async def test_new_session_and_unknown_command(fake_server: Any) -> None:
    script = "a\n/new\nb\n/bogus\n/pause\n"
    code, out, err = await run_chat(fake_server.url, script, "--max-new-tokens", "2")
    assert code == 0 and out == f"{words(2)}\n{words(2)}\n"
    generates = [m for m in fake_server.received if m["type"] == "generate"]
    assert all("session" not in g for g in generates)  # /new started a fresh session
    assert any(m["type"] == "close" for m in fake_server.received)
    assert "unknown command /bogus" in err and "no answer in progress" in err


async def test_errors_are_reported_and_the_chat_goes_on(fake_server: Any) -> None:
    fake_server.refuse_generate = {"code": "overloaded", "message": "queue full"}
    code, out, err = await run_chat(fake_server.url, "busy\nok\n", "--max-new-tokens", "1")
    assert code == 0 and out == f"{words(1)}\n"
    assert "overloaded" in err


async def test_unreachable_server_exits_1() -> None:
    code, _, err = await run_chat("ws://127.0.0.1:9/v1/ws", "hi\n")
    assert code == 1 and "cannot connect" in err


async def spawn_chat(url: str, *extra: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "wsinfer.clients.chat",
        "--url",
        url,
        *extra,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_subprocess_pipe(fake_server: Any) -> None:
    proc = await spawn_chat(fake_server.url, "--max-new-tokens", "4")
    out, err = await proc.communicate(b"hi\nthere\n")
    assert proc.returncode == 0, err
    assert out.decode() == f"{words(4)}\n{words(4)}\n"


async def test_ctrl_c_stops_the_answer_then_quits(fake_server: Any) -> None:
    fake_server.delay = 0.02
    proc = await spawn_chat(fake_server.url, "--max-new-tokens", "1000")
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(b"tell me everything\n")
    await proc.stdin.drain()
    await proc.stdout.readexactly(3)  # the answer is streaming
    proc.send_signal(signal.SIGINT)
    line = await proc.stderr.readline()
    assert b"stopping" in line
    assert b"stopped" in await proc.stderr.readline()
    assert any(m["type"] == "stop" for m in fake_server.received)
    proc.send_signal(signal.SIGINT)  # idle now: quits
    assert await asyncio.wait_for(proc.wait(), 10) == chat.EXIT_INTERRUPTED


# ---- on a terminal: a real pty, so readline, Ctrl-C and SIGWINCH are the real ones ----


class Tty:
    """``wsinfer chat`` as the child of a pseudo-terminal (its controlling tty)."""

    def __init__(self, url: str, history: str, *extra: str) -> None:
        env = {**os.environ, "WSINFER_CHAT_HISTORY": history, "TERM": "xterm"}
        argv = [sys.executable, "-m", "wsinfer.clients.chat", "--url", url, *extra]
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: become the chat
            os.execve(sys.executable, argv, env)
        self.resize(24, 100)
        self.seen = ""
        self.pos = 0

    def resize(self, rows: int, cols: int) -> None:
        # The kernel sends SIGWINCH to the terminal's foreground process.
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def _read(self, timeout: float) -> str:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return ""
        try:
            return os.read(self.fd, 65536).decode(errors="replace")
        except OSError:  # EIO: the child has exited
            return ""

    async def expect(self, pattern: str, timeout: float = 20) -> re.Match[str]:
        """Wait for `pattern` in the output after the previous match."""
        deadline = time.monotonic() + timeout
        while True:
            found = re.compile(pattern).search(self.seen, self.pos)
            if found:
                self.pos = found.end()
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in {self.seen[self.pos :]!r}")
            self.seen += await asyncio.to_thread(self._read, 0.2)

    async def exit_code(self, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            self.seen += await asyncio.to_thread(self._read, 0.1)
        raise AssertionError(f"chat did not exit: {self.seen[-500:]!r}")

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


async def interrupt(tty: Tty, then: str | None = None) -> int | None:
    """Ctrl-C, and wait for ``then`` (or the chat's exit). Pressed again if nothing
    shows within a second: about one run in five, a Ctrl-C sent the instant the
    prompt appears shows nothing until the next key (seen with and without
    bracketed paste; not pinned down), and a person presses again."""
    for attempt in range(2):
        tty.send("\x03")
        try:
            if then is None:
                return await tty.exit_code(timeout=1 if attempt == 0 else 30)
            await tty.expect(then, timeout=1 if attempt == 0 else 20)
            return None
        except AssertionError:
            if attempt == 1:
                raise
    return None


async def received(server: Any, kind: str, timeout: float = 10) -> None:
    """Wait until the server got a message of this type (some are not answered)."""
    deadline = time.monotonic() + timeout
    while not any(m["type"] == kind for m in server.received):
        assert time.monotonic() < deadline, f"no {kind} in {server.received}"
        await asyncio.sleep(0.02)


SPEED = r"(\d+) tokens · [\d.]+ tok/s · first token \d+ ms"
# readline turns bracketed paste on (ESC [?2004h) as it shows the prompt.
PROMPT = r"\n(?:\x1b\[\?2004h)?> "


@pytest.fixture
def tty_chat(tmp_path: Any) -> Any:
    ttys: list[Tty] = []

    def make(url: str, *extra: str) -> Tty:
        tty = Tty(url, str(tmp_path / "history"), *extra)
        ttys.append(tty)
        return tty

    yield make
    for tty in ttys:
        tty.close()


async def test_terminal_line_editing_history_and_speed(
    fake_server: Any, tty_chat: Any, tmp_path: Any
) -> None:
    tty = tty_chat(fake_server.url, "--max-new-tokens", "4")
    await tty.expect("Up/Down recall")
    await tty.expect("> ")
    tty.send("hello\r")
    await tty.expect(re.escape(words(4)))
    assert (await tty.expect(SPEED))[1] == "4"
    await tty.expect(PROMPT)  # the prompt comes back after an answer that ended by itself
    tty.send("\x1b[A\r")  # Up: the previous line again
    await tty.expect(re.escape(words(4)))
    await tty.expect(PROMPT)
    tty.send("helo\x1b[Dl\x1b[F!\r")  # Left, insert, End, append: "hello!"
    await tty.expect(SPEED)
    await tty.expect(PROMPT)
    generates = [m for m in fake_server.received if m["type"] == "generate"]
    sent = [g["messages"][-1]["content"] for g in generates]
    assert sent == ["hello", "hello", "hello!"]
    assert all(g["session"] == generates[1]["session"] for g in generates[1:])
    assert "[A" not in tty.seen
    tty.send("\x04")  # Ctrl-D at the prompt
    assert await tty.exit_code() == 0
    # The history outlives the run, for the next one's Up arrow (a line
    # recalled unchanged is not stored twice).
    history = (tmp_path / "history").read_text().split("\n")
    assert [h for h in history if h] == ["hello", "hello!"]


async def test_terminal_ctrl_c_and_resize_mid_answer(fake_server: Any, tty_chat: Any) -> None:
    fake_server.delay = 0.02
    tty = tty_chat(fake_server.url, "--max-new-tokens", "1000")
    await tty.expect("> ")
    tty.send("tell me everything\r")
    await tty.expect(r"w3 ")
    tty.resize(20, 40)  # mid-answer: the answer goes on
    await tty.expect(r"w30 ")
    tty.send("\x03")  # Ctrl-C: stops the answer, not the chat
    await tty.expect("stopping; Ctrl-C again to quit")
    speed = await tty.expect(r"\[([^\]\n]*)(\]|…)")
    assert len(speed[0]) <= 40 + len("\x1b[2m") and "tokens" in speed[1]
    await tty.expect(PROMPT)
    await received(fake_server, "stop")
    turn = fake_server.sessions[next(iter(fake_server.sessions))].turns[-1]
    assert turn.finished and turn.seq < 1000
    tty.resize(30, 120)  # at the prompt: readline takes the new width
    tty.send("/new\r")
    await tty.expect("new session")
    await tty.expect(PROMPT)
    await received(fake_server, "close")
    await interrupt(tty, "Ctrl-C again or Ctrl-D to quit")  # at the prompt: twice quits
    assert await interrupt(tty) == chat.EXIT_INTERRUPTED


async def test_terminal_a_pasted_question_is_one_message(fake_server: Any, tty_chat: Any) -> None:
    tty = tty_chat(fake_server.url, "--max-new-tokens", "2")
    await tty.expect("> ")
    # A terminal wraps a paste in these when the program asked (readline does).
    tty.send("\x1b[200~first line\nsecond line\n  third\x1b[201~\r")
    await tty.expect(SPEED)
    await tty.expect(PROMPT)
    tty.send("typed on\\\r")  # a trailing backslash: the question goes on
    await tty.expect(r"\.\.\. ")
    tty.send("two lines\r")
    await tty.expect(SPEED)
    await tty.expect(PROMPT)
    generates = [m for m in fake_server.received if m["type"] == "generate"]
    sent = [g["messages"][-1]["content"] for g in generates]
    assert sent == ["first line\nsecond line\n  third", "typed on\ntwo lines"]


async def test_terminal_ctrl_c_at_the_prompt_clears_then_quits(
    fake_server: Any, tty_chat: Any
) -> None:
    tty = tty_chat(fake_server.url, "--max-new-tokens", "2")
    await tty.expect("> ")
    tty.send("half a questi")
    await tty.expect("questi")
    await interrupt(tty, "Ctrl-C again or Ctrl-D to quit")  # clears the line; goes on
    await tty.expect(PROMPT)
    tty.send("hello\r")
    await tty.expect(SPEED)
    await tty.expect(PROMPT)
    sent = [m["messages"][-1]["content"] for m in fake_server.received if m["type"] == "generate"]
    assert sent == ["hello"]
    await interrupt(tty, "Ctrl-C again or Ctrl-D to quit")
    assert await interrupt(tty) == chat.EXIT_INTERRUPTED  # twice in a row: quits


async def test_terminal_a_long_error_is_not_cut(fake_server: Any, tty_chat: Any) -> None:
    tty = tty_chat(fake_server.url)
    tty.resize(24, 40)
    await tty.expect("> ")
    tty.send("/" + "x" * 70 + "\r")  # an unknown command: its note names it whole
    await tty.expect("unknown command")
    await tty.expect(PROMPT)
    note = tty.seen.rsplit("unknown command", 1)[1]
    unwrapped = re.sub(r"\x1b\[[0-9;]*m|\r?\n", "", note)  # the note's lines, joined
    assert unwrapped.startswith(" /" + "x" * 70 + "; Enter sends"), note
    shown = re.sub(r"\x1b\[[0-9;]*m", "", note).split("\r\n")
    assert "…" not in note and all(len(line) < 40 for line in shown), shown
