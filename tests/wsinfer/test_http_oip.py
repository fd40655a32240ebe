"""The Open Inference Protocol v2 REST door on a real ``wsinfer serve`` (the fake
model), driven by ``tritonclient``'s HTTP client (health, readiness, metadata,
``infer`` with a BYTES input, JSON and binary) and by ``httpx_sse.connect_sse``
as the MLServer docs stream; a stream dropped and resumed by event count over
this door, and by its seq over ``/v1/sessions/{id}/stream``; every refusal.
The dialect alone, without sockets, at the end."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from httpx_sse import connect_sse
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException

from tests.stack import start_serve, stop_serve
from wsinfer.http.counted import DoorError, position_after
from wsinfer.http.oip import OipError, OipTurn, parse_infer_request
from wsinfer.http.oip_routes import is_oip
from wsinfer.http.openai import OpenAIError
from wsinfer.http.peer import HttpPeer
from wsinfer.messages import Limits
from wsinfer.sessions.schema import DeltaEvent, DoneEvent

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
RATE = 200  # tokens a second: a 60-token turn streams for 0.3 s, long enough to cut
PROMPT = "Once upon a time"
MODEL = "wsinfer"


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    state: Path = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", f"fake:{RATE}", "--api-key", KEY)
    yield port
    assert stop_serve(process) == 0


@pytest.fixture
def http(serve: int) -> Iterator[httpx.Client]:
    base = f"http://127.0.0.1:{serve}"
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as client:
        yield client


def auth() -> dict[str, str]:
    """A fresh copy for each tritonclient call, which adds its own headers to it."""
    return dict(AUTH)


def request(prompt: str = PROMPT, name: str = "prompt", **parameters: Any) -> dict[str, Any]:
    """What MLServer's ``StringCodec.encode_input(name, [prompt], use_bytes=False)`` sends."""
    tensor = {"name": name, "shape": [1, 1], "datatype": "BYTES", "data": [prompt]}
    tensor["parameters"] = {"content_type": "str"}
    return {"inputs": [tensor], "parameters": parameters}


def text_of(response: dict[str, Any]) -> str:
    return "".join(response["outputs"][0]["data"])


# --- tritonclient -----------------------------------------------------------------------


@pytest.mark.slow
def test_tritonclient_health_metadata_and_infer(serve: int) -> None:
    client = triton.InferenceServerClient(url=f"127.0.0.1:{serve}")
    assert client.is_server_live(headers=auth()) and client.is_server_ready(headers=auth())
    assert client.is_model_ready(MODEL, headers=auth())
    assert not client.is_model_ready("gpt-4", headers=auth())
    metadata = client.get_model_metadata(MODEL, headers=auth())
    assert metadata["name"] == MODEL and {"prompt", "messages"} <= {
        i["name"] for i in metadata["inputs"]
    }
    assert client.get_server_metadata(headers=auth())["name"] == "wsinfer"

    texts = []
    for binary in (False, True):  # JSON data, and tritonclient's default, binary
        prompt = triton.InferInput("prompt", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=object), binary_data=binary)
        result = client.infer(MODEL, [prompt], headers=auth(), parameters={"max_tokens": 12})
        output = result.as_numpy("text_output")
        assert output is not None and output.shape == (1,)
        texts.append(output[0].decode() if isinstance(output[0], bytes) else output[0])
        response = result.get_response()
        assert response["parameters"]["finish_reason"] == "length"
        assert response["parameters"]["completion_tokens"] == 12
    assert texts[0] == texts[1] and texts[0]

    with pytest.raises(InferenceServerException, match="not found"):
        client.infer("gpt-4", [prompt], headers=auth())
    with pytest.raises(InferenceServerException, match="frobnicate"):
        client.infer(MODEL, [prompt], headers=auth(), parameters={"frobnicate": 1})
    client.close()


# --- MLServer's streaming request -------------------------------------------------------


