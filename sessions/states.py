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


class Status(str, Enum):
    NEW = "new"  # no turn yet: the session does not exist
    QUEUED = "queued"  # waiting for an engine
    RUNNING = "running"  # an engine holds it under a lease
    PAUSED = "paused"  # halted; the engine may keep its KV cache
    DONE = "done"  # finished: stop, length, cancelled or error


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


TRANSITIONS: dict[tuple[Status, Action], Status] = {
    (Status.NEW, Action.START): Status.QUEUED,
    (Status.DONE, Action.START): Status.QUEUED,
    (Status.QUEUED, Action.CLAIM): Status.RUNNING,
    (Status.RUNNING, Action.CLAIM): Status.RUNNING,
    (Status.RUNNING, Action.ENGINE_PAUSE): Status.PAUSED,
    (Status.RUNNING, Action.FINISH): Status.DONE,
    (Status.QUEUED, Action.PAUSE): Status.PAUSED,
    (Status.QUEUED, Action.STOP): Status.DONE,
    (Status.PAUSED, Action.STOP): Status.DONE,
    (Status.PAUSED, Action.RESUME): Status.QUEUED,
    (Status.RUNNING, Action.REQUEST_PAUSE): Status.RUNNING,
    (Status.RUNNING, Action.REQUEST_STOP): Status.RUNNING,
    (Status.RUNNING, Action.RELEASE): Status.QUEUED,
}


class IllegalTransition(Exception):
    """An action is not allowed from the turn's current status."""

    def __init__(self, action: Action, current: str) -> None:
        super().__init__(f"cannot {action.value} a turn that is {current}")
        self.action = action
        self.current = current


def allowed_from(action: Action) -> list[Status]:
    return [state for (state, act) in TRANSITIONS if act is action]


def target(action: Action) -> Status:
    targets = {new for (_, act), new in TRANSITIONS.items() if act is action}
    (only,) = targets  # every action leads to exactly one status
    return only


def is_unfinished(status: str) -> bool:
    return status in (Status.QUEUED.value, Status.RUNNING.value, Status.PAUSED.value)
