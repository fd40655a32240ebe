"""TGI's native API on a real ``wsinfer serve`` (the fake model), driven by
``huggingface_hub``'s ``InferenceClient``: ``text_generation`` streamed and whole,
with and without details, a stream dropped and resumed over this door and over
``/v1/sessions/{id}/stream``, ``/info``, ``/health`` and the refusals. The dialect
alone, without sockets, at the end."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError

from tests.stack import Client, joined, start_serve, stop_serve
from wsinfer.errors import Overloaded
from wsinfer.http.openai import OpenAIError
from wsinfer.http.tgi import TgiError, TgiTurn, finish_reason, parse_tgi_request, turn_failure
from wsinfer.http.tgi_routes import is_tgi
from wsinfer.messages import Limits
from wsinfer.sessions.schema import GenerationParams

KEY = "sekrit"
RATE = 200  # tokens a second: a 60-token turn streams for 0.3 s, long enough to cut
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    state: Path = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", f"fake:{RATE}", "--api-key", KEY)
    yield port
    assert stop_serve(process) == 0


@pytest.fixture
def hub(serve: int) -> InferenceClient:
    return InferenceClient(base_url=f"http://127.0.0.1:{serve}", api_key=KEY)


@pytest.fixture
async def http(serve: int) -> AsyncIterator[httpx.AsyncClient]:
    headers = {"Authorization": f"Bearer {KEY}"}
    base = f"http://127.0.0.1:{serve}"
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:
        yield client


def events_of(raw: str) -> list[tuple[int | None, dict[str, Any]]]:
    """Each complete event's ``id`` and data (comments skipped)."""
    out = []
    for block in raw.split("\n\n")[:-1]:
        fields = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        if "data" in fields:
            seq = int(fields["id"]) if "id" in fields else None
            out.append((seq, json.loads(fields["data"])))
    return out


def tokens_text(events: list[tuple[int | None, dict[str, Any]]]) -> str:
    return "".join(data["token"]["text"] for _, data in events)


# --- huggingface_hub ------------------------------------------------------------------


@pytest.mark.slow
def test_hub_text_generation_streamed_and_whole(hub: InferenceClient) -> None:
    whole = hub.text_generation(PROMPT, max_new_tokens=12)
    assert isinstance(whole, str) and whole

    stream = list(hub.text_generation(PROMPT, max_new_tokens=12, stream=True, details=True))
    last = stream[-1]
    assert last.generated_text == whole == "".join(e.token.text for e in stream)
    assert all(e.generated_text is None and e.details is None for e in stream[:-1])
    assert last.details is not None and last.details.finish_reason == "length"
    assert last.details.generated_tokens == 12 and last.details.seed is None  # greedy
    assert last.details.input_length > 0
    assert all(e.token.id is None for e in stream)  # the protocol carries no token ids
    assert all(e.token.logprob is not None for e in stream[:-1])  # details asks for them
    assert [e.index for e in stream[:-1]] == sorted({e.index for e in stream[:-1]})

    texts = list(hub.text_generation(PROMPT, max_new_tokens=12, stream=True))
    assert "".join(texts) == whole  # details=False: the tokens' text only

    detailed = hub.text_generation(PROMPT, max_new_tokens=12, details=True)
    assert detailed.generated_text == whole and detailed.details is not None
    assert detailed.details.finish_reason == "length" and detailed.details.prefill == []
    assert "".join(t.text for t in detailed.details.tokens) == whole
    assert len(detailed.details.tokens) == 12


@pytest.mark.slow
def test_hub_parameters_reach_the_turn(hub: InferenceClient) -> None:
    whole = hub.text_generation(PROMPT, max_new_tokens=20)
    stop = whole.split()[3]  # a word the fake model writes
    cut = hub.text_generation(PROMPT, max_new_tokens=20, stop=[stop], details=True)
    assert cut.details is not None and cut.details.finish_reason == "stop_sequence"
    assert whole.startswith(cut.generated_text) and stop not in cut.generated_text
    full = hub.text_generation(PROMPT, max_new_tokens=5, return_full_text=True)
    assert full.startswith(PROMPT) and whole.startswith(full.removeprefix(PROMPT))
    sampled = hub.text_generation(
        PROMPT, max_new_tokens=5, do_sample=True, seed=7, top_k=5, details=True
    )
    assert sampled.details is not None and sampled.details.seed == 7
    typical = [
        hub.text_generation(PROMPT, max_new_tokens=8, seed=7, typical_p=0.9, details=True)
        for _ in range(2)
    ]
    assert typical[0].generated_text == typical[1].generated_text  # seeded draws repeat
    assert typical[0].details is not None and typical[0].details.seed == 7  # it sampled


