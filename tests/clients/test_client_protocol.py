"""Sans-I/O parts of the client: turn state (dedup), the pending table and
resend policy of ClientProtocol, codecs, error mapping."""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack
import pytest

from wsinfer.clients import errors
from wsinfer.clients.client import ReconnectPolicy
from wsinfer.clients.codec import (
    Codec,
    DecodeError,
    codec_for_subprotocol,
    offered_subprotocols,
)
from wsinfer.clients.protocol import (
    ClientProtocol,
    GenerateAnswered,
    RequestFailed,
    TextDelta,
    TurnEnded,
    TurnFailed,
    TurnState,
    control_request,
    generate_request,
    parse_server_message,
)
from wsinfer.contract import ClientMessageType, TurnStatus


def delta(seq: int, text: str, turn: int = 1) -> dict[str, object]:
    return {"type": "delta", "session": "s", "turn": turn, "seq": seq, "text": text}


def test_replayed_deltas_are_applied_once() -> None:
    state = TurnState("s", "k", 1)
    for seq, text in [(1, "a"), (2, "b"), (2, "b"), (1, "a"), (4, "cd"), (3, "c"), (5, "e")]:
        state.apply(delta(seq, text))
    assert state.text == "abcde"
    assert state.seq == 5


def test_calls_drawn_grow_part_by_part_and_a_replay_adds_nothing() -> None:
    """``drawn_calls``: each call of a turn held to its calls as drawn so far; the
    delta completing it carries it whole in ``tool_calls`` too."""
    state = TurnState("s", "k", 1)
    first = {"index": 0, "id": "c_0", "type": "function",
             "function": {"name": "f", "arguments": '{"a'}}  # fmt: skip
    later = {"index": 0, "id": "c_0", "function": {"arguments": '": 1}'}}
    whole = {"index": 0, "id": "c_0", "type": "function",
             "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    log = [
        {**delta(2, ""), "tool_call_parts": [first]},
        {**delta(3, ""), "tool_call_parts": [later]},
        {**delta(4, ""), "tool_call_parts": [{**later, "function": {"arguments": ""}}],
         "tool_calls": [whole]},
    ]  # fmt: skip
    change = state.apply(log[0])
    assert isinstance(change, TextDelta) and change.tool_call_parts == (first,)
    assert state.drawn_calls[0]["function"] == {"name": "f", "arguments": '{"a'}
    for message in [*log, *log]:  # every delta twice: a replay after a resume
        state.apply(message)
    assert list(state.drawn_calls.values()) == [whole] == state.tool_calls


def test_apply_reports_only_changes() -> None:
    state = TurnState("s", "k", 1)
    assert state.apply(delta(1, "a")) == TextDelta("a", 1)
    assert state.apply(delta(1, "a")) is None


def test_other_turns_and_late_messages_are_ignored() -> None:
    state = TurnState("s", "k", 2)
    assert state.apply(delta(1, "old", turn=1)) is None
    state.apply(delta(1, "x", turn=2))
    done = {"type": "done", "turn": 2, "seq": 1, "finish_reason": "length", "usage": {}}
    event = state.apply(done)
    assert isinstance(event, TurnEnded) and event.error is None
    assert state.apply(delta(2, "late", turn=2)) is None
    assert state.apply({**done, "finish_reason": "stop"}) is None
    assert (state.text, state.finish_reason) == ("x", "length")


def test_paused_then_delta_clears_paused() -> None:
    state = TurnState("s", "k", 1)
    state.apply({"type": "paused", "turn": 1, "seq": 0})
    assert state.paused
    state.apply(delta(1, "a"))
    assert not state.paused


def test_done_with_error_maps_the_code() -> None:
    state = TurnState("s", "k", 1)
    state.apply(
        {
            "type": "done",
            "turn": 1,
            "seq": 0,
            "finish_reason": "error",
            "usage": {"prompt_tokens": 4, "completion_tokens": 0, "cached_tokens": 2},
            "error": {"code": "engine_unavailable", "message": "gone"},
        }
    )
    assert isinstance(state.error, errors.EngineUnavailable)
    assert state.usage is not None and state.usage.cached_tokens == 2


