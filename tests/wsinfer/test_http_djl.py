"""DJL Serving's streaming predictions on a real ``wsinfer serve`` (the fake model),
read as DJL's docs read them (``requests.post(..., stream=True).iter_lines()``):
one prompt and a batch merged by iteration, a stream dropped and resumed by line
count over this door and over the v2 door, ``/ping``, every refusal. The dialect
alone, without sockets, at the end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.stack import start_serve, stop_serve
from wsinfer.http.counted import DoorError
from wsinfer.http.djl import DjlError, line, parse_djl_request
from wsinfer.http.djl_routes import _lines, is_djl
from wsinfer.http.openai import OpenAIError
from wsinfer.messages import Limits

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
RATE = 200  # tokens a second: a 60-token turn streams for 0.3 s, long enough to cut
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state: Path = tmp_path_factory.mktemp("serve")
    process, port = start_serve(state, "--model", f"fake:{RATE}", "--api-key", KEY)
    yield f"http://127.0.0.1:{port}"
    assert stop_serve(process) == 0


def predict(base: str, body: Any, path: str = "/predictions/wsinfer", **headers: str) -> Any:
    return requests.post(base + path, json=body, headers={**AUTH, **headers}, stream=True)


def lines_of(response: requests.Response, keep: int | None = None) -> list[list[str]]:
    out = []
    for raw in response.iter_lines():
        if raw:
            out.append(json.loads(raw)["output_tokens"])
            if keep is not None and len(out) == keep:
                break
    response.close()
    return out


def joined(lines: list[list[str]], index: int = 0) -> str:
    return "".join(tokens[index] for tokens in lines)


@pytest.mark.slow
def test_one_prompt_and_a_batch_merged_by_iteration(base: str) -> None:
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 12}}
    response = predict(base, body)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/jsonlines"
    assert response.headers["x-wsinfer-session"]
    one = lines_of(response)
    assert all(len(tokens) == 1 for tokens in one) and joined(one)
    assert joined(lines_of(predict(base, body, "/invocations"))) == joined(one)  # greedy

    batch = {"inputs": [PROMPT, "Far away", PROMPT], "parameters": {"max_new_tokens": 12}}
    response = predict(base, batch)
    sessions = response.headers["x-wsinfer-session"].split(", ")
    assert len(sessions) == 3 and len(set(sessions)) == 3
    assert response.headers["x-wsinfer-turn"] == "1, 1, 1"
    lines = lines_of(response)
    assert all(len(tokens) == 3 for tokens in lines)
    assert joined(lines, 0) == joined(lines, 2) == joined(one) and joined(lines, 1)
    short = {"inputs": [PROMPT, PROMPT], "parameters": {"max_new_tokens": 3}}
    assert all(len(tokens) == 2 for tokens in lines_of(predict(base, short)))

    sampled = {"do_sample": True, "manual_seed": 7, "top_k": 5, "max_new_tokens": 8}
    sampled["typical_p"] = 0.9
    twice = [joined(lines_of(predict(base, {"inputs": PROMPT, "parameters": sampled})))]
    twice.append(joined(lines_of(predict(base, {"inputs": PROMPT, "parameters": sampled}))))
    assert twice[0] == twice[1]  # seeded draws repeat

    ping = requests.get(base + "/ping", headers=AUTH)
    assert ping.status_code == 200 and ping.json() == {"status": "Healthy"}


@pytest.mark.slow
def test_a_dropped_batch_resumes_by_line_count_here_and_one_session_on_the_v2_door(
    base: str,
) -> None:
    batch = {"inputs": [PROMPT, "Far away"], "parameters": {"max_new_tokens": 60}}
    whole = lines_of(predict(base, batch))
    response = predict(base, batch)
    names = {k: response.headers[k] for k in ("x-wsinfer-session", "x-wsinfer-token")}
    first = lines_of(response, keep=5)
    rest = lines_of(predict(base, None, **names, **{"X-Wsinfer-Received": "5"}))
    # The same lines as the log's from the start (a line is a delta of each input,
    # how many tokens it holds is the engine's), and the same text as another run.
    again = lines_of(predict(base, None, **names, **{"X-Wsinfer-Received": "0"}))
    assert first + rest == again
    assert [joined(again, i) for i in (0, 1)] == [joined(whole, i) for i in (0, 1)]

    # One of the batch's sessions, by the same count, as a v2 stream.
    session, token = (v.split(", ")[1] for v in names.values())
    headers = {**AUTH, "X-Wsinfer-Session": session, "X-Wsinfer-Token": token}
    stream = requests.post(
        base + "/v2/models/wsinfer/generate_stream",
        headers={**headers, "Last-Event-ID": "5"},
    )
    datas = [json.loads(x[6:]) for x in stream.text.splitlines() if x.startswith("data: ")]
    texts = "".join(d["outputs"][0]["data"][0] for d in datas)
    assert joined(first, 1) + texts == joined(whole, 1)


@pytest.mark.slow
def test_refusals_are_djls_errors(base: str) -> None:
    good = {"inputs": PROMPT, "parameters": {"max_new_tokens": 4}}
    cases: list[tuple[str, Any, dict[str, str], int]] = [
        ("/predictions/gpt-4", good, {}, 404),
        ("/predictions/wsinfer", {"inputs": 3}, {}, 400),
        ("/predictions/wsinfer", {"inputs": []}, {}, 400),
        ("/predictions/wsinfer", {"inputs": [PROMPT] * 9}, {}, 400),
        ("/predictions/wsinfer", {**good, "frobnicate": 1}, {}, 400),
        ("/predictions/wsinfer", {"inputs": PROMPT, "parameters": {"top_p": 7}}, {}, 400),
        ("/predictions/wsinfer", {"inputs": PROMPT, "parameters": []}, {}, 400),
        ("/predictions/wsinfer", {"inputs": PROMPT, "parameters": {"do_sample": 1}}, {}, 400),
        ("/invocations", {"inputs": "x" * 2_000_000}, {}, 413),  # over the body limit
        ("/invocations", good, {"X-Wsinfer-Received": "1"}, 400),  # no session named
        ("/invocations", good, {"X-Wsinfer-Received": "-1"}, 400),
        ("/invocations", good, {"X-Wsinfer-Session": "a, b", "X-Wsinfer-Token": "t"}, 400),
    ]
    cases.append(("/invocations", {"inputs": PROMPT, "parameters": {"typical_p": 0}}, {}, 400))
    for path, body, headers, status in cases:
        answer = predict(base, body, path, **headers)
        assert answer.status_code == status, (path, body, answer.text[:200])
        if status != 413:  # the HTTP layer's own refusal, before any route
            error = answer.json()
            assert set(error) == {"code", "type", "message"} and error["code"] == status
    raw = requests.post(base + "/invocations", data=b"{nope", headers=AUTH)
    assert raw.status_code == 400 and raw.json()["type"] == "BadRequestException"
    assert requests.get(base + "/invocations", headers=AUTH).status_code == 405
    assert requests.post(base + "/invocations", json=good).status_code == 401
    wrong = {"X-Wsinfer-Session": "0" * 32, "X-Wsinfer-Token": "nope", "X-Wsinfer-Received": "1"}
    assert predict(base, None, **wrong).status_code == 404


# --- the dialect, without sockets -----------------------------------------------------------


def parse(data: Any, session: str | None = None) -> Any:
    return parse_djl_request(json.dumps(data).encode(), Limits(), session, session)


def test_parameters_as_djl_names_them_greedy_unless_sampling() -> None:
    one = parse({"inputs": "hi"}).generates
    assert len(one) == 1 and one[0].prompt == "hi" and one[0].params.temperature == 0.0
    params = {"max_new_tokens": 9, "manual_seed": 3, "top_k": 4, "repetition_penalty": 1.1}
    ask = parse({"inputs": ["a", "b"], "parameters": {**params, "do_sample": True}}).generates
    assert [g.prompt for g in ask] == ["a", "b"]
    assert [g.params.seed for g in ask] == [3, 4]  # each input draws as its own request
    assert ask[0].params.temperature == 1.0 and ask[0].params.max_new_tokens == 9
    assert (
        parse({"inputs": "a", "parameters": {"temperature": 0.5}}).generates[0].params.temperature
        == 0.0
    )  # Hugging Face: no do_sample, no sampling


@pytest.mark.parametrize(
    "data",
    [
        [1],
        {"inputs": None},
        {"inputs": ["a", 2]},
        {"inputs": "a", "parameters": {"stop": ["x"]}},  # not a DJL parameter
        {"inputs": "a", "parameters": {"max_new_tokens": 0}},
        {"inputs": "a", "parameters": {"manual_seed": "x"}},
    ],
)
def test_bad_bodies_are_400s(data: Any) -> None:
    with pytest.raises((OpenAIError, DjlError)) as caught:
        parse(data)
    error = caught.value
    refused = DjlError.from_openai(error) if isinstance(error, OpenAIError) else error
    assert refused.status == 400 and refused.body()["type"] == "BadRequestException"


def test_typical_p_reaches_the_sampler() -> None:
    body = {"inputs": "a", "parameters": {"typical_p": 0.9, "do_sample": True}}
    assert parse(body).generates[0].params.typical_p == 0.9
    assert parse({"inputs": "a", "parameters": {"typical_p": None}}).generates


def test_a_batch_cannot_continue_a_session() -> None:
    with pytest.raises(OpenAIError, match="batch"):
        parse({"inputs": ["a", "b"]}, session="s")


@settings(max_examples=200, deadline=None)  # under half a second: the fast tier
@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["inputs", "parameters", "max_new_tokens", "top_p", "do_sample",
                         "manual_seed", "typical_p", "x"]), inner, max_size=4),
    max_leaves=12,
))  # fmt: skip
def test_any_json_body_is_turns_or_a_400(data: Any) -> None:
    try:
        parse(data)
    except (OpenAIError, DoorError) as exc:
        assert exc.status == 400


class FakePeer:
    """Messages as a peer hands them over, one list per call."""

    def __init__(self, batches: list[list[Any]]) -> None:
        self.batches = batches

    async def messages(self, timeout: float) -> list[Any]:
        if self.batches:
            return self.batches.pop(0)
        await asyncio.sleep(3600)
        return []


def delta(text: str) -> dict[str, Any]:
    return {"type": "delta", "text": text}


async def test_lines_wait_for_every_input_and_pad_the_ended() -> None:
    done = {"type": "done", "finish_reason": "length"}
    peers: Any = [
        FakePeer([[delta("a"), delta("b")], [delta("c"), done]]),
        FakePeer([[delta("x")], [done]]),
    ]
    out = [chunk async for chunk in _lines(peers, [])]
    assert out == [line(["a", "x"]), line(["b", ""]), line(["c", ""])]
    error = {"type": "error", "code": "overloaded", "message": "full"}
    failed = [chunk async for chunk in _lines([FakePeer([[delta("a"), error]])], [])]  # type: ignore[list-item]
    assert json.loads(failed[-1]) == {
        "code": 429, "type": "ServiceUnavailableException", "message": "full",
    }  # fmt: skip


def test_only_djls_paths_leave_the_plain_routes() -> None:
    assert is_djl("/invocations") and is_djl("/predictions/x") and is_djl("/ping")
    assert not is_djl("/predictionsx") and not is_djl("/healthz")


@pytest.mark.slow
def test_a_v2_stream_resumes_as_djl_lines_by_the_same_count(base: str) -> None:
    tensor = {"name": "prompt", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}
    body = {"inputs": [tensor], "parameters": {"max_tokens": 60}}
    url = base + "/v2/models/wsinfer/generate_stream"
    texts: list[str] = []
    with requests.post(url, json=body, headers=AUTH, stream=True) as stream:
        names = {k: stream.headers[k] for k in ("x-wsinfer-session", "x-wsinfer-token")}
        for raw in stream.iter_lines():
            if raw.startswith(b"data: "):
                texts.append(json.loads(raw[6:])["outputs"][0]["data"][0])
                if len(texts) == 3:
                    break
    rest = lines_of(predict(base, None, "/invocations", **names, **{"X-Wsinfer-Received": "3"}))
    replayed = lines_of(predict(base, None, "/invocations", **names, **{"X-Wsinfer-Received": "0"}))
    assert [[t] for t in texts] + rest == replayed
