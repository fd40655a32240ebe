"""``GET /v1/sessions/{id}/messages``: a session's conversation as the server holds it.

A device that follows a session another one started (the chat's "continue
elsewhere") knows the answers, from each turn's log, but not the questions:
those are in each turn's input record, which the engine renders. This route
gives both back, turn by turn, so that such a device can show the whole
conversation. Every part of it is already kept for as long as the session
lives; nothing new is stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wsinfer.contract import TurnStatus
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, TurnEvent

if TYPE_CHECKING:
    from wsinfer.sessions.store import SessionStore

# Turns per answer: a long-lived session's history comes in pages (``next_after_turn``).
PAGE_TURNS = 100


async def session_messages(
    store: SessionStore, session: str, token: str, after_turn: int = 0
) -> dict[str, Any]:
    """The session's turns after ``after_turn``: what each asked and what it answered."""
    info = await store.info(session, token)
    last = min(info.turn, after_turn + PAGE_TURNS)
    turns = []
    for number in range(after_turn + 1, last + 1):
        _, asked = await store.turn_record(session, number)
        events, _ = await store.read_turn(session, number)
        turn: dict[str, Any] = {"turn": number}
        if asked is not None and asked.mode == "chat":
            turn["messages"] = asked.messages
        elif asked is not None:
            turn["prompt"] = asked.prompt
        turn["answer"] = _answer(events)
        turn["status"] = info.status if number == info.turn else TurnStatus.DONE.value
        if events and isinstance(events[-1], DoneEvent):
            turn["finish_reason"] = events[-1].finish_reason
        turns.append(turn)
    body: dict[str, Any] = {"session": session, "turns": turns}
    if last < info.turn:
        body["next_after_turn"] = last
    return body


def _answer(events: list[TurnEvent]) -> dict[str, Any]:
    """The assistant's message so far: every delta's text joined, and its calls."""
    deltas = [e for e in events if isinstance(e, DeltaEvent)]
    answer: dict[str, Any] = {"role": "assistant", "content": "".join(e.text for e in deltas)}
    calls = [call for e in deltas for call in e.tool_calls or ()]
    if calls:
        answer["tool_calls"] = calls
    return answer