def streamed(http: httpx.Client, body: dict[str, Any], path: str = "generate_stream") -> list[Any]:
    url = f"/v2/models/{MODEL}/{path}"
    with connect_sse(http, "POST", url, json=body) as source:
        assert source.response.headers["x-wsinfer-session"]
        return [(event.id, json.loads(event.data)) for event in source.iter_sse()]


@pytest.mark.slow
def test_generate_stream_as_mlserver_documents_it(http: httpx.Client) -> None:
    whole = http.post(f"/v2/models/{MODEL}/generate", json=request(max_tokens=20))
    assert whole.status_code == 200, whole.text
    text = text_of(whole.json())
    events = streamed(http, request(max_tokens=20))
    *deltas, last = events
    assert "".join(text_of(data) for _, data in deltas) == text
    assert [int(seq) for seq, _ in deltas] == list(range(1, len(deltas) + 1))
    assert last[1]["parameters"]["finish_reason"] == "length" and text_of(last[1]) == ""
    output = deltas[0][1]["outputs"][0]
    assert output["datatype"] == "BYTES" and output["shape"] == [1, 1]
    assert len({data["parameters"]["wsinfer_session"] for _, data in events}) == 1
    infer_stream = streamed(http, request(max_tokens=20), "infer_stream")
    assert "".join(text_of(data) for _, data in infer_stream) == text

    # text_input, the generate extension's name, and a chat as messages.
    assert text_of(http.post(f"/v2/models/{MODEL}/infer", json=request(
        name="text_input", max_tokens=20)).json()) == text  # fmt: skip
    chat = request(json.dumps({"role": "user", "content": "hi"}), name="messages", max_tokens=4)
    answer = http.post(f"/v2/models/{MODEL}/infer", json=chat)
    assert answer.status_code == 200 and text_of(answer.json())

    # Triton's generate extension, as TensorRT-LLM's docs curl it: no tensors.
    flat = {"text_input": PROMPT, "max_tokens": 20, "bad_words": "", "stop_words": ""}
    generated = http.post(f"/v2/models/{MODEL}/generate", json=flat).json()
    assert generated["text_output"] == text and generated["model_name"] == MODEL
    with connect_sse(http, "POST", f"/v2/models/{MODEL}/generate_stream", json=flat) as source:
        pieces = [json.loads(event.data)["text_output"] for event in source.iter_sse()]
    assert "".join(pieces) == text


@pytest.mark.slow
def test_a_dropped_stream_resumes_by_count_here_and_on_the_session_route(
    http: httpx.Client,
) -> None:
    text = text_of(http.post(f"/v2/models/{MODEL}/infer", json=request(max_tokens=60)).json())
    kept: list[Any] = []
    url = f"/v2/models/{MODEL}/generate_stream"
    with connect_sse(http, "POST", url, json=request(max_tokens=60)) as source:
        head = source.response.headers
        for event in source.iter_sse():
            kept.append(json.loads(event.data))
            if len(kept) == 5:
                break
    session, token = head["x-wsinfer-session"], head["x-wsinfer-token"]
    before = "".join(text_of(data) for data in kept)
    names = {"X-Wsinfer-Session": session, "X-Wsinfer-Token": token}

    rest = [d for _, d in streamed_with(http, url, {**names, "Last-Event-ID": "5"})]
    assert before + "".join(text_of(d) for d in rest) == text
    assert rest[-1]["parameters"]["finish_reason"] == "length"
    again = streamed_with(http, url, {**names, "X-Wsinfer-Received": "5"})
    assert [d for _, d in again] == rest  # the same events, numbered the same
    assert again[0][0] == "6"

    # Any door's resume by seq: the events carry it.
    seq = kept[-1]["parameters"]["wsinfer_seq"]
    query = f"?after={seq}&object=text_completion&session_token={token}"
    chunks = http.get(f"/v1/sessions/{session}/stream{query}").text
    lines = [line for line in chunks.splitlines() if line.startswith("data: {")]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert before + "".join(c["choices"][0]["text"] for c in datas if c["choices"]) == text

    for headers, status in [
        ({"Last-Event-ID": "3"}, 400),  # no session named
        ({**names, "X-Wsinfer-Token": "nope", "Last-Event-ID": "1"}, 404),
        ({**names, "Last-Event-ID": "x"}, 400),
        ({**names, "Last-Event-ID": "999"}, 200),  # past a finished turn: its end
    ]:
        answer = http.post(url, headers=headers)
        assert answer.status_code == status, (headers, answer.text)
        if status != 200:
            assert set(answer.json()) == {"error"}
    whole = http.post(f"/v2/models/{MODEL}/infer", headers={**names, "Last-Event-ID": "1"})
    assert whole.status_code == 400 and "stream" in whole.json()["error"]