@pytest.mark.slow
def test_hub_refusals_are_tgi_validation_errors(hub: InferenceClient) -> None:
    for bad in ({"best_of": 2}, {"temperature": 9.0}, {"truncate": 10}, {"max_new_tokens": 0}):
        with pytest.raises(ValidationError):
            hub.text_generation(PROMPT, **bad)
    with pytest.raises(ValidationError, match="decoder_input_details"):
        hub.text_generation(PROMPT, details=True, decoder_input_details=True)


# --- resume -----------------------------------------------------------------------------


async def cut_stream(
    http: httpx.AsyncClient, keep: int, **headers: str
) -> tuple[httpx.Headers, list[tuple[int | None, dict[str, Any]]]]:
    """A /generate_stream whose connection drops after ``keep`` events."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 60, "details": True}}
    raw = ""
    async with http.stream("POST", "/generate_stream", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for chunk in response.aiter_text():
            raw += chunk
            if len(events_of(raw)) >= keep:
                break
    return response.headers, events_of(raw)[:keep]


@pytest.mark.slow
async def test_a_dropped_stream_resumes_exactly_over_this_door_and_the_session_route(
    http: httpx.AsyncClient, hub: InferenceClient, serve: int
) -> None:
    whole = hub.text_generation(PROMPT, max_new_tokens=60)
    head, first = await cut_stream(http, keep=5)
    session, token = head["x-wsinfer-session"], head["x-wsinfer-token"]
    assert head["x-wsinfer-turn"] == "1" and first[-1][0] == first[-1][1]["index"]
    after = first[-1][0]
    assert after is not None

    resume = {"X-Wsinfer-Session": session, "X-Wsinfer-Token": token, "Last-Event-ID": str(after)}
    body = {"inputs": PROMPT, "parameters": {"details": True}}
    rest_raw = (await http.post("/generate_stream", json=body, headers=resume)).text
    rest = events_of(rest_raw)
    assert all(seq is not None and seq > after for seq, _ in rest)
    assert tokens_text(first) + tokens_text(rest) == whole
    last = rest[-1][1]
    assert last["generated_text"] == whole and last["details"]["finish_reason"] == "length"
    assert last["details"]["generated_tokens"] == 60
    print(f"resume: {len(first)} events before the cut, {len(rest)} after, at seq {after}")

    # The same session, read by the OpenAI door's resume route, from the same point.
    query = f"?after={after}&object=text_completion&session_token={token}"
    chunks = (await http.get(f"/v1/sessions/{session}/stream{query}")).text
    texts = [
        data["choices"][0]["text"]
        for _, data in events_of(chunks.replace("data: [DONE]\n\n", ""))
        if data.get("choices")
    ]
    assert tokens_text(first) + "".join(texts) == whole

    # And by the WebSocket resume, from the same point.
    client = await Client.open(serve, additional_headers={"Authorization": f"Bearer {KEY}"})
    try:
        await client.send(type="resume", session=session, token=token, after=after)
        text, _ = joined(await client.until("done"), after)
        assert tokens_text(first) + text == whole
    finally:
        await client.close()

    missing = await http.post("/generate_stream", json=body, headers={"Last-Event-ID": "3"})
    assert missing.status_code == 422 and missing.json()["error_type"] == "validation"
    wrong = {**resume, "X-Wsinfer-Token": "nope"}
    refused = await http.post("/generate_stream", json=body, headers=wrong)
    assert refused.status_code == 404 and refused.json()["error_type"] == "not_found"


@pytest.mark.slow
async def test_compat_route_info_health_and_errors(http: httpx.AsyncClient) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    whole = await http.post("/", json=body)
    assert whole.status_code == 200 and whole.headers["x-wsinfer-session"]
    text = whole.json()["generated_text"]
    streamed = await http.post("/", json={**body, "stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert tokens_text(events_of(streamed.text)) == text

    # The next turn of the same raw-text session continues its text.
    more = {"X-Wsinfer-Session": whole.headers["x-wsinfer-session"]}
    more["X-Wsinfer-Token"] = whole.headers["x-wsinfer-token"]
    second = await http.post("/generate", json=body, headers=more)
    assert second.status_code == 200 and second.headers["x-wsinfer-turn"] == "2"

    info = (await http.get("/info")).json()
    assert info["model_id"] == f"fake:{RATE}" and info["max_best_of"] == 1  # the served name
    assert (await http.get("/health")).status_code == 200
    assert (await http.get("/")).status_code == 200  # GET / is still the chat page

    bad = await http.post("/generate", content=b"{nope")
    assert bad.status_code == 422 and bad.json()["error_type"] == "validation"
    unknown = await http.post("/generate", json={**body, "frobnicate": 1})
    assert unknown.status_code == 422 and "frobnicate" in unknown.json()["error"]
    assert (await http.get("/generate")).status_code == 405
    keyless = httpx.AsyncClient(base_url=str(http.base_url))
    async with keyless:
        assert (await keyless.post("/generate", json=body)).status_code == 401


# --- the dialect, without sockets -----------------------------------------------------------


def parse(stream: bool | None = None, **parameters: Any) -> Any:
    body = json.dumps({"inputs": "hi", "parameters": parameters}).encode()
    return parse_tgi_request(body, Limits(), None, None, stream)


def test_greedy_unless_sampling_is_asked_as_tgi_decides() -> None:
    assert parse().generate.params.temperature == 0.0
    assert parse(do_sample=False, temperature=1.0).generate.params.temperature == 0.0
    assert parse(do_sample=True).generate.params.temperature == 1.0
    assert parse(temperature=0.5).generate.params.temperature == 0.5  # a warper samples
    assert parse(do_sample=False, top_k=3).generate.params.temperature == 1.0
    typical = parse(typical_p=0.9).generate.params  # a warper too, as TGI's has_warpers
    assert (typical.typical_p, typical.temperature) == (0.9, 1.0)
    assert parse(typical_p=1.0).generate.params.greedy and parse(typical_p=None).generate
    ask = parse(max_new_tokens=9, seed=3, stop=["\n"], repetition_penalty=1.1, details=True)
    params = ask.generate.params
    assert (params.max_new_tokens, params.seed, params.stop) == (9, 3, ("\n",))
    assert params.repetition_penalty == 1.1 and params.logprobs and ask.details
    assert parse(stream=None).stream is False and parse(stream=True).stream is True
    body = json.dumps({"inputs": "hi", "stream": True}).encode()
    assert parse_tgi_request(body, Limits(), None, None).stream is True


@pytest.mark.parametrize(
    "parameters",
    [
        {"best_of": 2},
        {"typical_p": 0},
        {"typical_p": 1.5},
        {"top_n_tokens": 3},
        {"grammar": {"type": "json", "value": {}}},
        {"watermark": True},
        {"frobnicate": 1},
        {"temperature": -1},
        {"details": "yes"},
    ],
)
def test_refusals_are_422_validation(parameters: dict[str, Any]) -> None:
    with pytest.raises(OpenAIError) as caught:
        parse(**parameters)
    refused = TgiError.from_openai(caught.value)
    assert (refused.status, refused.error_type) == (422, "validation")
    assert set(refused.body()) == {"error", "error_type"}


def test_a_full_queue_is_429_overloaded_with_retry_after() -> None:
    refused = TgiError.from_openai(OpenAIError.from_wsinfer(Overloaded("full", retry_after=2.0)))
    assert (refused.status, refused.error_type) == (429, "overloaded")
    assert ("Retry-After", "2") in refused.headers


def test_events_and_finish_reasons() -> None:
    turn = TgiTurn(True, "P:", GenerationParams(temperature=0.0, stop=("x",)))
    delta: Any = {"type": "delta", "session": "s", "turn": 1, "seq": 1, "text": " a"}
    delta["logprobs"] = [{"token": " a", "logprob": -0.5, "bytes": [32, 97]}]
    event = turn.token_event(delta)
    assert event["index"] == 1 and event["token"] == {
        "id": None, "text": " a", "logprob": -0.5, "special": False,
    }  # fmt: skip
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "cached_tokens": 0}
    done: Any = {"type": "done", "session": "s", "turn": 1, "seq": 1, "usage": usage}
    last = turn.last_event({**done, "finish_reason": "stop"})
    assert last["generated_text"] == "P: a" and last["details"]["finish_reason"] == "stop_sequence"
    assert last["details"]["seed"] is None and last["details"]["input_length"] == 3
    assert turn.sse_for({**done, "finish_reason": "length"}).startswith(b"id: 1\ndata: ")
    assert (
        finish_reason("stop", ()) == "eos_token" and finish_reason("cancelled", ()) == "eos_token"
    )
    error = {"code": "too_large", "message": "too long"}
    failed = turn_failure({**done, "finish_reason": "error", "error": error})
    assert failed is not None and (failed.status, failed.error_type) == (422, "validation")
    internal = {"code": "internal", "message": "boom"}
    failed = turn_failure({**done, "finish_reason": "error", "error": internal})
    assert failed is not None and (failed.status, failed.error_type) == (424, "generation")


def test_only_tgis_paths_leave_the_plain_routes() -> None:
    assert is_tgi("POST", "/") and not is_tgi("GET", "/")
    assert is_tgi("POST", "/generate") and is_tgi("GET", "/info") and is_tgi("GET", "/health")
    assert not is_tgi("GET", "/healthz") and not is_tgi("GET", "/metrics")
