"""The turn state machine: every legal transition, in one table.

A session's status is the status of its latest turn. Redis enforces the table
atomically: each Lua script in ``scripts.py`` receives the statuses an action
may start from (``allowed_from``) and the status it leads to (``target``), both
computed here, and refuses anything else. A refused action raises
``IllegalTransition``, which the frontend answers with the protocol's
``conflict``.

    (new) --start--> queued --claim--> running --finish--> done --start--> queued
                       |  ^--release-----+  ^ takeover        ^
                       |                 +--engine_pause--> paused --resume--> queued
                       +--pause------------------------------^  |
    queued/paused --stop--> done                              +--stop--> done

``pause`` and ``stop`` of a *running* turn do not change the status: they set a
control flag that the engine running the turn acts on between decode steps,
after which the engine itself moves the turn on (``engine_pause``/``finish``).
A stop flag that meets the engine's own pause (the engine paused the turn for
being idle before it saw the flag) is applied in the same script: the turn
goes ``paused --stop--> done`` at once, so a stop is never lost.
"""

from __future__ import annotations

from enum import Enum

from wsinfer.contract import TurnStatus


class Action(str, Enum):
    START = "start"  # client: generate (a new turn)
    CLAIM = "claim"  # engine: take a queued turn, or a running one whose lease expired
    ENGINE_PAUSE = "engine_pause"  # engine: halted at the client's request or when idle
    FINISH = "finish"  # engine: the turn ended
    PAUSE = "pause"  # client: pause a turn that has not started running yet
    STOP = "stop"  # client: cancel a turn that is not running
    RESUME = "resume"  # client: continue a paused turn
    REQUEST_PAUSE = "request_pause"  # client: ask the engine to pause a running turn
    REQUEST_STOP = "request_stop"  # client: ask the engine to stop a running turn
    RELEASE = "release"  # engine: hand a running turn back to the queue (drain on SIGTERM)


TRANSITIONS: dict[tuple[TurnStatus, Action], TurnStatus] = {
    (TurnStatus.NEW, Action.START): TurnStatus.QUEUED,
    (TurnStatus.DONE, Action.START): TurnStatus.QUEUED,
    (TurnStatus.QUEUED, Action.CLAIM): TurnStatus.RUNNING,
    (TurnStatus.RUNNING, Action.CLAIM): TurnStatus.RUNNING,
    (TurnStatus.RUNNING, Action.ENGINE_PAUSE): TurnStatus.PAUSED,
    (TurnStatus.RUNNING, Action.FINISH): TurnStatus.DONE,
    (TurnStatus.QUEUED, Action.PAUSE): TurnStatus.PAUSED,
    (TurnStatus.QUEUED, Action.STOP): TurnStatus.DONE,
    (TurnStatus.PAUSED, Action.STOP): TurnStatus.DONE,
    (TurnStatus.PAUSED, Action.RESUME): TurnStatus.QUEUED,
    (TurnStatus.RUNNING, Action.REQUEST_PAUSE): TurnStatus.RUNNING,
    (TurnStatus.RUNNING, Action.REQUEST_STOP): TurnStatus.RUNNING,
    (TurnStatus.RUNNING, Action.RELEASE): TurnStatus.QUEUED,
}


class IllegalTransition(Exception):
    """An action is not allowed from the turn's current status."""

    def __init__(self, action: Action, current: str) -> None:
        super().__init__(f"cannot {action.value} a turn that is {current}")
        self.action = action
        self.current = current


def allowed_from(action: Action) -> list[TurnStatus]:
    return [state for (state, act) in TRANSITIONS if act is action]


def target(action: Action) -> TurnStatus:
    targets = {new for (_, act), new in TRANSITIONS.items() if act is action}
    (only,) = targets  # every action leads to exactly one status
    return only


def is_unfinished(status: str) -> bool:
    return status in (TurnStatus.QUEUED.value, TurnStatus.RUNNING.value, TurnStatus.PAUSED.value)