def streamed_with(http: httpx.Client, url: str, headers: dict[str, str]) -> list[Any]:
    with connect_sse(http, "POST", url, headers=headers) as source:
        assert source.response.status_code == 200, source.response.read()
        return [(event.id, json.loads(event.data)) for event in source.iter_sse()]


@pytest.mark.slow
def test_refusals_are_the_protocols_errors(http: httpx.Client, serve: int) -> None:
    infer = f"/v2/models/{MODEL}/infer"
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("/v2/models/gpt-4/infer", {"json": request()}, 404),
        ("/v2/models/gpt-4/generate_stream", {"json": request()}, 404),
        (infer, {"content": b"{nope"}, 400),
        (infer, {"json": [1]}, 400),
        (infer, {"json": {"inputs": "hi"}}, 400),
        (infer, {"json": {**request(), "frobnicate": 1}}, 400),
        (infer, {"json": request(name="image")}, 400),
        (infer, {"json": request(temperature=9.0)}, 400),
        (infer, {"json": request(max_tokens=0)}, 400),
        (infer, {"json": request(max_tokens=3, max_new_tokens=4)}, 400),
        (infer, {"json": request("x" * 2_000_000)}, 413),  # over the body limit
        (infer, {"json": request("{", name="messages")}, 400),
    ]
    for path, body, status in cases:
        answer = http.post(path, **body)
        assert answer.status_code == status, (path, answer.text[:200])
        if status != 413:  # the HTTP layer's own refusal, before any route
            assert set(answer.json()) == {"error"} and isinstance(answer.json()["error"], str)
    assert http.get("/v2/models/gpt-4").status_code == 404
    assert http.get("/v2/models/gpt-4/ready").status_code == 404
    assert http.get(infer).status_code == 405
    assert http.get("/v2/nothing").status_code == 404
    with httpx.Client(base_url=str(http.base_url)) as keyless:
        assert keyless.get("/v2/health/live").status_code == 401
        assert keyless.post(infer, json=request()).status_code == 401


# --- the dialect, without sockets -----------------------------------------------------------


def parse(data: Any, length: str | None = None, raw: bytes | None = None) -> Any:
    body = raw if raw is not None else json.dumps(data).encode()
    return parse_infer_request(body, length, Limits(), None, None)


def binary(*strings: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(s)) + s for s in strings)


def test_the_generate_extensions_flat_body() -> None:
    ask = parse({"text_input": "hi", "max_tokens": 5, "parameters": {"temperature": 0}})
    assert ask.flat and ask.generate.prompt == "hi"
    assert (ask.generate.params.max_new_tokens, ask.generate.params.temperature) == (5, 0.0)
    for bad in (
        {"text_input": 3},
        {"text_input": "hi", "bad_words": ["x"]},
        {"text_input": "hi", "x": 1},
    ):
        with pytest.raises(OpenAIError):
            parse(bad)
    flat = OipTurn(MODEL, "s", 1, None, [1], flat=True)
    delta: Any = {"type": "delta", "session": "s", "turn": 1, "seq": 2, "text": " a"}
    assert flat.event(delta) == {
        "model_name": MODEL, "text_output": " a", "wsinfer_session": "s", "wsinfer_turn": 1,
        "wsinfer_seq": 2,
    }  # fmt: skip


