"""Every rule of docs/protocol.md that decides what a request does, without
Redis or sockets: every client message in every turn state, followed or not.

``ModelStore`` plays the I/O layer's part (handlers.py) for one session. Its
turn moves by ``sessions.states.TRANSITIONS`` and the store's own control
candidates, the very table the Lua scripts are given, so these tests check
the protocol against the state machine Redis enforces, not against a copy.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import pytest

from wsinfer.commands import (
    Admit,
    Admitted,
    CloseSession,
    Command,
    Control,
    Controlled,
    Event,
    Lookup,
    ReadTurn,
    Refused,
    StartTurn,
    Subscribe,
    TurnFound,
    TurnRead,
    TurnStarted,
    Unsubscribe,
)
from wsinfer.contract import ClientMessageType, ErrorCode, ServerMessageType, TurnStatus
from wsinfer.errors import NotFound, StoreUnavailable, WsinferError
from wsinfer.messages import ClientMessage, Generate, JsonCodec, Resume, SessionCommand
from wsinfer.protocol import MAX_FOLLOWED_PER_CONNECTION, ConnectionProtocol
from wsinfer.sessions.schema import (
    DeltaEvent,
    DoneEvent,
    GenerationParams,
    PausedEvent,
    TurnEvent,
    Usage,
)
from wsinfer.sessions.states import (
    TRANSITIONS,
    Action,
    Effect,
    required_finish,
    store_candidates,
)

S, TOKEN, SEQ = "s", "tok", 3
KEY = "k" * 32


@dataclass
class ModelStore:
    """One session whose latest turn is ``status``, three tokens into it."""

    status: TurnStatus
    turn: int = 1
    flag: str = ""  # a stop/pause asked of the engine running the turn
    idem: dict[str, int] = field(default_factory=dict)  # idempotency key -> turn
    commands: list[Command] = field(default_factory=list)
    fail_on: type | None = None  # a command kind that raises an outage
    gone: bool = False  # closed or expired between the lookup and the read
    history: list[TurnEvent] = field(default_factory=list)  # the latest turn's stream
    finish: str = "stop"  # how a done turn ended (the meta's ``finish``)

    def __post_init__(self) -> None:
        self.history = [DeltaEvent(1, "a"), DeltaEvent(2, "b"), DeltaEvent(SEQ, "c")]
        if self.status is TurnStatus.PAUSED:
            self.history.append(PausedEvent(SEQ))
        if self.status is TurnStatus.DONE:
            self.history.append(DoneEvent(SEQ, self.finish, Usage(5, SEQ, 0)))

    def execute(self, command: Command) -> Event | None:
        self.commands.append(command)
        if self.fail_on is not None and isinstance(command, self.fail_on):
            raise StoreUnavailable("down", retry_after=1.0)
        if isinstance(command, Lookup):
            self._check(command.session, command.token)
            return TurnFound(self.turn, self.status, SEQ)
        if isinstance(command, Admit):
            return Admitted(frozenset({"engine"}))
        if isinstance(command, StartTurn):
            return self._start(command.request)
        if isinstance(command, Control):
            return self._control(command.action)
        if isinstance(command, ReadTurn):
            if self.gone:
                return TurnRead([], "0-0", found=False)
            if command.turn < self.turn:  # an earlier turn: it ended
                return TurnRead([DeltaEvent(1, "old"), DoneEvent(1, "stop")], "0-1")
            return TurnRead(list(self.history), "1-1")
        return None  # Subscribe, Unsubscribe, CloseSession

    def _check(self, session: str, token: str) -> None:
        if (session, token) != (S, TOKEN):
            raise NotFound("no such session (or wrong token)")

    def _start(self, request: Generate) -> Event:
        key = request.idempotency_key
        if key in self.idem:
            turn = self.idem[key]
            status = self.status if turn == self.turn else TurnStatus.DONE
            return TurnStarted(S, TOKEN, turn, status, repeat=True)
        if request.session is not None:
            assert request.token is not None
            self._check(request.session, request.token)
            if (self.status, Action.START) not in TRANSITIONS:
                return Refused(self.status.value)
            self.turn += 1
            self.history = []
        self.status, self.flag = TurnStatus.QUEUED, ""
        if key is not None:
            self.idem[key] = self.turn
        return TurnStarted(S, TOKEN, self.turn, self.status)

    def _control(self, action: ClientMessageType) -> Event:
        for act, effect in store_candidates(action):
            new = TRANSITIONS.get((self.status, act))
            finished = required_finish(act)
            if new is not None and (finished is None or finished.value == self.finish):
                self.flag = effect.flag
                self.status = new
                if effect is Effect.PAUSE:
                    self.history.append(PausedEvent(SEQ))
                if effect is Effect.CANCEL:
                    self.history.append(DoneEvent(SEQ, "cancelled", Usage(5, SEQ, 0)))
                return Controlled(self.status, SEQ)
        return Refused(self.status.value)

    def kinds(self) -> list[type]:
        return [type(c) for c in self.commands]


def drive(
    proto: ConnectionProtocol, message: ClientMessage, store: ModelStore
) -> WsinferError | None:
    """Run one request as handlers.py does; returns the error it was refused with."""
    plan = proto.plan(message)
    try:
        command = plan.start()
        while command is not None:
            try:
                event = store.execute(command)
            except WsinferError as exc:
                command = plan.throw(exc)
            else:
                command = plan.send(event)
    except WsinferError as exc:
        return exc
    return None


def sent(proto: ConnectionProtocol) -> list[dict[str, object]]:
    return [out.message for out in proto.data_to_send()]


def session_answer(turn: int, status: TurnStatus, msg_id: int) -> dict[str, object]:
    """The ``session`` message for turn ``turn`` of ``S``, answering request ``msg_id``."""
    return {
        "type": "session",
        "session": S,
        "token": TOKEN,
        "turn": turn,
        "status": status.value,
        "id": msg_id,
    }


def status_after_attach(status: TurnStatus) -> TurnStatus:
    """Attaching to a paused latest turn continues it: it is queued again."""
    return TurnStatus.QUEUED if status is TurnStatus.PAUSED else status


def message_for(kind: ClientMessageType, msg_id: int = 9) -> ClientMessage:
    if kind is ClientMessageType.GENERATE:
        return Generate(msg_id, None, "more", GenerationParams.parse(None), S, TOKEN)
    if kind in (ClientMessageType.RESUME, ClientMessageType.CONTINUE):
        return Resume(msg_id, S, TOKEN, after=1, type=kind)
    return SessionCommand(kind, msg_id, S, TOKEN)


def connection(store: ModelStore, following: bool) -> ConnectionProtocol:
    proto = ConnectionProtocol(JsonCodec())
    if following:
        proto.follow(S, store.turn, after=SEQ)
    return proto


# The statuses a session's latest turn can have (``new``: no turn, no session yet).
TURN_STATES = [status for status in TurnStatus if status is not TurnStatus.NEW]
EVERY_CASE = list(itertools.product(ClientMessageType, TURN_STATES, [False, True]))


@pytest.mark.parametrize(("kind", "status", "following"), EVERY_CASE)
def test_every_message_in_every_turn_state(
    kind: ClientMessageType, status: TurnStatus, following: bool
) -> None:
    store = ModelStore(status)
    proto = connection(store, following)
    error = drive(proto, message_for(kind), store)
    CHECKS[kind](store, proto, status, following, error)


def _check_generate(
    store: ModelStore, proto: ConnectionProtocol, status: TurnStatus, _: bool, error: object
) -> None:
    """One turn at a time: a new turn only after a done one; else conflict."""
    if status is not TurnStatus.DONE:
        assert isinstance(error, WsinferError) and error.code is ErrorCode.CONFLICT
        assert (store.turn, store.status) == (1, status)
        assert Subscribe not in store.kinds()
        return
    assert error is None
    (answer,) = sent(proto)
    assert answer == session_answer(2, TurnStatus.QUEUED, 9)
    assert proto.feeds[S].turn == 2 and proto.feeds[S].last_seq == 0
    assert store.commands[-1] == Subscribe(S, 2, "0-0")


def _check_stop(
    store: ModelStore, proto: ConnectionProtocol, status: TurnStatus, following: bool, error: object
) -> None:
    """A stop ends an unfinished turn (its engine stops a running one); stopping
    a done turn is a no-op; the requester follows the session either way."""
    assert error is None
    _check_attached_if_new(store, proto, following)
    if status is TurnStatus.DONE:
        assert Control not in store.kinds()
    elif status is TurnStatus.RUNNING:
        assert (store.status, store.flag) == (TurnStatus.RUNNING, "stop")
    else:
        assert store.status is TurnStatus.DONE


def _check_pause(
    store: ModelStore, proto: ConnectionProtocol, status: TurnStatus, following: bool, error: object
) -> None:
    """A pause halts an unfinished turn; a paused one answers ``paused`` again;
    a done one is a no-op."""
    assert error is None
    _check_attached_if_new(store, proto, following)
    out = sent(proto)
    if status is TurnStatus.PAUSED:
        assert Control not in store.kinds()
        # Once: by the replay that attached it, or told again to a follower.
        assert [m["type"] for m in out] == [ServerMessageType.PAUSED.value]
    elif status is TurnStatus.DONE:
        assert Control not in store.kinds()
    elif status is TurnStatus.RUNNING:
        assert (store.status, store.flag) == (TurnStatus.RUNNING, "pause")
    else:
        assert store.status is TurnStatus.PAUSED


def _check_attached_if_new(store: ModelStore, proto: ConnectionProtocol, following: bool) -> None:
    """stop/pause from a connection that does not follow the session attach it
    from the current seq: nothing is replayed but the turn's end or pause."""
    if following:
        assert ReadTurn not in store.kinds()
        return
    assert store.commands[1] == ReadTurn(S, 1, SEQ)
    for message in proto._outbox:
        assert message["type"] != "delta"