def test_unknown_turn_is_adopted_from_the_first_message() -> None:
    state = TurnState("s", "k", -1, seq=3)
    state.apply(delta(3, "seen", turn=7))
    state.apply(delta(4, "new", turn=7))
    assert (state.turn, state.text) == (7, "new")


@pytest.mark.parametrize(
    ("code", "cls", "family"),
    [
        ("bad_request", errors.BadRequest, errors.RequestError),
        ("unauthorized", errors.Unauthorized, errors.RequestError),
        ("not_found", errors.NotFound, errors.RequestError),
        ("conflict", errors.Conflict, errors.RequestError),
        ("too_large", errors.TooLarge, errors.RequestError),
        ("overloaded", errors.Overloaded, errors.ServerError),
        ("engine_unavailable", errors.EngineUnavailable, errors.ServerError),
        ("internal", errors.InternalError, errors.ServerError),
    ],
)
def test_every_protocol_code_has_its_exception(
    code: str, cls: type[errors.WsinferError], family: type[errors.WsinferError]
) -> None:
    exc = errors.error_from_wire({"code": code, "message": "m", "retry_after": 2, "session": "s"})
    assert type(exc) is cls and isinstance(exc, family)
    assert (exc.code, exc.message, exc.retry_after, exc.session) == (code, "m", 2, "s")


def test_unknown_code_still_raises_as_base_class() -> None:
    exc = errors.error_from_wire({"code": "brand_new", "message": "?"})
    assert type(exc) is errors.WsinferError and exc.code == "brand_new"
    assert str(exc) == "brand_new: ?"


@pytest.mark.parametrize("name", ["json", "msgpack"])
def test_codec_round_trip(name: str) -> None:
    codec = Codec(name)  # type: ignore[arg-type]
    msg = {"type": "delta", "text": "héllo ✓", "seq": 3}
    frame = codec.encode(msg)
    assert isinstance(frame, str if name == "json" else bytes)
    assert codec.decode(frame) == msg


def test_codec_decodes_by_frame_type() -> None:
    codec = Codec("msgpack")
    assert codec.decode(json.dumps({"type": "x"})) == {"type": "x"}
    assert Codec("json").decode(msgpack.packb({"type": "y"})) == {"type": "y"}
    with pytest.raises(DecodeError):
        codec.decode("[1, 2]")
    with pytest.raises(DecodeError):
        codec.decode(b"\xc1")


def test_subprotocol_negotiation_helpers() -> None:
    assert offered_subprotocols("msgpack") == ["wsinfer.v1.msgpack", "wsinfer.v1.json"]
    assert offered_subprotocols("json") == ["wsinfer.v1.json", "wsinfer.v1.msgpack"]
    assert codec_for_subprotocol(None).name == "json"  # no subprotocol means JSON
    assert codec_for_subprotocol("wsinfer.v1.msgpack").name == "msgpack"


def test_request_builders() -> None:
    msg = generate_request(prompt="hi", params={"temperature": 0})
    assert msg == {"type": "generate", "prompt": "hi", "params": {"temperature": 0}}
    msg = generate_request(messages=[{"role": "user", "content": "x"}], session="s", token="t")
    assert msg["session"] == "s" and msg["token"] == "t" and "prompt" not in msg
    with pytest.raises(ValueError):
        generate_request()
    with pytest.raises(ValueError):
        generate_request(prompt="a", messages=[])
    with pytest.raises(ValueError):
        generate_request(prompt="a", session="s")
    assert control_request("resume", "s", "t", after=4) == {
        "type": "resume",
        "session": "s",
        "token": "t",
        "after": 4,
    }


def test_backoff_grows_with_jitter_and_is_capped() -> None:
    policy = ReconnectPolicy(base_delay=0.1, max_delay=2.0)
    for attempt in range(12):
        step = min(2.0, 0.1 * 2**attempt)
        delays = {policy.delay(attempt) for _ in range(20)}
        assert all(step / 2 <= d <= step for d in delays)
        assert len(delays) > 1  # jittered


# --- ClientProtocol: the table of pending requests and the resend policy ----------


