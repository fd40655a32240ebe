"""``GET /v1/sessions/{id}/messages``: what each turn of a session asked and
answered, as the server holds it (real Redis, a real engine with the tiny model,
a real frontend over HTTP), and its refusals."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.stack import Client, joined, start_frontend
from wsinfer.http.session_history import _answer
from wsinfer.server import Frontend
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, PausedEvent

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]
PARAMS = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


def test_an_answer_is_every_delta_joined_with_its_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    events: list[Any] = [
        DeltaEvent(1, "a"),
        PausedEvent(1),
        DeltaEvent(3, "b", tool_calls=[call]),
        DoneEvent(3, "length"),
        DeltaEvent(5, "c"),  # continued past that end
    ]
    assert _answer(events) == {"role": "assistant", "content": "abc", "tool_calls": [call]}
    assert _answer([]) == {"role": "assistant", "content": ""}


@pytest.fixture
async def frontend(engine_stack: Any) -> AsyncIterator[Frontend]:
    frontend = await start_frontend(engine_stack.redis_url)
    yield frontend
    await frontend.stop()


@pytest.mark.slow
async def test_each_turn_gives_back_its_question_and_its_answer(frontend: Frontend) -> None:
    client = await Client.open(frontend.port)
    await client.send(type="generate", id=1, messages=HISTORY, params=PARAMS)
    first = await client.until("done")
    session, token = first[0]["session"], first[0]["token"]
    asked = [{"role": "user", "content": "And another?"}]
    await client.send(
        type="generate", id=2, session=session, token=token, messages=asked, params=PARAMS
    )
    second = await client.until("done")
    await client.close()

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{frontend.port}") as http:
        headers = {"X-Wsinfer-Token": token}
        body = (await http.get(f"/v1/sessions/{session}/messages", headers=headers)).json()
        assert body["session"] == session and "next_after_turn" not in body
        assert [t["turn"] for t in body["turns"]] == [1, 2]
        one, two = body["turns"]
        assert one["messages"] == HISTORY and two["messages"] == asked
        assert one["answer"] == {"role": "assistant", "content": joined(first)[0]}
        assert two["answer"]["content"] == joined(second)[0] != ""
        ends = [(t["status"], t["finish_reason"]) for t in body["turns"]]
        assert ends == [("done", "length")] * 2

        page = await http.get(f"/v1/sessions/{session}/messages?after_turn=1", headers=headers)
        assert [t["turn"] for t in page.json()["turns"]] == [2]

        # Refusals: a bad page, a wrong token, no token, an unknown session.
        bad = await http.get(f"/v1/sessions/{session}/messages?after_turn=-1", headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "after_turn"
        wrong = await http.get(f"/v1/sessions/{session}/messages", headers={"X-Wsinfer-Token": "x"})
        assert wrong.status_code in (401, 403, 404)
        assert (await http.get(f"/v1/sessions/{session}/messages")).status_code == 400
        unknown = await http.get("/v1/sessions/nosuch/messages", headers=headers)
        assert unknown.status_code == 404
        # A session's other routes are not hidden by this one.
        info = (await http.get(f"/v1/sessions/{session}", headers=headers)).json()
        assert info["turn"] == 2
