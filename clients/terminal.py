"""``wsinfer chat`` on a terminal: line editing and a persistent history (GNU
readline), answers streamed as they come, a speed line after each, Ctrl-C to
stop an answer.

The prompt runs in the main thread because readline must: it owns the
terminal's mode while it reads, and its SIGWINCH handler re-reads the width
after a resize (so this module installs no SIGWINCH handler of its own, which
would replace readline's). The asyncio client runs on a background loop
through the sync wrapper. Piped input goes through ``chat.Chat`` instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from wsinfer.clients import sync
from wsinfer.clients.errors import NotFound, WsinferError

EXIT_INTERRUPTED = 130
HISTORY_LENGTH = 1000
PROMPT = "> "
CONTINUED = "... "  # after a line that ends with a backslash
HELP = (
    "Enter sends (end a line with \\ to go on; a paste is one question); Up/Down recall "
    "earlier lines; Ctrl-C stops an answer; /new, /quit (or Ctrl-D)"
)


def history_path(explicit: str | None = None) -> Path:
    """Where the line history lives: --history-file, $WSINFER_CHAT_HISTORY, XDG state."""
    if explicit or os.environ.get("WSINFER_CHAT_HISTORY"):
        return Path(explicit or os.environ["WSINFER_CHAT_HISTORY"]).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "wsinfer" / "chat_history"


class LineEditor:
    """input() with readline's editing and a history kept between runs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.readline: ModuleType | None
        try:
            import readline
        except ImportError:  # Python built without it: plain input() still works
            self.readline = None
            return
        self.readline = readline
        # CPython turns readline's bracketed paste off (for its own REPL); on, the
        # terminal marks a paste and readline keeps it whole, newlines and all:
        # a pasted question is one message, not one per line.
        readline.parse_and_bind("set enable-bracketed-paste on")
        readline.set_history_length(HISTORY_LENGTH)
        with contextlib.suppress(OSError):
            readline.read_history_file(path)

    def read(self, prompt: str) -> str:
        return input(prompt)

    def save(self) -> None:
        if self.readline is None:
            return
        with contextlib.suppress(OSError):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.readline.write_history_file(self.path)


@dataclass
class Speed:
    """Time to the first token and tokens per second after it."""

    started: float
    first_at: float | None = None
    first_seq: int = 0

    def saw(self, seq: int) -> None:
        if self.first_at is None:
            self.first_at = time.monotonic()
            self.first_seq = seq

    def line(self, seq: int, reason: str | None) -> str:
        parts = [f"{seq} tokens"]
        if self.first_at is not None:
            elapsed = time.monotonic() - self.first_at
            if elapsed > 0 and seq > self.first_seq:
                parts.append(f"{(seq - self.first_seq) / elapsed:.1f} tok/s")
            parts.append(f"first token {(self.first_at - self.started) * 1000:.0f} ms")
        if reason and reason not in ("stop", "length"):
            parts.append(reason)
        elif reason == "length":
            parts.append("hit max tokens")
        return " · ".join(parts)


