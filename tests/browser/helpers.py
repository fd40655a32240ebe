"""Helpers for the browser tests: a cuttable TCP proxy, a reference run over a
plain WebSocket, and page probes keyed on the chat page's data attributes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- TCP proxy ------------------------------------------------------------------


@dataclass
class Proxy:
    """Forwards 127.0.0.1:port to the target; ``cut()`` kills every connection.

    ``refuse`` makes it accept and drop new connections at once, so the client
    stays in its reconnect loop for as long as a test wants.
    """

    target_port: int
    port: int = 0
    refuse: bool = False
    websocket_connections: int = 0
    _transports: set[asyncio.WriteTransport] = field(default_factory=set)
    _server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.cut()
        if self._server:
            self._server.close()
            await self._server.wait_closed()

    def cut(self) -> None:
        for t in list(self._transports):
            t.abort()
        self._transports.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._transports.update((writer.transport, up_writer.transport))
        await asyncio.gather(
            self._pump(reader, up_writer, count=True), self._pump(up_reader, writer)
        )

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: bool = False
    ) -> None:
        try:
            first = True
            while data := await reader.read(65536):
                if first and count and b"upgrade: websocket" in data.lower():
                    self.websocket_connections += 1
                first = False
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._transports.discard(writer.transport)
            writer.transport.abort()


async def reference_run(
    ws_url: str, turns: list[list[dict[str, str]]], params: dict[str, Any]
) -> list[str]:
    """Each turn's whole text from an uninterrupted run over a plain WebSocket."""
    from websockets.asyncio.client import connect

    texts: list[str] = []
    session: dict[str, Any] = {}
    async with connect(ws_url, subprotocols=["wsinfer.v1.json"]) as ws:  # type: ignore[list-item]
        for messages in turns:
            req: dict[str, Any] = {
                "type": "generate",
                "id": 1,
                "messages": messages,
                "params": params,
            }
            req.update(session)
            await ws.send(json.dumps(req))
            parts: dict[int, str] = {}
            while True:
                msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if msg["type"] == "error":
                    raise AssertionError(f"reference run refused: {msg}")
                if msg["type"] == "session":
                    session = {"session": msg["session"], "token": msg["token"]}
                elif msg["type"] == "delta":
                    parts.setdefault(msg["seq"], msg["text"])
                elif msg["type"] == "done":
                    break
            texts.append("".join(parts[k] for k in sorted(parts)))
        with contextlib.suppress(Exception):
            await ws.send(json.dumps({"type": "close", **session}))
    return texts


# ---- page helpers ----------------------------------------------------------------

LAST_ANSWER = "li.msg.assistant:last-child"


async def settled(page: Any, n: int, timeout_ms: float | None = None) -> None:
    """Until the page shows ``n`` messages, the last one finished, and no turn runs
    (within ``timeout_ms``; Playwright's default when None)."""
    await page.wait_for_function(
        "n => document.querySelectorAll('li.msg').length === n"
        " && document.querySelector('li.msg:last-child').dataset.finish"
        " && document.body.dataset.turn === 'idle'",
        arg=n,
        **({} if timeout_ms is None else {"timeout": timeout_ms}),
    )


async def ask(page: Any, text: str) -> None:
    await page.fill("#input", text)
    await page.press("#input", "Enter")


async def record_events(page: Any) -> None:
    """Log the client's connection events and the current turn's deltas in window.__ev."""
    await page.evaluate(
        """() => {
        window.__ev = [];
        const c = window.wsinferChat.client;
        for (const s of ["connecting", "open", "reconnecting", "resumed", "closed"])
            c.addEventListener(s, (e) => window.__ev.push({type: s, detail: e.detail}));
        }"""
    )


async def watch_turn(page: Any) -> None:
    """Count delta events of the turn just started (window.__deltas)."""
    await page.evaluate(
        """() => { window.__deltas = [];
        window.wsinferChat.turn.addEventListener("delta",
            (e) => window.__deltas.push(e.detail.seq)); }"""
    )


async def wait_seq(page: Any, n: int) -> int:
    await page.wait_for_function(
        f"n => {{ const m = document.querySelector('{LAST_ANSWER}');"
        " return m && (+m.dataset.seq >= n || m.dataset.finish); }",
        arg=n,
    )
    return await seq_of(page)


async def seq_of(page: Any) -> int:
    return int(await page.get_attribute(LAST_ANSWER, "data-seq") or 0)


async def wait_done(page: Any, timeout: float = 300_000) -> str:
    # Generous: a loaded 2-core machine runs the server, the browser and the test.
    await page.wait_for_selector(f"{LAST_ANSWER}[data-finish]", timeout=timeout)
    return str(await page.get_attribute(LAST_ANSWER, "data-finish"))


async def answer_text(page: Any) -> str:
    """The last answer's text as the model wrote it (the page shows it as Markdown)."""
    return str(await page.eval_on_selector(f"{LAST_ANSWER} .content", "e => e.source"))


async def controls(page: Any) -> dict[str, bool]:
    """Which of Send/Stop/Pause/Resume are enabled."""
    return dict(
        await page.evaluate(
            """() => Object.fromEntries(["send", "stop", "pause", "resume"]
            .map((id) => [id, !document.getElementById(id).disabled]))"""
        )
    )


async def screenshot(page: Any, name: str) -> None:
    """Keep a picture for humans when WSINFER_SCREENSHOTS names a folder."""
    folder = os.environ.get("WSINFER_SCREENSHOTS")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        await page.screenshot(path=str(Path(folder) / f"{name}.png"))
