"""The per-connection protocol without sockets: parsing, errors, exactly-once feeds."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgpack
import pytest

from wsinfer.commands import Admit, Admitted, StartTurn, Subscribe, TurnStarted
from wsinfer.contract import ClientMessageType, ErrorCode, TurnStatus
from wsinfer.errors import Conflict, Overloaded
from wsinfer.messages import Generate, JsonCodec, Limits, MsgpackCodec, Resume, SessionCommand
from wsinfer.protocol import ConnectionProtocol
from wsinfer.sessions.schema import (
    DeltaEvent,
    DoneEvent,
    GenerationParams,
    ParamsError,
    PausedEvent,
    TurnError,
    Usage,
)


def sent(proto: ConnectionProtocol) -> list[dict[str, Any]]:
    return [out.message for out in proto.data_to_send()]


def json_proto(**limits: Any) -> ConnectionProtocol:
    return ConnectionProtocol(JsonCodec(), Limits(**limits))


def test_generate_is_parsed_with_params() -> None:
    proto = json_proto()
    msg = proto.receive(
        json.dumps(
            {
                "type": "generate",
                "id": 7,
                "messages": [{"role": "user", "content": "hi"}],
                "params": {"temperature": 0, "max_new_tokens": 5, "stop": ["\n"]},
            }
        )
    )
    assert isinstance(msg, Generate)
    assert msg.id == 7 and msg.params.greedy and msg.params.stop == ("\n",)
    assert not msg.params.ignore_eos and "ignore_eos" not in msg.params.to_dict()


def test_ignore_eos_is_a_boolean_param_that_round_trips() -> None:
    params = GenerationParams.parse({"ignore_eos": True, "max_new_tokens": 9})
    assert params.ignore_eos and GenerationParams.from_dict(params.to_dict()) == params
    with pytest.raises(ParamsError, match="ignore_eos must be true or false"):
        GenerationParams.parse({"ignore_eos": 1})
    held = GenerationParams.parse({"min_tokens": 5, "max_new_tokens": 9})
    assert GenerationParams.from_dict(held.to_dict()) == held
    assert "min_tokens" not in GenerationParams().to_dict()
    with pytest.raises(ParamsError, match="min_tokens must not be above max_new_tokens"):
        GenerationParams.parse({"min_tokens": 300})  # the default max_new_tokens is 256


@pytest.mark.parametrize(
    ("frame", "code", "echo_id"),
    [
        ("{not json", "bad_request", None),
        ("[1, 2]", "bad_request", None),
        ('{"type": "dance", "id": "x"}', "bad_request", "x"),
        ('{"type": "generate", "id": 1}', "bad_request", 1),
        ('{"type": "generate", "prompt": "a", "messages": []}', "bad_request", None),
        ('{"type": "generate", "prompt": "a", "params": {"temp": 1}}', "bad_request", None),
        ('{"type": "generate", "prompt": "a", "params": {"top_p": 0}}', "bad_request", None),
        (
            '{"type": "generate", "prompt": "a", "params": {"max_new_tokens": 0}}',
            "bad_request",
            None,
        ),
        ('{"type": "generate", "prompt": "a", "session": "s"}', "bad_request", None),
        (
            '{"type": "generate", "messages": [{"role": "robot", "content": "x"}]}',
            "bad_request",
            None,
        ),
        ('{"type": "generate", "prompt": "a", "extra": 1}', "bad_request", None),
        ('{"type": "stop", "id": 3, "session": "s"}', "bad_request", 3),
        ('{"type": "generate", "prompt": "a", "idempotency_key": "short"}', "bad_request", None),
        (
            '{"type": "generate", "prompt": "a", "idempotency_key": 1234567890123456}',
            "bad_request",
            None,
        ),
        (
            '{"type": "generate", "prompt": "a", "idempotency_key": "' + "k" * 129 + '"}',
            "bad_request",
            None,
        ),
        (  # tools need a chat: a raw prompt has no template to tell them
            '{"type": "generate", "prompt": "a", "params": {"tools": '
            '[{"type": "function", "function": {"name": "f"}}]}}',
            "bad_request",
            None,
        ),
        (  # a tool result is a tool message's; a call is an assistant's
            '{"type": "generate", "messages": [{"role": "user", "content": "a", '
            '"tool_call_id": "c"}]}',
            "bad_request",
            None,
        ),
        (
            '{"type": "generate", "messages": [{"role": "assistant", "content": null, '
            '"tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "[]"}}]}]}',
            "bad_request",
            None,
        ),
        ('{"type": "resume", "session": "s", "token": "t", "after": -1}', "bad_request", None),
        ('{"type": "resume", "session": "s", "token": "t", "turn": 0}', "bad_request", None),
        ('{"type": "generate", "prompt": "' + "x" * 101 + '"}', "too_large", None),
        ('{"type": "stop", "session": "s", "token": "t", "id": 1.5}', "bad_request", None),
        ('{"type": "stop", "session": "s", "token": "t", "id": [1]}', "bad_request", None),
        ('{"type": "stop", "session": "s", "token": "t", "id": true}', "bad_request", None),
        (
            '{"type": "stop", "session": "s", "token": "t", "id": "' + "i" * 257 + '"}',
            "bad_request",
            None,
        ),
    ],
)
def test_bad_messages_get_an_error_and_the_connection_stays_usable(
    frame: str, code: str, echo_id: Any
) -> None:
    proto = json_proto(max_prompt_chars=100)
    assert proto.receive(frame) is None
    (error,) = sent(proto)
    assert error["type"] == "error" and error["code"] == code and error["message"]
    assert error.get("id") == echo_id
    ok = proto.receive('{"type": "stop", "session": "s", "token": "t"}')
    assert isinstance(ok, SessionCommand)


def test_the_character_cap_is_against_abuse_only_not_a_context_limit() -> None:
    # A long conversation (here 200,000 characters) reaches the engine, which
    # holds it to the model's context in tokens; only far beyond is it refused here.
    import json

    proto = json_proto()
    long = {"type": "generate", "messages": [{"role": "user", "content": "a" * 200_000}]}
    assert proto.receive(json.dumps(long)) is not None
    too_long = {"type": "generate", "prompt": "a" * 256_001}
    assert proto.receive(json.dumps(too_long)) is None
    (error,) = sent(proto)
    assert error["code"] == "too_large"


def test_an_idempotency_key_is_16_to_128_characters() -> None:
    proto = json_proto()
    for key in ("k" * 16, "k" * 128):
        msg = proto.receive(json.dumps({"type": "generate", "prompt": "a", "idempotency_key": key}))
        assert isinstance(msg, Generate) and msg.idempotency_key == key


def test_msgpack_codec_and_frame_kind_mismatch() -> None:
    proto = ConnectionProtocol(MsgpackCodec())
    msg = proto.receive(msgpack.packb({"type": "resume", "session": "s", "token": "t", "after": 4}))
    assert isinstance(msg, Resume) and msg.after == 4
    assert proto.receive("{}") is None
    assert sent(proto)[0]["code"] == "bad_request"
    assert proto.receive(b"\xc1") is None  # never-used msgpack byte
    frame = proto.data_to_send()[0].frame
    assert isinstance(frame, bytes) and msgpack.unpackb(frame)["code"] == "bad_request"


def test_accepted_then_deltas_are_sent_once_in_order() -> None:
    proto = json_proto()
    request = Generate("a", None, "hi", GenerationParams.parse(None))
    plan = proto.plan(request)
    assert plan.start() == Admit()
    assert plan.send(Admitted(frozenset({"e1"}))) == StartTurn(request, frozenset({"e1"}))
    started = TurnStarted("s1", "tok", 1, TurnStatus.QUEUED)
    assert plan.send(started) == Subscribe("s1", 1, "0-0")
    assert plan.send(None) is None
    proto.deliver("s1", 1, [DeltaEvent(1, "He", [1]), DeltaEvent(2, "llo", [2])])
    proto.deliver("s1", 1, [DeltaEvent(2, "llo", [2]), DeltaEvent(3, "!", [3])])  # dup of 2
    messages = sent(proto)
    assert messages[0] == {
        "type": "session",
        "session": "s1",
        "token": "tok",
        "turn": 1,
        "status": "queued",
        "id": "a",
    }
    # A lagging connection gets one merged delta per run.
    assert messages[1] == {"type": "delta", "session": "s1", "turn": 1, "seq": 3, "text": "Hello!"}


def test_deltas_without_text_advance_seq_but_send_nothing() -> None:
    proto = json_proto()
    proto.follow("s", 1, after=0)
    proto.deliver("s", 1, [DeltaEvent(1, "", [240])])
    assert sent(proto) == []
    proto.deliver("s", 1, [DeltaEvent(2, "é", [169])])
    assert sent(proto) == [{"type": "delta", "session": "s", "turn": 1, "seq": 2, "text": "é"}]


def entry(token: str) -> dict[str, Any]:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def test_logprobs_ride_with_their_text_held_back_and_merged() -> None:
    """Each delta carries the entries of its text's tokens: those of a token whose text
    was held back go out with the next text; merged deltas keep every entry, in order;
    a duplicate adds none."""
    proto = json_proto()
    proto.follow("s", 1, after=0)
    proto.deliver("s", 1, [DeltaEvent(1, "", [240], logprobs=[entry("\ufffd")])])
    assert sent(proto) == []
    proto.deliver("s", 1, [DeltaEvent(2, "é", [169], logprobs=[entry("\ufffd")])])
    (first,) = sent(proto)
    assert first["text"] == "é" and first["logprobs"] == [entry("\ufffd")] * 2
    proto.deliver(
        "s",
        1,
        [
            DeltaEvent(3, "a", [1], logprobs=[entry("a")]),
            DeltaEvent(3, "a", [1], logprobs=[entry("a")]),  # a duplicate
            DeltaEvent(4, "b", [2], logprobs=[entry("b")]),
            DeltaEvent(5, "c", [3], logprobs=[entry("c")]),
        ],
    )
    (merged,) = sent(proto)
    assert merged["text"] == "abc" and merged["seq"] == 5
    assert merged["logprobs"] == [entry("a"), entry("b"), entry("c")]
    proto.deliver("s", 1, [DeltaEvent(6, "d", [4])])  # a turn that did not ask: no key
    assert "logprobs" not in sent(proto)[0]


def part(index: int, piece: str, name: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index, "id": f"c_{index}", "function": {"arguments": piece}}
    if name is not None:
        out["type"], out["function"]["name"] = "function", name
    return out


def test_parts_of_calls_are_sent_each_in_its_own_delta_for_a_lagging_reader() -> None:
    """A delta that carries the parts of calls drawn reaches readers though it has no
    text, and is never merged with the deltas around it (the Responses door gives each
    its own event, numbered by its seq); the text around them still merges."""
    proto = json_proto()
    proto.follow("s", 1, after=0)
    call = {"index": 0, "id": "c_0", "type": "function",
            "function": {"name": "f", "arguments": '{"a": 1}'}}  # fmt: skip
    proto.deliver(
        "s",
        1,
        [
            DeltaEvent(1, "x", [1]),
            DeltaEvent(2, "y", [2]),
            DeltaEvent(3, "", [3]),  # held back: moves seq on only
            DeltaEvent(4, "", [4], tool_call_parts=[part(0, "", "f")]),
            DeltaEvent(5, "", [5], tool_call_parts=[part(0, '{"a": ')]),
            DeltaEvent(6, "", [6], tool_call_parts=[part(0, "1}")]),
            DeltaEvent(7, "", [7], tool_calls=[call], tool_call_parts=[part(0, "")]),
            DeltaEvent(8, "\n", [8]),
            DeltaEvent(9, "z", [9]),
        ],
    )
    messages = sent(proto)
    assert [(m["seq"], m["text"]) for m in messages] == [
        (2, "xy"), (4, ""), (5, ""), (6, ""), (7, ""), (9, "\nz"),
    ]  # fmt: skip
    assert [m.get("tool_call_parts") for m in messages[1:5]] == [
        [part(0, "", "f")], [part(0, '{"a": ')], [part(0, "1}")], [part(0, "")],
    ]  # fmt: skip
    assert messages[4]["tool_calls"] == [call]


def test_a_delta_with_parts_round_trips_and_an_unknown_field_is_left_out() -> None:
    """What the engine writes is what frontends read; a later engine's new field does
    not make this frontend's fan-in fail."""
    from wsinfer.sessions.schema import decode_event_payload, pack

    event = DeltaEvent(4, "", [4], raw='{"a"', tool_call_parts=[part(0, '{"a"', "f")])
    assert decode_event_payload(pack(event)) == event
    later = msgpack.unpackb(pack(event))
    later["from_a_later_engine"] = [1, 2]
    assert decode_event_payload(msgpack.packb(later)) == event


