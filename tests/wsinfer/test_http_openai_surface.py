"""The rest of the OpenAI surface on a real tiny-model ``wsinfer serve``: the model's
name, the penalties, ignored fields, OpenAI's tool-message rule, and a deleted
session's stream ending ``cancelled``."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.models import tiny_model_dir
from tests.stack import start_serve, stop_serve

pytestmark = pytest.mark.slow  # wsinfer serve processes

NAME = tiny_model_dir().name  # what the engine reports for a transformers directory
PROMPT = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    process, port = start_serve(tmp_path_factory.mktemp("serve"), "--model", str(tiny_model_dir()))
    yield port
    assert stop_serve(process) == 0


@pytest.fixture
async def http(port: int) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        yield client


def chat(**body: Any) -> dict[str, Any]:
    return {"messages": PROMPT, "temperature": 0, "max_tokens": 120, **body}


async def test_the_model_is_listed_by_its_name_and_the_old_name_still_answers(
    http: httpx.AsyncClient,
) -> None:
    listed = (await http.get("/v1/models")).json()["data"]
    assert [m["id"] for m in listed] == [NAME]
    assert (await http.get(f"/v1/models/{NAME}")).status_code == 200
    legacy = await http.get("/v1/models/wsinfer")  # the name clients were given before
    assert legacy.status_code == 200 and legacy.json()["id"] == NAME
    for model in (NAME, "wsinfer", None):
        answer = await http.post("/v1/chat/completions", json=chat(model=model, max_tokens=2))
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == NAME
    other = await http.post("/v1/chat/completions", json=chat(model="gpt-4"))
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


async def test_a_frequency_penalty_keeps_a_greedy_answer_from_repeating_its_tokens(
    http: httpx.AsyncClient,
) -> None:
    async def most_repeated(**body: Any) -> int:
        answer = await http.post(
            "/v1/completions",
            json={"prompt": "Once upon a time", "temperature": 0, "max_tokens": 150,
                  "ignore_eos": True, "logprobs": 0, **body},
        )  # fmt: skip
        assert answer.status_code == 200, answer.text
        tokens = answer.json()["choices"][0]["logprobs"]["tokens"]
        return max(Counter(tokens).values())

    assert await most_repeated() > 1
    assert await most_repeated(frequency_penalty=2.0) == 1
    assert await most_repeated(presence_penalty=2.0) == 1
    refused = await http.post("/v1/chat/completions", json=chat(frequency_penalty=3))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "frequency_penalty"


async def test_ignored_fields_are_named_in_a_header(http: httpx.AsyncClient) -> None:
    body = {"input": "Hi", "max_output_tokens": 2, "store": False, "user": "u"}
    response = await http.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-wsinfer-ignored-fields"] == "store, user"
    choices = await http.post("/v1/chat/completions", json=chat(n=2, max_tokens=2, store=True))
    assert choices.headers["x-wsinfer-ignored-fields"] == "store"
    one = await http.post("/v1/chat/completions", json=chat(max_tokens=2, user="u"))
    assert one.headers["x-wsinfer-ignored-fields"] == "user"
    text = {"prompt": "Hi", "max_tokens": 2, "service_tier": "auto"}
    completion = await http.post("/v1/completions", json=text)
    assert completion.headers["x-wsinfer-ignored-fields"] == "service_tier"
    plain = await http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2})
    assert "x-wsinfer-ignored-fields" not in plain.headers


async def test_a_tool_message_needs_its_call_id_on_the_openai_routes(
    http: httpx.AsyncClient,
) -> None:
    messages = [*PROMPT, {"role": "tool", "content": "sunny"}]
    refused = await http.post("/v1/chat/completions", json=chat(messages=messages))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[1].tool_call_id"


@pytest.mark.parametrize(("how", "reason"), [("delete", "cancelled"), ("stop", "stop")])
async def test_a_deleted_sessions_stream_ends_cancelled_a_stopped_ones_stop(
    http: httpx.AsyncClient, how: str, reason: str
) -> None:
    body = chat(max_tokens=4000, ignore_eos=True, stream=True)
    request = http.build_request("POST", "/v1/chat/completions", json=body)
    response = await http.send(request, stream=True)
    session, token = response.headers["x-wsinfer-session"], response.headers["x-wsinfer-token"]
    auth = {"X-Wsinfer-Token": token}
    reasons, acted = [], False
    async for line in response.aiter_lines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        reasons.append(choice["finish_reason"])
        if choice["delta"].get("content") and not acted:  # the turn is running: end it
            acted = True
            if how == "delete":
                ended = await http.delete(f"/v1/sessions/{session}", headers=auth)
            else:
                ended = await http.post(f"/v1/sessions/{session}/stop", headers=auth)
            assert ended.status_code == 200
    await response.aclose()
    assert acted and reasons[-1] == reason and reasons.count(None) == len(reasons) - 1