def test_inputs_as_json_and_binary_tensors() -> None:
    assert parse(request()).generate.prompt == PROMPT
    params = parse(request(max_tokens=9, seed=3, stop=["\n"], top_k=4)).generate.params
    assert (params.max_new_tokens, params.seed, params.stop, params.top_k) == (9, 3, ("\n",), 4)
    assert parse(request(max_new_tokens=9, max_tokens=9)).generate.params.max_new_tokens == 9
    head = json.dumps({
        "inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES",
                    "parameters": {"binary_data_size": 4 + len(PROMPT)}}],
        "parameters": {"binary_data_output": True},
    }).encode()  # fmt: skip
    ask = parse(None, str(len(head)), head + binary(PROMPT.encode()))
    assert ask.generate.prompt == PROMPT and ask.shape == [1]
    chat = request(json.dumps({"role": "user", "content": "hi"}), name="messages")
    assert parse(chat).generate.messages[0]["content"] == "hi"


BAD_BODIES: list[tuple[Any, str | None, bytes | None]] = [
    ({**request(), "outputs": [{"name": "logits"}]}, None, None),
    ({"inputs": [{**request()["inputs"][0], "datatype": "FP32"}]}, None, None),
    ({"inputs": [{**request()["inputs"][0], "shape": [2]}]}, None, None),
    ({"inputs": [{**request()["inputs"][0], "data": [1]}]}, None, None),
    ({"inputs": [{**request()["inputs"][0], "shape": [-1]}]}, None, None),
    ({"inputs": [{**request()["inputs"][0], "parameters": {"content_type": "np"}}]}, None, None),
    ({"inputs": request()["inputs"] * 2}, None, None),
    ({"inputs": [{**request()["inputs"][0], "data": ["a", "b"], "shape": [2]}]}, None, None),
    (request(), "99999", None),  # a header longer than the body
    (None, "2", b"{}" + binary(b"\xff\xfe")),  # binary data, but no input says so
    (request(json.dumps(["a"]), name="messages"), None, None),  # not a message object
    ({**request(), "id": 7}, None, None),
    ({**request(), "parameters": []}, None, None),
]


@pytest.mark.parametrize(("data", "length", "raw"), BAD_BODIES)
def test_bad_bodies_are_400s_with_one_error_string(
    data: Any, length: str | None, raw: bytes | None
) -> None:
    with pytest.raises((OpenAIError, OipError)) as caught:
        parse(data, length, raw)
    error = caught.value
    refused = OipError.from_openai(error) if isinstance(error, OpenAIError) else error
    assert refused.status == 400 and set(refused.body()) == {"error"}


def test_binary_elements_cut_short_or_not_utf8_are_refused() -> None:
    for blob in (b"\x05\x00\x00\x00ab", b"\x01\x00", binary(b"\xff")):
        head = json.dumps({"inputs": [{"name": "prompt", "shape": [1], "datatype": "BYTES",
                           "parameters": {"binary_data_size": len(blob)}}]}).encode()  # fmt: skip
        with pytest.raises(OipError):
            parse(None, str(len(head)), head + blob)


@settings(max_examples=200, deadline=None)  # under half a second: the fast tier
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["inputs", "name", "shape", "datatype", "data", "parameters", "id",
                         "outputs", "max_tokens", "prompt", "x"]), inner, max_size=4),
    max_leaves=12,
))  # fmt: skip
def test_any_json_body_is_a_turn_or_a_400(data: Any) -> None:
    try:
        parse(data)
    except (OpenAIError, DoorError) as exc:
        assert exc.status == 400


def test_counts_map_to_the_seq_of_that_delta() -> None:
    events: list[Any] = [DeltaEvent(1, "a"), DeltaEvent(3, ""), DeltaEvent(4, "b c")]
    assert [position_after(events, n, OipError) for n in (0, 1, 2)] == [0, 1, 4]
    with pytest.raises(OipError):  # more than the running turn has sent
        position_after(events, 3, OipError)
    done = [*events, DoneEvent(5, "length")]
    assert position_after(done, 9, OipError) == 5