class TerminalChat:
    """One conversation at a time; the session continues turn after turn."""

    def __init__(self, client: sync.SyncClient, args: argparse.Namespace, out: TextIO) -> None:
        self.client = client
        self.params = _params(args)
        self.system: str | None = args.system
        self.out = out
        self.session: str | None = None
        self.token: str | None = None
        self.history: list[dict[str, str]] = []  # to restart a session the server forgot

    def note(self, text: str, *, whole: bool = False) -> None:
        """A dim line on stderr, fitted to the width as it is now (the terminal may
        have been resized): cut with an ellipsis, or ``whole``, wrapped (errors)."""
        width = shutil.get_terminal_size().columns
        line = f"[{text}]"
        if whole:
            lines = textwrap.wrap(line, max(8, width - 1), break_on_hyphens=False) or [line]
        elif len(line) > width - 1:
            lines = [line[: max(8, width - 2)] + "…"]
        else:
            lines = [line]
        for part in lines:
            print(f"\x1b[2m{part}\x1b[0m", file=sys.stderr, flush=True)

    def error(self, text: str) -> None:
        self.note(f"error: {text}", whole=True)

    def loop(self, editor: LineEditor) -> int:
        self.note(HELP, whole=True)
        interrupted = False  # the last prompt ended with Ctrl-C
        while True:
            try:
                line = self.read_question(editor)
            except EOFError:
                self.out.write("\n")
                return 0
            except KeyboardInterrupt:
                if interrupted:  # a second Ctrl-C in a row quits
                    raise
                interrupted = True
                self.out.write("\n")
                self.note("Ctrl-C again or Ctrl-D to quit")
                continue
            interrupted = False
            if line in ("/quit", "/exit"):
                return 0
            self.handle(line)

    def read_question(self, editor: LineEditor) -> str:
        """One question: a line, or several (a paste is one, readline keeps its
        newlines; a line that ends with a backslash goes on on the next)."""
        lines = [editor.read(PROMPT)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(editor.read(CONTINUED))
        return "\n".join(lines).strip()

    def handle(self, line: str) -> None:
        if not line:
            return
        if line == "/new":
            self.new_session()
        elif line == "/help":
            self.note(HELP, whole=True)
        elif line.startswith("/"):
            self.note(f"unknown command {line}; {HELP}", whole=True)
        else:
            self.ask(line)

    def new_session(self) -> None:
        if self.session is not None:
            with contextlib.suppress(WsinferError):
                self.client.close_session(self.session, self.token)
        self.session = self.token = None
        self.history = []
        self.note("new session")

    def start(self, text: str) -> sync.SyncTurn:
        user = {"role": "user", "content": text}
        if self.session is not None:
            try:
                return self.client.start(
                    messages=[user], params=self.params, session=self.session, token=self.token
                )
            except NotFound:
                self.note("the server forgot this session; starting again with the history")
        system = [{"role": "system", "content": self.system}] if self.system else []
        return self.client.start(messages=[*system, *self.history, user], params=self.params)

    def ask(self, text: str) -> None:
        speed = Speed(time.monotonic())
        try:
            turn = self.start(text)
        except WsinferError as exc:
            self.error(str(exc))
            return
        self.session, self.token = turn.session, turn.token
        shown = self.stream(turn, speed)
        if not shown.endswith("\n"):
            self.out.write("\n")
            self.out.flush()
        self.history.append({"role": "user", "content": text})
        self.history.append({"role": "assistant", "content": turn.text})
        self.note(speed.line(turn.seq, turn.finish_reason))

    def stream(self, turn: sync.SyncTurn, speed: Speed) -> str:
        shown = ""
        try:
            for piece in turn:
                speed.saw(turn.seq)
                self.out.write(piece)
                self.out.flush()
                shown += piece
        except KeyboardInterrupt:
            shown = self.interrupt(turn)
        except WsinferError as exc:
            self.out.write("\n")
            self.error(str(exc))
            return "\n"
        return shown

    def interrupt(self, turn: sync.SyncTurn) -> str:
        """Ctrl-C mid-answer: stop it and wait for its end; a second Ctrl-C quits."""
        self.out.write("\n")
        self.note("stopping; Ctrl-C again to quit")
        with contextlib.suppress(WsinferError):
            turn.stop()
        return "\n"


def _params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    return params


def run_terminal(args: argparse.Namespace) -> int:
    editor = LineEditor(history_path(getattr(args, "history_file", None)))
    try:
        client = sync.connect(args.url, api_key=args.api_key, codec=args.codec)
    except WsinferError as exc:
        print(f"wsinfer chat: {exc}", file=sys.stderr)
        return 1
    try:
        return TerminalChat(client, args, sys.stdout).loop(editor)
    except KeyboardInterrupt:  # at the prompt, or a second one while stopping
        sys.stdout.write("\n")
        return EXIT_INTERRUPTED
    finally:
        editor.save()
        with contextlib.suppress(Exception):
            client.close()
