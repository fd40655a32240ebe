"""The send path: one socket write per connection per round, a slow client drained."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve

from tests.stack import until
from wsinfer.messages import JsonCodec
from wsinfer.protocol import ConnectionProtocol
from wsinfer.sendpath import DeflateLargeFactory, Sender
from wsinfer.sessions.schema import DeltaEvent


async def serve_one(handler: Any) -> Any:
    return await serve(handler, "127.0.0.1", 0, compression=None)


async def test_one_round_of_deliveries_is_one_socket_write() -> None:
    writes: list[bytes] = []
    sent: list[dict[str, Any]] = []

    async def handler(ws: ServerConnection) -> None:
        protocol = ConnectionProtocol(JsonCodec())
        sender = Sender(ws, protocol, sent.append, lambda: None)
        real_write = ws.transport.write
        ws.transport.write = lambda data: (writes.append(bytes(data)), real_write(data))  # type: ignore[method-assign]
        for session in ("a", "b", "c"):  # three sessions: three frames, not merged
            protocol.follow(session, 1, after=0)
            protocol.deliver(session, 1, [DeltaEvent(1, session)])
            sender.schedule()
        await ws.wait_closed()

    async with await serve_one(handler) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None) as client:
            got = [json.loads(await client.recv()) for _ in range(3)]
    assert [m["session"] for m in got] == ["a", "b", "c"]
    assert [m["session"] for m in sent] == ["a", "b", "c"]
    text_writes = [w for w in writes if w[0] & 0x0F == 0x1]  # not the close frame's
    assert len(text_writes) == 1


async def test_a_client_that_does_not_read_is_drained_then_caught_up() -> None:
    behind: list[bool] = []
    done = asyncio.Event()
    total = 2000

    async def handler(ws: ServerConnection) -> None:
        protocol = ConnectionProtocol(JsonCodec())
        sender = Sender(ws, protocol, lambda message: None, lambda: behind.append(ws.paused))
        task = asyncio.create_task(sender.run())
        protocol.follow("s", 1, after=0)
        for seq in range(1, total + 1):  # 8 KiB each: past the socket's buffers
            protocol.deliver("s", 1, [DeltaEvent(seq, "x" * 8192)])
            sender.schedule()
            await asyncio.sleep(0)
        await done.wait()
        task.cancel()

    async with await serve_one(handler) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as client:
            try:  # not reading until the server's socket buffer is full
                await until(lambda: True in behind, what="websockets to pause the server's writes")
                last = 0
                while last < total:
                    last = json.loads(await asyncio.wait_for(client.recv(), 10))["seq"]
            finally:
                done.set()  # the handler ends, whatever happened here
    assert last == total
    assert True in behind  # the slow path ran: websockets' flow control paused writing
    assert behind[-1] is False


async def test_short_messages_go_plain_and_long_ones_deflated() -> None:
    writes: list[bytes] = []
    texts = ["short " * 10, "long " * 1000]

    async def handler(ws: ServerConnection) -> None:
        real_write = ws.transport.write
        ws.transport.write = lambda data: (writes.append(bytes(data)), real_write(data))  # type: ignore[method-assign]
        for text in texts:
            await ws.send(text)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", 0, extensions=[DeflateLargeFactory()]) as server:
        port = server.sockets[0].getsockname()[1]
        async with connect(f"ws://127.0.0.1:{port}") as client:  # offers permessage-deflate
            assert client.protocol.extensions  # negotiated
            assert [await client.recv() for _ in texts] == texts
    rsv1 = [bool(w[0] & 0x40) for w in writes if w[0] & 0x0F == 0x1]
    assert rsv1 == [False, True]  # RSV1: this message is compressed
    assert len(writes[1]) < len(texts[1]) // 10


async def test_a_slow_client_that_vanishes_leaves_nothing_queued() -> None:
    # Else its connection's reader would wait for the outgoing budget forever.
    full, measured = asyncio.Event(), asyncio.Event()
    pending: list[int] = []

    async def handler(ws: ServerConnection) -> None:
        protocol = ConnectionProtocol(JsonCodec())
        sender = Sender(ws, protocol, lambda m: None, lambda: pending.append(-1))
        task = asyncio.create_task(sender.run())
        for session in ("a", "b"):
            protocol.follow(session, 1, after=0)
        seq = 0
        while not ws.paused:  # fill the socket's buffers
            seq += 1
            protocol.deliver("a", 1, [DeltaEvent(seq, "x" * 8192)])
            sender.schedule()
            await asyncio.sleep(0)
        protocol.deliver("b", 1, [DeltaEvent(1, "queued behind")])
        sender.schedule()
        full.set()
        await ws.wait_closed()
        # The sender's task meets the reset and drops what is queued (bounded:
        # else what is left is measured below and the test fails on it).
        await asyncio.wait({task}, timeout=5)
        pending.append(protocol.outbox_bytes + sender.buffered)
        measured.set()
        task.cancel()

    async with await serve_one(handler) as server:
        port = server.sockets[0].getsockname()[1]
        client = await connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None)
        await asyncio.wait_for(full.wait(), 10)
        client.transport.abort()  # unread data: the server's socket gets a reset
        await client.wait_closed()
        await asyncio.wait_for(measured.wait(), 10)
    assert pending[-1] == 0