def _check_resume(
    store: ModelStore, proto: ConnectionProtocol, status: TurnStatus, following: bool, error: object
) -> None:
    """resume answers ``session`` with the turn's status, replays after ``after``
    and follows live; a paused latest turn continues (queued again)."""
    assert error is None
    out = sent(proto)
    assert out[0] == session_answer(1, status_after_attach(status), 9)
    assert (Control in store.kinds()) == (status is TurnStatus.PAUSED)
    assert out[1] == {"type": "delta", "session": S, "turn": 1, "seq": SEQ, "text": "bc"}
    # The pause this resume ended is not replayed: it is not paused now.
    assert "paused" not in [m["type"] for m in out]
    if status is TurnStatus.DONE:  # the replay ends with the done: nothing to follow
        assert out[-1]["type"] == "done" and S not in proto.feeds
        assert Subscribe not in store.kinds()
    else:
        assert store.commands[-1] == Subscribe(S, 1, "1-1") and len(proto.feeds) == 1


def _check_continue(
    store: ModelStore, proto: ConnectionProtocol, status: TurnStatus, following: bool, error: object
) -> None:
    """continue only extends a turn cut by length: any other (here: one not
    ended, or ended by itself) is a conflict, and nothing changes."""
    assert isinstance(error, WsinferError) and error.code is ErrorCode.CONFLICT
    assert (store.status, store.flag) == (status, "")
    assert Subscribe not in store.kinds() and sent(proto) == []


