"""``wsinfer chat``: a terminal chat on top of the asyncio client.

On a terminal it is ``terminal.TerminalChat`` (readline editing, history, a
speed line after each answer). Otherwise (piped input) lines from stdin are
user messages (or commands); answers stream to stdout, status notes (and the
speed after each answer) go to stderr so that piped output is just the
answers. While an answer streams, ``/pause``, ``/resume`` and ``/stop`` act
on it at once; any other line waits for the answer to end, so a piped script
runs in order. Ctrl-C during an answer stops it; a second Ctrl-C (or one
while idle) quits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from wsinfer.clients.client import Client, connect
from wsinfer.clients.errors import WsinferError
from wsinfer.clients.terminal import Speed
from wsinfer.clients.turn import Conversation, Turn

DEFAULT_URL = "ws://127.0.0.1:8000/v1/ws"
IMMEDIATE = ("/pause", "/resume", "/stop")
HELP = "commands: /pause /resume /stop (during an answer), /new, /quit"
EXIT_INTERRUPTED = 130


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=os.environ.get("WSINFER_URL", DEFAULT_URL), help="server WebSocket URL"
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("WSINFER_API_KEY"), help="API key (or $WSINFER_API_KEY)"
    )
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    parser.add_argument(
        "--max-new-tokens", type=int, default=None, help="answer length limit (server default)"
    )
    parser.add_argument("--system", default=None, help="system prompt for each new session")
    parser.add_argument(
        "--codec", choices=("msgpack", "json"), default="msgpack", help="wire encoding"
    )
    parser.add_argument(
        "--history-file",
        default=None,
        help="line history on a terminal (default $WSINFER_CHAT_HISTORY or "
        "~/.local/state/wsinfer/chat_history)",
    )


def run(args: argparse.Namespace) -> int:
    if sys.stdin.isatty() and sys.stdout.isatty():
        from wsinfer.clients.terminal import run_terminal

        return run_terminal(args)
    try:
        return asyncio.run(_run(args, sys.stdin, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wsinfer chat", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _params(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.temperature is not None:
        params["temperature"] = args.temperature
    if args.max_new_tokens is not None:
        params["max_new_tokens"] = args.max_new_tokens
    return params


async def _run(args: argparse.Namespace, stdin: TextIO, stdout: TextIO, stderr: TextIO) -> int:
    try:
        client = await connect(args.url, api_key=args.api_key, codec=args.codec)
    except WsinferError as exc:
        print(f"wsinfer chat: {exc}", file=stderr)
        return 1
    try:
        chat = Chat(client, _params(args), args.system, stdout, stderr)
        return await chat.run(_stdin_lines(stdin), interactive=stdin.isatty())
    finally:
        await client.close()


def _stdin_lines(stdin: TextIO) -> asyncio.Queue[str | None]:
    """Lines of stdin (None at EOF), read by a daemon thread.

    A thread rather than a pipe transport: it works for ttys, pipes and plain
    files alike, and a daemon thread blocked in read() does not hold up exit.
    """
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def pump() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed first: we are exiting
            for line in stdin:
                loop.call_soon_threadsafe(lines.put_nowait, line)
            loop.call_soon_threadsafe(lines.put_nowait, None)

    threading.Thread(target=pump, name="wsinfer-chat-stdin", daemon=True).start()
    return lines


class Chat:
    """The chat loop: one conversation, at most one answer streaming."""

    def __init__(
        self,
        client: Client,
        params: dict[str, Any],
        system: str | None,
        out: TextIO,
        err: TextIO,
    ) -> None:
        self.client = client
        self.params = params
        self.system = system
        self.out = out
        self.err = err
        self.conversation: Conversation = client.conversation(system=system, params=params)
        self.turn: Turn | None = None
        self.printer: asyncio.Task[None] | None = None
        self.stopping = False
        self.quit = asyncio.Event()
        self.interactive = False

    async def run(self, lines: asyncio.Queue[str | None], *, interactive: bool) -> int:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, self.on_interrupt)
        self.interactive = interactive
        if interactive:
            self.note(HELP)
        reader = asyncio.create_task(self.read_loop(lines, interactive))
        quit_waiter = asyncio.create_task(self.quit.wait())
        await asyncio.wait([reader, quit_waiter], return_when=asyncio.FIRST_COMPLETED)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.remove_signal_handler(signal.SIGINT)
        for task in (reader, quit_waiter, self.printer):
            if task is not None and not task.done():
                task.cancel()
        if reader.done() and not reader.cancelled():
            return reader.result()
        return EXIT_INTERRUPTED

    async def read_loop(self, lines: asyncio.Queue[str | None], interactive: bool) -> int:
        while True:
            if interactive and not self.answering:
                self.out.write("> ")
                self.out.flush()
            line = await lines.get()
            if line is None:
                await self.settle()
                return 0
            if not await self.handle(line.strip()):
                return 0

    async def handle(self, line: str) -> bool:
        """Act on one input line; False means quit."""
        if not line:
            return True
        if line in IMMEDIATE:
            await self.control(line)
            return True
        await self.settle()
        if line == "/quit":
            return False
        if line == "/new":
            await self.new_session()
        elif line.startswith("/"):
            self.note(f"unknown command {line}; {HELP}")
        else:
            await self.ask(line)
        return True

    @property
    def answering(self) -> bool:
        return self.printer is not None and not self.printer.done()

    def note(self, text: str) -> None:
        print(f"[{text}]", file=self.err, flush=True)

    async def ask(self, text: str) -> None:
        try:
            self.turn = await self.conversation.start(text)
        except WsinferError as exc:
            self.note(f"error: {exc}")
            return
        self.stopping = False
        self.printer = asyncio.create_task(self.print_answer(self.turn))

    async def print_answer(self, turn: Turn) -> None:
        speed = Speed(time.monotonic())
        try:
            async for text in turn:
                speed.saw(turn.seq)
                self.out.write(text)
                self.out.flush()
        except WsinferError as exc:
            self.note(f"error: {exc}")
        finally:
            self.out.write("\n")
            self.out.flush()
        if turn.finish_reason == "cancelled":
            self.note("stopped")
        self.note(speed.line(turn.seq, turn.finish_reason))
        if self.interactive:  # the prompt comes back however the answer ended
            self.out.write("> ")
            self.out.flush()

    async def settle(self) -> None:
        """Let the current answer end before the next line; a paused one is stopped."""
        if self.printer is None:
            return
        if self.turn is not None and self.turn.paused and not self.turn.finished:
            await self._quietly(self.turn.stop())
        await self.printer
        self.printer = None

    async def control(self, command: str) -> None:
        turn = self.turn
        if not self.answering or turn is None:
            self.note(f"no answer in progress for {command}")
            return
        if command == "/pause":
            seq = await self._quietly(turn.pause())
            self.note(f"paused at token {seq}; /resume to continue")
        elif command == "/resume":
            await self._quietly(turn.resume())
        else:
            await self._quietly(turn.stop())

    async def new_session(self) -> None:
        await self._quietly(self.conversation.close())
        self.conversation = self.client.conversation(system=self.system, params=self.params)
        self.note("new session")

    async def _quietly(self, call: Any) -> Any:
        try:
            return await call
        except WsinferError as exc:
            self.note(f"error: {exc}")
            return None

    def on_interrupt(self) -> None:
        # First Ctrl-C during an answer stops it; the next one (or one while
        # idle) quits, so a stuck server can never trap the user.
        if self.answering and not self.stopping and self.turn is not None:
            self.stopping = True
            self.turn.stop_soon()
            self.note("stopping; Ctrl-C again to quit")
        else:
            self.quit.set()


if __name__ == "__main__":
    sys.exit(main())