def test_resume_after_seq_skips_what_the_client_has() -> None:
    proto = json_proto()
    proto.follow("s", 2, after=2)
    proto.replay(
        "s",
        2,
        [
            DeltaEvent(1, "a"),
            DeltaEvent(2, "b"),
            PausedEvent(2),
            DeltaEvent(3, "c"),
            DoneEvent(3, "stop", Usage(4, 3, 0)),
        ],
    )
    messages = sent(proto)
    assert [m["type"] for m in messages] == ["delta", "done"]  # stale pause dropped
    assert messages[0]["text"] == "c" and messages[1]["usage"]["prompt_tokens"] == 4
    assert "s" not in proto.feeds  # done ends the feed
    proto.deliver("s", 2, [DeltaEvent(4, "late")])
    assert sent(proto) == []


def test_replay_of_a_paused_turn_reports_the_pause() -> None:
    proto = json_proto()
    proto.follow("s", 1, after=0)
    proto.replay("s", 1, [DeltaEvent(1, "a"), PausedEvent(1)])
    assert [m["type"] for m in sent(proto)] == ["delta", "paused"]


def test_following_again_restarts_the_feed_instead_of_doubling_it() -> None:
    proto = json_proto()
    proto.follow("s", 1, after=0)
    proto.deliver("s", 1, [DeltaEvent(1, "a"), DeltaEvent(2, "b")])
    sent(proto)
    proto.follow("s", 1, after=1)
    proto.deliver("s", 1, [DeltaEvent(2, "b"), DeltaEvent(3, "c")])
    assert sent(proto) == [{"type": "delta", "session": "s", "turn": 1, "seq": 3, "text": "bc"}]
    assert len(proto.feeds) == 1