def test_continue_of_a_turn_cut_by_length_goes_on_with_it() -> None:
    store = ModelStore(TurnStatus.DONE, finish="length")
    proto = connection(store, following=False)
    assert drive(proto, message_for(ClientMessageType.CONTINUE), store) is None
    out = sent(proto)
    assert out[0] == session_answer(1, TurnStatus.QUEUED, 9)
    # The replay after 1: the text, but not the done the turn goes on past.
    assert [m["type"] for m in out] == ["session", "delta"] and out[1]["text"] == "bc"
    assert store.status is TurnStatus.QUEUED and store.commands[-1] == Subscribe(S, 1, "1-1")


def _check_close(
    store: ModelStore, proto: ConnectionProtocol, status: TurnStatus, following: bool, error: object
) -> None:
    """close deletes the session whatever its turn is doing; no answer."""
    assert error is None
    assert store.commands == [CloseSession(S, TOKEN), Unsubscribe(S)]
    assert S not in proto.feeds and sent(proto) == []


CHECKS = {
    ClientMessageType.GENERATE: _check_generate,
    ClientMessageType.STOP: _check_stop,
    ClientMessageType.PAUSE: _check_pause,
    ClientMessageType.RESUME: _check_resume,
    ClientMessageType.CONTINUE: _check_continue,
    ClientMessageType.CLOSE: _check_close,
}