def test_responses_name_the_session_and_give_the_shape_back() -> None:
    turn = OipTurn(MODEL, "s", 2, None, [1, 1])
    delta: Any = {"type": "delta", "session": "s", "turn": 2, "seq": 7, "text": " a"}
    event = turn.event(delta)
    assert event["id"] == "s-2" and event["parameters"]["wsinfer_seq"] == 7
    assert event["outputs"][0] == {
        "name": "text_output", "shape": [1, 1], "datatype": "BYTES",
        "parameters": {"content_type": "str"}, "data": [" a"],
    }  # fmt: skip


def test_only_v2_paths_leave_the_plain_routes() -> None:
    assert is_oip("/v2") and is_oip("/v2/models/x/infer") and not is_oip("/v2x")
    assert not is_oip("/healthz") and not is_oip("/v1/models")


def test_a_counted_peer_sends_each_delta_whole_when_live_ones_meet_a_replay() -> None:
    """A live delta that reaches the peer before its replay is read is not merged
    into it: the reader's count of events stays the log's count of deltas (a
    merged one once made a later resume by count repeat text)."""
    frontend = SimpleNamespace(config=SimpleNamespace(limits=Limits()), store=None)
    peer = HttpPeer(cast(Any, frontend))
    peer.protocol.coalesce = False
    peer.protocol.follow("s", 1, after=1)
    peer.protocol.replay("s", 1, [DeltaEvent(2, "b"), DeltaEvent(3, ""), DeltaEvent(4, "c")])
    peer.on_events("s", 1)([DeltaEvent(5, "d"), DeltaEvent(4, "c")])  # (a repeat dropped)
    sent = asyncio.run(peer.messages(0))
    assert [(m["seq"], m["text"]) for m in sent if m["type"] == "delta"] == [
        (2, "b"), (4, "c"), (5, "d"),
    ]  # fmt: skip


@pytest.mark.slow
def test_the_session_routes_pause_resume_and_stop_a_v2_stream(http: httpx.Client) -> None:
    url = f"/v2/models/{MODEL}/generate_stream"
    datas: list[dict[str, Any]] = []
    paused = False
    with http.stream("POST", url, json=request(max_tokens=120, temperature=0)) as stream:
        session, token = stream.headers["x-wsinfer-session"], stream.headers["x-wsinfer-token"]
        control = {"X-Wsinfer-Token": token}
        for raw in stream.iter_lines():
            if raw.startswith(": paused"):
                paused = True
                assert http.post(f"/v1/sessions/{session}/resume", headers=control).is_success
            elif raw.startswith("data: "):
                datas.append(json.loads(raw[6:]))
                if len(datas) == 3:
                    answer = http.post(f"/v1/sessions/{session}/pause", headers=control)
                    assert answer.status_code in (200, 202), answer.text
    assert paused and datas[-1]["parameters"]["finish_reason"] == "length"
    assert datas[-1]["parameters"]["completion_tokens"] == 120
    again = http.post(f"/v2/models/{MODEL}/infer", json=request(max_tokens=120, temperature=0))
    whole = text_of(again.json())
    assert "".join(text_of(d) for d in datas) == whole  # greedy: the same text, paused or not

    with http.stream("POST", url, json=request(max_tokens=2000)) as stream:
        session, token = stream.headers["x-wsinfer-session"], stream.headers["x-wsinfer-token"]
        last: dict[str, Any] = {}
        stopped = False
        for raw in stream.iter_lines():
            if raw.startswith("data: "):
                last = json.loads(raw[6:])
                if not stopped and last["parameters"]["wsinfer_seq"] >= 3:
                    stopped = True
                    stop = http.post(
                        f"/v1/sessions/{session}/stop", headers={"X-Wsinfer-Token": token}
                    )
                    assert stop.status_code in (200, 202), stop.text
    assert last["parameters"]["finish_reason"] == "cancelled"
    assert last["parameters"]["completion_tokens"] < 2000