def test_events_of_another_turn_are_ignored() -> None:
    proto = json_proto()
    proto.follow("s", 2, after=0)
    proto.deliver("s", 1, [DeltaEvent(1, "old")])
    assert sent(proto) == []


def test_done_with_error_carries_it() -> None:
    proto = json_proto()
    proto.follow("s", 1, after=0)
    proto.deliver("s", 1, [DoneEvent(0, "error", Usage(), TurnError(ErrorCode.TOO_LARGE, "m"))])
    (done,) = sent(proto)
    assert done["finish_reason"] == "error" and done["error"]["code"] == "too_large"


def test_fail_carries_retry_after_session_and_id() -> None:
    proto = json_proto()
    proto.fail(Overloaded("busy", retry_after=1.5), msg_id="q", session="s")
    proto.fail(Conflict("running"))
    first, second = sent(proto)
    assert first == {
        "type": "error",
        "code": "overloaded",
        "message": "busy",
        "session": "s",
        "retry_after": 1.5,
        "id": "q",
    }
    assert second["code"] == "conflict" and "id" not in second


def test_the_protocol_imports_no_redis() -> None:
    """Sans I/O means no I/O library either: errors.py once pulled in
    redis.asyncio (through the outage test), and with it the store."""
    code = (
        "import sys, wsinfer.protocol, wsinfer.commands, wsinfer.errors\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'websockets')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("wait", "retry_after"), [(1e-6, 0.001), (0.0421, 0.043), (0.05, 0.05)])
def test_a_request_too_fast_is_told_when_to_retry_never_at_once(
    wait: float, retry_after: float
) -> None:
    proto = json_proto()
    proto.too_fast(SessionCommand(ClientMessageType.STOP, 4, "s", "t"), wait)
    (error,) = sent(proto)
    assert (error["code"], error["retry_after"], error["id"]) == ("overloaded", retry_after, 4)