@pytest.mark.parametrize(
    ("kind", "raced_to", "outcome"),
    [
        (ClientMessageType.STOP, TurnStatus.DONE, None),  # it ended meanwhile: no-op
        (ClientMessageType.PAUSE, TurnStatus.DONE, None),
        (ClientMessageType.PAUSE, TurnStatus.PAUSED, "paused"),  # the engine paused it first
    ],
)
def test_a_turn_that_moves_between_lookup_and_control(
    kind: ClientMessageType, raced_to: TurnStatus, outcome: str | None
) -> None:
    store = ModelStore(TurnStatus.RUNNING)
    proto = connection(store, following=True)
    lookup = store.execute

    def racing(command: Command) -> Event | None:
        event = lookup(command)
        if isinstance(command, Lookup):
            store.status = raced_to
        return event

    store.execute = racing  # type: ignore[method-assign]
    assert drive(proto, message_for(kind), store) is None
    assert [m["type"] for m in sent(proto)] == ([outcome] if outcome else [])


def test_a_stale_turn_refusal_is_a_conflict_for_nothing_else() -> None:
    """The store says the turn named is no longer the latest: it has ended."""
    store = ModelStore(TurnStatus.RUNNING)
    proto = connection(store, following=True)
    plan = proto.plan(message_for(ClientMessageType.PAUSE))
    assert isinstance(plan.start(), Lookup)
    assert isinstance(plan.send(TurnFound(1, TurnStatus.RUNNING, SEQ)), Control)
    assert plan.send(Refused("no longer the latest turn")) is None


def test_wrong_token_is_not_found_for_every_message() -> None:
    for kind in ClientMessageType:
        store = ModelStore(TurnStatus.RUNNING)
        proto = connection(store, following=False)
        bad = dataclasses.replace(message_for(kind), token="wrong")
        if kind is ClientMessageType.CLOSE:
            continue  # the store proves a close's token itself (CloseSession)
        error = drive(proto, bad, store)
        assert isinstance(error, WsinferError) and error.code is ErrorCode.NOT_FOUND, kind
        assert S not in proto.feeds


def test_resume_of_an_earlier_turn_replays_it_and_does_not_touch_the_latest() -> None:
    store = ModelStore(TurnStatus.PAUSED, turn=2)
    proto = connection(store, following=False)
    assert drive(proto, Resume(1, S, TOKEN, after=0, turn=1), store) is None
    assert Control not in store.kinds()
    assert sent(proto)[0]["status"] == "done"
    error = drive(proto, Resume(2, S, TOKEN, after=0, turn=3), store)
    assert isinstance(error, NotFound)