def _started(core: ClientProtocol, msg: dict[str, Any], status: str = "running") -> TurnState:
    answer = {"type": "session", "id": msg["id"], "session": "s1", "token": "k", "turn": 1}
    [event] = core.receive({**answer, "status": status})
    assert isinstance(event, GenerateAnswered) and event.waiter == "caller"
    return event.turn


def test_requests_made_offline_wait_for_the_connection() -> None:
    core = ClientProtocol()
    msg = core.generate("caller", prompt="hi")
    assert core.data_to_send() == [] and core.wants_connection()
    assert core.connection_made() == [msg]
    assert re.fullmatch(r"[0-9a-f]{32}", msg["idempotency_key"])


def test_an_unanswered_generate_is_resent_unchanged_after_a_drop() -> None:
    core = ClientProtocol()
    core.connection_made()
    msg = core.generate("caller", prompt="hi")
    assert core.data_to_send() == [msg]
    assert core.connection_lost() == []
    assert core.connection_made() == [msg]  # same id, same idempotency key
    turn = _started(core, msg)
    core.connection_lost()
    assert [m["type"] for m in core.connection_made()] == ["resume"]
    assert turn.following


def test_without_reconnect_a_drop_fails_what_waits() -> None:
    core = ClientProtocol(reconnect=False)
    core.connection_made()
    core.generate("caller", prompt="hi")
    [refused] = core.connection_lost()
    assert isinstance(refused, RequestFailed) and refused.waiter == "caller"
    assert isinstance(refused.error, errors.ConnectionLost)
    assert refused.error.code == "connection_lost"


def test_rejoin_repeats_stop_then_resume_then_pause() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = _started(core, core.generate("caller", prompt="hi"))
    core.receive({"type": "delta", "session": "s1", "turn": 1, "seq": 3, "text": "abc"})
    core.control(turn, ClientMessageType.PAUSE, "pause-ack")
    core.data_to_send()
    core.connection_lost()
    resent = core.connection_made()
    assert [(m["type"], m.get("after")) for m in resent] == [("resume", 3), ("pause", None)]
    core.control(turn, ClientMessageType.STOP, "stop-ack")
    core.connection_lost()
    assert [m["type"] for m in core.connection_made()] == ["stop", "resume"]


def test_a_confirmed_pause_is_not_resumed_by_a_reconnect() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = _started(core, core.generate("caller", prompt="hi"))
    core.control(turn, ClientMessageType.PAUSE)
    core.receive({"type": "paused", "session": "s1", "turn": 1, "seq": 0})
    assert turn.paused and not turn.live and not core.wants_connection()
    core.connection_lost()
    assert core.connection_made() == []


def test_status_comes_from_the_session_answer() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = _started(core, core.generate("caller", prompt="hi"), status="queued")
    assert turn.status is TurnStatus.QUEUED
    core.receive({"type": "delta", "session": "s1", "turn": 1, "seq": 1, "text": "a"})
    assert turn.status is TurnStatus.RUNNING


def test_a_refused_resume_fails_the_turn() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = core.attach("s9", "k", None, 0)
    core.control(turn, ClientMessageType.RESUME, "ack")
    [resume] = core.data_to_send()
    events = core.receive({"type": "error", "id": resume["id"], "code": "not_found"})
    assert [type(e) for e in events] == [RequestFailed, TurnFailed]
    assert turn.finished and "s9" not in core.turns


def _ended_by_length(core: ClientProtocol) -> TurnState:
    turn = _started(core, core.generate("caller", prompt="hi"))
    core.data_to_send()
    core.receive({"type": "delta", "session": "s1", "turn": 1, "seq": 2, "text": "ab"})
    done = {"type": "done", "session": "s1", "turn": 1, "seq": 3, "finish_reason": "length"}
    core.receive({**done, "usage": {"completion_tokens": 3}})
    assert turn.done and "s1" not in core.turns
    return turn


def _replayed_end(seq: int = 3) -> dict[str, Any]:
    done = {"type": "done", "session": "s1", "turn": 1, "seq": seq, "finish_reason": "length"}
    return {**done, "usage": {"completion_tokens": seq}}


