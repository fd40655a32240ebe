"""A model of the server's side of one turn, for the clients' model-based tests.

It speaks protocol v1 to one client (the Python ``ClientProtocol`` or the
browser client under node) over a wire whose every step is a separate action,
so a test can put any order on them: the engine appends tokens, the server
takes the next request, its feed delivers a run of entries merged into one
delta, the client reads the next message, the connection drops (whatever is in
flight is lost), a ``session`` answer arrives twice. What the server does is
the real frontend's rule (wsinfer/protocol.py): a ``resume`` (or a repeated
``generate``) is answered, then replayed from its ``after`` merged into one
delta, then the feed goes on live from there; ``seq`` counts tokens, and a
token whose text is held back advances ``seq`` without a delta.

The check after every step: the text the application was handed is exactly the
turn's text up to the seq the client has applied, and the client's own record
agrees with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from wsinfer.clients.protocol import (
    ClientProtocol,
    GenerateAnswered,
    TextDelta,
    TurnState,
    TurnUpdated,
)
from wsinfer.contract import ClientMessageType

Message = dict[str, Any]
SESSION, TOKEN, TURN = "s1", "k1", 1
DRIVER = Path(__file__).with_name("model_driver.mjs")
NODE = shutil.which("node")


class ClientUnderTest(Protocol):
    """The few things the model does to a client and reads back from it."""

    def start(self) -> list[Message]: ...
    def connect(self) -> list[Message]: ...
    def drop(self) -> None: ...
    def receive(self, msg: Message) -> list[Message]: ...
    def resume(self) -> list[Message]: ...
    def continue_(self) -> list[Message]: ...
    def tick(self) -> list[Message]: ...
    def state(self) -> dict[str, Any]: ...


# --- the server ---------------------------------------------------------------------


@dataclass
class Connection:
    up: list[Message] = field(default_factory=list)  # client -> server, not yet taken
    down: list[Message] = field(default_factory=list)  # server -> client, not yet read
    answers: list[Message] = field(default_factory=list)  # session answers sent here
    feed: int | None = None  # the feed's last seq, None when it follows nothing


@dataclass
class ModelServer:
    """One session with one turn; its log of token texts is the truth."""

    log: list[str] = field(default_factory=list)
    finished: bool = False
    keys: set[str] = field(default_factory=set)
    conn: Connection | None = None
    refuse_next_resume: bool = False
    # ``continue``s applied, and the log's length when the turn last ended: a
    # continued turn draws at least one token before it ends again.
    continues: int = 0
    ended_at: int = 0

    def text(self, upto: int) -> str:
        return "".join(self.log[:upto])

    def take_request(self) -> None:
        assert self.conn is not None and self.conn.up
        msg = self.conn.up.pop(0)
        kind = msg["type"]
        if kind == "generate":
            self._generate(msg)
        elif kind == "resume":
            self._resume(msg)
        elif kind == "continue":
            self._continue(msg)
        else:
            raise AssertionError(f"the model does not expect {kind}")

    def _generate(self, msg: Message) -> None:
        key = msg["idempotency_key"]
        repeat = bool(self.keys)
        assert not repeat or key in self.keys, "a second turn was started"
        self.keys.add(key)
        self._answer(msg["id"])
        self._attach(0)

    def _resume(self, msg: Message) -> None:
        assert msg["session"] == SESSION and msg["token"] == TOKEN
        assert msg.get("turn", TURN) == TURN
        if self.refuse_next_resume:
            self.refuse_next_resume = False
            self._send(
                {
                    "type": "error",
                    "code": "overloaded",
                    "message": "slow down",
                    "id": msg["id"],
                    "session": SESSION,
                    "retry_after": 0.01,
                }
            )
            return
        self._answer(msg["id"])
        self._attach(int(msg.get("after", 0)))

    def _continue(self, msg: Message) -> None:
        """Extend the ended turn, once (docs/protocol.md): a ``continue`` of a turn
        that has not ended is ``conflict``, and changes nothing."""
        assert msg["session"] == SESSION and msg["token"] == TOKEN
        if not self.finished:
            error = {"type": "error", "code": "conflict", "message": "not ended", "id": msg["id"]}
            self._send({**error, "session": SESSION})
            return
        self.finished = False
        self.continues += 1
        self._answer(msg["id"])
        self._attach(int(msg.get("after", 0)))

    def finish(self) -> None:
        self.finished = True
        self.ended_at = len(self.log)

    def _answer(self, msg_id: Any) -> None:
        status = "done" if self.finished else "running"
        answer = {
            "type": "session",
            "session": SESSION,
            "token": TOKEN,
            "turn": TURN,
            "status": status,
            "id": msg_id,
        }
        assert self.conn is not None
        self.conn.answers.append(answer)
        self._send(answer)

    def _attach(self, after: int) -> None:
        """Restart the feed after ``after``: the replay, merged, then live."""
        assert self.conn is not None
        self.conn.feed = after
        self.deliver(len(self.log))

    def deliver(self, upto: int) -> None:
        """The feed hands on entries up to ``upto`` as one merged delta (a lagging client)."""
        conn = self.conn
        if conn is None or conn.feed is None:
            return
        upto = min(upto, len(self.log))
        if upto > conn.feed:
            text = self.text(upto)[len(self.text(conn.feed)) :]
            if text:  # held-back tokens advance seq without a delta
                self._send(
                    {"type": "delta", "session": SESSION, "turn": TURN, "seq": upto, "text": text}
                )
            conn.feed = upto
        if self.finished and conn.feed == len(self.log):
            self._send(
                {
                    "type": "done",
                    "session": SESSION,
                    "turn": TURN,
                    "seq": len(self.log),
                    "finish_reason": "length",
                    "usage": {"completion_tokens": len(self.log)},
                }
            )
            conn.feed = None

    def repeat_answer(self, index: int) -> None:
        assert self.conn is not None and self.conn.answers
        self._send(dict(self.conn.answers[index % len(self.conn.answers)]))

    def _send(self, msg: Message) -> None:
        assert self.conn is not None
        self.conn.down.append(msg)


# --- the clients ----------------------------------------------------------------------


class PythonClient:
    """``ClientProtocol``: what the application sees is its ``TextDelta`` events."""

    def __init__(self) -> None:
        self.core = ClientProtocol()
        self.turn: TurnState | None = None
        self.seen: list[str] = []
        self.failed = False

    def start(self) -> list[Message]:
        self.core.generate(None, prompt="p")
        return []

    def connect(self) -> list[Message]:
        return self.core.connection_made()

    def drop(self) -> None:
        self.core.connection_lost()

    def receive(self, msg: Message) -> list[Message]:
        for event in self.core.receive(msg):
            if isinstance(event, GenerateAnswered):
                assert self.turn is None or self.turn is event.turn, "a second turn answered"
                self.turn = event.turn
            elif isinstance(event, TurnUpdated) and isinstance(event.event, TextDelta):
                self.seen.append(event.event.text)
            elif not isinstance(event, TurnUpdated):  # refused resume: the turn failed
                self.failed = True
        return self.core.data_to_send()

    def resume(self) -> list[Message]:
        if self.turn is not None and not self.turn.finished:
            self.core.control(self.turn, ClientMessageType.RESUME)
        return self.core.data_to_send()

    def continue_(self) -> list[Message]:
        assert self.turn is not None
        self.core.control(self.turn, ClientMessageType.CONTINUE)
        return self.core.data_to_send()

    def tick(self) -> list[Message]:
        return []

    def state(self) -> dict[str, Any]:
        turn = self.turn
        return {
            "seq": 0 if turn is None else turn.seq,
            "text": "" if turn is None else turn.text,
            "app_text": "".join(self.seen),
            "done": turn is not None and turn.done,
            "failed": self.failed,
            "connected": self.core.connected,
            "wants": not self.core.connected and self.core.wants_connection(),
        }


class NodeClient:
    """The browser client (clients/browser/wsinfer.js) in node, one command a line."""

    _proc: subprocess.Popen[str] | None = None

    @classmethod
    def process(cls) -> subprocess.Popen[str]:
        if cls._proc is None or cls._proc.poll() is not None:
            assert NODE is not None
            cls._proc = subprocess.Popen(
                [NODE, str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        return cls._proc

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def _call(self, command: str, msg: Message | None = None) -> list[Message]:
        proc = self.process()
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps({"cmd": command, "msg": msg}) + "\n")
        proc.stdin.flush()
        reply = json.loads(proc.stdout.readline())
        assert "error" not in reply, reply["error"]
        self._last = reply["state"]
        return list(reply["sent"])

    def start(self) -> list[Message]:
        return self._call("reset")

    def connect(self) -> list[Message]:
        return self._call("open")

    def drop(self) -> None:
        self._call("drop")

    def receive(self, msg: Message) -> list[Message]:
        return self._call("recv", msg)

    def resume(self) -> list[Message]:
        return self._call("resume")

    def continue_(self) -> list[Message]:
        return self._call("continue")

    def tick(self) -> list[Message]:
        return self._call("tick")

    def state(self) -> dict[str, Any]:
        return self._last