def test_an_outage_while_attaching_leaves_no_feed() -> None:
    store = ModelStore(TurnStatus.RUNNING, fail_on=ReadTurn)
    proto = connection(store, following=False)
    error = drive(proto, message_for(ClientMessageType.RESUME), store)
    assert isinstance(error, StoreUnavailable) and error.retry_after == 1.0
    assert S not in proto.feeds
    assert store.commands[-1] == Unsubscribe(S)


def test_a_session_gone_while_attaching_is_not_found_and_leaves_no_feed() -> None:
    store = ModelStore(TurnStatus.RUNNING, gone=True)
    proto = connection(store, following=False)
    error = drive(proto, message_for(ClientMessageType.RESUME), store)
    assert isinstance(error, NotFound)
    assert S not in proto.feeds
    assert store.commands[-1] == Unsubscribe(S)
    assert Subscribe not in store.kinds()


@pytest.mark.parametrize("kind", list(ClientMessageType))
def test_a_connection_follows_at_most_so_many_sessions(kind: ClientMessageType) -> None:
    store = ModelStore(TurnStatus.RUNNING)
    proto = ConnectionProtocol(JsonCodec())
    for i in range(MAX_FOLLOWED_PER_CONNECTION):
        proto.follow(f"other{i}", 1, after=0)
    error = drive(proto, message_for(kind), store)
    if kind is ClientMessageType.CLOSE:
        assert error is None  # closing never follows anything
    else:
        assert isinstance(error, WsinferError) and error.code is ErrorCode.OVERLOADED
    # A session already followed is not a new one: the limit does not apply.
    proto.follow(S, 1, after=0)
    proto.feeds.pop("other0")
    assert (
        drive(proto, message_for(ClientMessageType.RESUME), ModelStore(TurnStatus.RUNNING)) is None
    )


@pytest.mark.parametrize("status", TURN_STATES)
def test_a_repeated_generate_rejoins_its_turn_and_starts_nothing(status: TurnStatus) -> None:
    """The client lost the answer to a generate with an idempotency key: the
    repeat answers the same session, token and turn, with the turn's status,
    and replays it from the start (a paused one continues)."""
    store = ModelStore(TurnStatus.DONE)
    first = Generate(1, None, "hi", GenerationParams.parse(None), idempotency_key=KEY)
    assert drive(ConnectionProtocol(JsonCodec()), first, store) is None
    store.status, store.commands = status, []
    proto = ConnectionProtocol(JsonCodec())
    again = Generate(2, None, "hi", GenerationParams.parse(None), idempotency_key=KEY)
    assert drive(proto, again, store) is None
    out = sent(proto)
    assert out[0] == session_answer(1, status_after_attach(status), 2)
    assert out[1]["type"] == "delta" and out[1]["seq"] == SEQ and out[1]["text"] == "abc"
    assert "paused" not in [m["type"] for m in out]
    assert store.turn == 1
    assert ReadTurn(S, 1, 0) in store.commands


@pytest.mark.parametrize(
    ("history", "replayed"),
    [
        ([DeltaEvent(SEQ, "c"), PausedEvent(SEQ)], ["delta"]),  # the pause it ended
        # Paused again since the resume, by another client: that pause is current.
        ([DeltaEvent(SEQ, "c"), PausedEvent(SEQ), PausedEvent(SEQ)], ["delta", "paused"]),
        ([PausedEvent(SEQ), DeltaEvent(SEQ + 1, "d"), PausedEvent(SEQ + 1)], ["delta", "paused"]),
    ],
)
def test_a_resume_replays_no_pause_but_one_newer_than_itself(
    history: list[TurnEvent], replayed: list[str]
) -> None:
    store = ModelStore(TurnStatus.PAUSED)
    store.history = history
    proto = connection(store, following=False)
    assert drive(proto, Resume(1, S, TOKEN, after=SEQ - 1), store) is None
    assert [m["type"] for m in sent(proto)] == ["session", *replayed]