def test_a_continue_lost_with_its_connection_is_sent_again_after_the_replay_says_so() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = _ended_by_length(core)
    core.control(turn, ClientMessageType.CONTINUE, "ack")
    assert [m["type"] for m in core.data_to_send()] == ["continue"]
    assert turn.live and not turn.done  # followed again at once
    core.connection_lost()
    [resume] = core.connection_made()  # re-joined: not a blind second continue
    assert (resume["type"], resume["after"]) == ("resume", 2)
    core.receive({"type": "session", "id": resume["id"], "session": "s1", "token": "k1",
                  "turn": 1, "status": "done"})  # fmt: skip
    assert core.receive(_replayed_end()) == []  # the very end it went on from: not applied
    [again] = core.data_to_send()
    assert again["type"] == "continue" and not turn.done
    # A conflict now means the first was applied meanwhile: follow the turn.
    assert core.receive({"type": "error", "id": again["id"], "code": "conflict"}) == []
    [follow] = core.data_to_send()
    assert follow["type"] == "resume" and turn.continued is None


def test_a_continue_applied_before_the_drop_is_not_applied_twice() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = _ended_by_length(core)
    core.control(turn, ClientMessageType.CONTINUE, "ack")
    core.data_to_send()
    core.connection_lost()
    [resume] = core.connection_made()
    core.receive({"type": "session", "id": resume["id"], "session": "s1", "token": "k1",
                  "turn": 1, "status": "done"})  # fmt: skip
    core.receive({"type": "delta", "session": "s1", "turn": 1, "seq": 5, "text": "cd"})
    core.receive(_replayed_end(6))  # applied, and finished while we were away
    assert core.data_to_send() == [] and turn.done and turn.text == "abcd"


def test_a_refused_continue_leaves_the_turn_as_it_ended() -> None:
    core = ClientProtocol()
    core.connection_made()
    turn = _ended_by_length(core)
    core.control(turn, ClientMessageType.CONTINUE, "ack")
    [sent] = core.data_to_send()
    [refused] = core.receive({"type": "error", "id": sent["id"], "code": "conflict"})
    assert isinstance(refused, RequestFailed) and refused.waiter == "ack"
    assert turn.done and turn.finish_reason == "length" and turn.status is TurnStatus.DONE
    assert not turn.live and turn.failure is None and not core.wants_connection()


def test_close_is_kept_until_it_can_be_sent() -> None:
    core = ClientProtocol()
    core.tokens["s1"] = "k"
    core.close_session("s1")
    assert core.wants_connection()
    assert core.connection_made() == [{"type": "close", "session": "s1", "token": "k"}]


def test_every_message_the_server_builds_passes_the_clients_check() -> None:
    from wsinfer import messages
    from wsinfer.contract import ErrorCode
    from wsinfer.sessions.schema import DoneEvent, TurnError, Usage

    failed = DoneEvent(3, "error", Usage(1, 3), TurnError(ErrorCode.INTERNAL, "m"))
    built = [
        messages.session_message("s", "k", 1, TurnStatus.QUEUED, 7),
        messages.delta_message("s", 1, 2, "ab", [{"token": "a"}], [{"index": 0}]),
        messages.paused_message("s", 1, 2),
        messages.done_message("s", 1, failed),
        messages.error_message(ErrorCode.OVERLOADED, "m", msg_id="x", retry_after=1.5),
    ]
    for message in built:
        assert parse_server_message(message) is message


@pytest.mark.parametrize(
    "message",
    [
        {"type": "delta", "session": "s", "turn": 1, "seq": "2", "text": "a"},
        {"type": "delta", "session": "s", "seq": 2, "text": "a"},
        {"type": "paused", "session": "s", "turn": True, "seq": 2},
        {"type": "done", "session": "s", "turn": 1, "seq": 2, "finish_reason": "stop"},
        {"type": "session", "id": 1, "session": "s", "turn": 1},
        {"type": "error", "id": 1.5, "code": "internal", "message": "m"},
    ],
)
def test_a_malformed_server_message_is_refused_at_the_edge(message: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        parse_server_message(message)
    with pytest.raises(ValueError):
        ClientProtocol().receive(message)


def test_a_message_type_this_client_does_not_know_is_ignored() -> None:
    assert parse_server_message({"type": "hint", "text": "?"}) is None
    assert ClientProtocol().receive({"type": "hint"}) == []
