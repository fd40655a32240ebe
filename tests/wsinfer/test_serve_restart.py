"""`wsinfer serve` stopped and started again: the sessions outlive the server.

20 turns stream from the fake engine (token ``i`` of a turn is always the same
word, so every turn's text is known) to 10 raw WebSocket and 10 SSE followers.
Mid-run the whole server stops, one of three ways: kill -9 of its process group
(its children, in sessions of their own, die with it), kill -9 of every process
of it at once (Redis too: the last second of its append-only file may be lost,
and is generated again), or Ctrl-C. It starts again on the same port and data
directory; every follower reconnects and resumes from the last seq it received,
and its joined text must equal the turn's text exactly. Beside them, a paused
turn is still paused after the restart and then resumes, a finished session
takes another turn, and the sessions' TTLs carry on. The first resumed delta
comes soon after the restarted server is healthy: the previous run's engine
leases are handed over at once, not waited out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import redis

from tests.followers import FOLLOW, Direct, Follower
from tests.ports import free_ports
from tests.stack import Client, children_of, descendants, joined, start_serve, stop_serve
from tests.wsinfer.test_serve import alive, wait_gone
from wsinfer.engine.fake import WORDS
from wsinfer.sessions import keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TURNS = 20
RATE = 25  # tokens per second per turn
TOKENS = 250  # 10 s a turn: the stop lands mid-turn
TTL_S = 900
# The previous run's leases are handed over when the server starts: a resumed
# delta comes within a second or two of it being healthy, never after the
# 10 s lease (the bound leaves room for a loaded machine).
RESUMED_WITHIN_S = 5.0


def expected(tokens: int = TOKENS) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(tokens))


def serve(state: Path, port: int) -> subprocess.Popen[str]:
    """The same server each time: one port, one data dir (``state/data``)."""
    process, _ = start_serve(
        state,
        *("--model", f"fake:{RATE}", "--session-ttl", str(TTL_S), "--max-batch-size", "64"),
        port=port,
        start_new_session=True,  # a process group of its own, to kill as a user would
    )
    return process


def stop_server(process: subprocess.Popen[str], how: str) -> None:
    everything = [process.pid, *descendants(process.pid)]
    if how == "sigint":
        assert stop_serve(process) == 0
    elif how == "kill-group":
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    else:  # every process of it at once, Redis included
        for pid in everything:
            os.kill(pid, signal.SIGKILL)
        process.wait()
    assert wait_gone(everything) == []


def private_redis(state: Path) -> redis.Redis:
    """The running server's private Redis (each run's socket is in a new runtime dir)."""
    for sock in sorted(state.glob("wsinfer-*/redis.sock"), key=lambda p: -p.stat().st_mtime):
        client = redis.Redis(unix_socket_path=str(sock))
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            client.close()
    raise AssertionError("no private Redis answers")


async def start_turn(port: int, i: int, tokens: int = TOKENS) -> tuple[str, str]:
    client = await Client.open(port)
    await client.send(type="generate", prompt=f"turn {i}", params={"max_new_tokens": tokens})
    answer = await client.recv()
    await client.close()
    assert answer["type"] == "session", answer
    return answer["session"], answer["token"]


async def paused_turn(port: int) -> tuple[str, str, int, str]:
    """A turn paused by its client: session, token, the seq it paused at, its text."""
    client = await Client.open(port)
    await client.send(type="generate", prompt="pause me", params={"max_new_tokens": TOKENS})
    session = await client.recv()
    messages = await client.until("delta")
    await client.send(type="pause", session=session["session"], token=session["token"])
    messages += await client.until("paused")
    await client.close()
    text, seq = joined(messages)
    return session["session"], session["token"], seq, text


async def status(port: int, session: str, token: str) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        answer = await http.get(f"/v1/sessions/{session}", headers={"X-Wsinfer-Token": token})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def resume_to_end(port: int, session: str, token: str, after: int) -> str:
    client = await Client.open(port)
    await client.send(type="resume", session=session, token=token, after=after)
    text, _ = joined(await client.until("done"), after)
    await client.close()
    return text


@pytest.mark.parametrize("how", ["kill-group", "kill-everything", "sigint"])
async def test_a_restart_mid_stream_loses_and_repeats_nothing(tmp_path: Path, how: str) -> None:
    [port] = free_ports(1)
    process = serve(tmp_path, port)
    try:
        turns = await asyncio.gather(*(start_turn(port, i) for i in range(TURNS)))
        paused = await paused_turn(port)
        finished = await start_turn(port, TURNS, tokens=5)
        # Mid-stream, and every turn's start at least a second old (so in the
        # append-only file, even when Redis itself is killed).
        followers, tasks = await follow_mid_stream(port, turns)
        ttl_before = private_redis(tmp_path).ttl(keys.meta(finished[0]))  # idle since
        stop_server(process, how)
        stopped_at = [len(f.text) for f in followers]
        process = serve(tmp_path, port)
        healthy = time.monotonic()
        logged = await asyncio.gather(*(status(port, *turn) for turn in turns))
        read_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), 120)

        full = expected()
        for f in followers:
            assert f.text == full, (f.kind, f.session, len(f.text), len(full))
        assert all(at < len(full) for at in stopped_at), "the server stopped after a turn ended"
        seqs = [int(str(s["seq"])) for s in logged]
        resumed = first_generated(followers, seqs, default=read_at) - healthy
        assert resumed < RESUMED_WITHIN_S
        assert 0 < private_redis(tmp_path).ttl(keys.meta(finished[0])) <= ttl_before

        session, token, seq, text = paused
        assert (await status(port, session, token))["status"] == "paused"
        assert text + await resume_to_end(port, session, token, seq) == expected()
        await next_turn_answers(port, *finished)
        characters = sum(len(f.text) for f in followers)
        print(f"\n{how}: {TURNS} turns, {characters} characters compared, 0 lost, 0 repeated;")
        print(f"  the first delta generated after the restart came {resumed:.2f} s after healthy")
    finally:
        if process.poll() is None:
            stop_serve(process)


async def follow_mid_stream(
    port: int, turns: list[tuple[str, str]]
) -> tuple[list[Follower], list[asyncio.Task[None]]]:
    """A follower for each turn (WebSocket, SSE or the Responses socket, in turn),
    returned once each has 40 tokens."""
    kinds = ("ws", "sse", "responses_ws")
    followers = [
        Follower(kinds[i % len(kinds)], session, token, 0, Direct(port))
        for i, (session, token) in enumerate(turns)
    ]
    tasks = [asyncio.create_task(FOLLOW[f.kind](f)) for f in followers]
    while min(len(f.text) for f in followers) < 40 * len(" lorem"):
        await asyncio.sleep(0.1)
    return followers, tasks


def first_generated(followers: list[Follower], logged: list[int], default: float) -> float:
    """When the first delta beyond what the token log held just after the restart
    arrived: generated by the new run's engine, not replayed from the log. None
    such: the engine had gone on before the log was read (at ``default``)."""
    return min(
        (
            at
            for f, seq in zip(followers, logged, strict=True)
            for at, characters in f.progress
            if characters > len(expected(seq))
        ),
        default=default,
    )


async def next_turn_answers(port: int, session: str, token: str) -> None:
    client = await Client.open(port)
    await client.send(
        type="generate", session=session, token=token, prompt="again", params={"max_new_tokens": 5}
    )
    messages = await client.until("done")
    await client.close()
    assert messages[0]["type"] == "session" and messages[0]["turn"] == 2, messages[0]
    assert joined(messages)[0] == expected(5)


def test_a_second_server_on_a_data_dir_in_use_refuses_at_once(tmp_path: Path) -> None:
    first = serve(tmp_path, free_ports(1)[0])
    try:
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "wsinfer", "serve", "--port", "0", "--model", "fake:10"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "WSINFER_DATA_DIR": str(tmp_path / "data")},
        )
        assert second.returncode == 1
        assert f"(pid {first.pid}) is using the data directory" in second.stderr
        assert "Traceback" not in second.stderr
        assert time.monotonic() - started < 30  # no model loaded, no lock waited for
        assert alive(first.pid)
    finally:
        stop_serve(first)


def engine_children(serve_pid: int) -> dict[int, bool]:
    """serve's engine processes: pid -> whether it was started as a standby."""
    found = {}
    for pid in children_of(serve_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine" in argv:
            found[pid] = b"--standby" in argv
    return found


async def test_a_dead_engine_s_turns_go_on_at_once_on_the_standby(tmp_path: Path) -> None:
    [port] = free_ports(1)
    process, _ = start_serve(
        tmp_path,
        *("--model", f"fake:{RATE}", "--max-batch-size", "64", "--log-level", "info"),
        port=port,
        stderr=subprocess.PIPE,
    )
    ready = threading.Event()
    threading.Thread(target=watch_for_standby, args=(process, ready), daemon=True).start()
    try:
        assert await asyncio.to_thread(ready.wait, 120), "no standby engine came up"
        engines = engine_children(process.pid)
        [engine] = [pid for pid, standby in engines.items() if not standby]
        [standby] = [pid for pid, standby in engines.items() if standby]
        turns = await asyncio.gather(*(start_turn(port, i) for i in range(TURNS)))
        followers, tasks = await follow_mid_stream(port, turns)
        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        logged = await asyncio.gather(*(status(port, *turn) for turn in turns))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert all(f.text == expected() for f in followers)
        seqs = [int(str(s["seq"])) for s in logged]
        resumed = first_generated(followers, seqs, default=killed) - killed
        print(f"\nengine kill -9: the standby's first delta {resumed:.2f} s after the kill")
        assert resumed < RESUMED_WITHIN_S
        # The standby serves now, and another standby is started beside it.
        await until_async(lambda: len(engine_children(process.pid)) == 2)
        assert standby in engine_children(process.pid)
    finally:
        stop_serve(process)


def watch_for_standby(process: subprocess.Popen[str], ready: threading.Event) -> None:
    assert process.stderr is not None
    for line in process.stderr:  # drained to the end, so the server never blocks on it
        if "standby engine ready" in line:
            ready.set()


async def until_async(condition: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)


async def test_turns_outlive_a_serve_whose_log_reader_went_with_it(tmp_path: Path) -> None:
    """`wsinfer serve 2>&1 | tee log`, Ctrl-C: tee stops too, and the engine that
    goes on with the running turns writes its next line (here: pausing an idle
    turn) into a pipe nobody reads. That line raised BrokenPipeError inside the
    engine's step and the turn failed; now the turn pauses, and resumes whole."""
    [port] = free_ports(1)
    process, _ = start_serve(
        tmp_path, *("--model", f"fake:{RATE}", "--idle-pause", "1", "--log-level", "info"),
        port=port, start_new_session=True, stderr=subprocess.PIPE,
    )  # fmt: skip
    session, token = await start_turn(port, 0)  # unwatched from here on
    assert process.stderr is not None
    process.stderr.close()  # the reader goes (tee, a terminal)
    stop_server(process, "sigint")
    await asyncio.sleep(2.5)  # past --idle-pause: the engine has logged its pause
    process = serve(tmp_path, port)
    try:
        answer = await status(port, session, token)
        assert answer["status"] in ("paused", "running", "done"), answer
        assert await resume_to_end(port, session, token, 0) == expected()
    finally:
        stop_serve(process)
