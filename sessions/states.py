"""The turn state machine: every legal transition, and every client control
of a turn, in one place.

``CONTROL`` says, for each client ``stop``/``pause``/``resume`` and each status
a lookup can find the turn in, what happens: the store applies a transition
(with an effect), the requester is told the turn is paused again, or nothing
changes. The frontend's plan (``wsinfer/protocol.py``), the store's candidate
transitions and the client rows of ``TRANSITIONS`` are all read from it.

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
    done (finish_reason: length) --continue--> queued

``pause`` and ``stop`` of a *running* turn do not change the status: they set a
control flag that the engine running the turn acts on between decode steps,
after which the engine itself moves the turn on (``engine_pause``/``finish``).
A stop flag that meets the engine's own pause (the engine paused the turn for
being idle before it saw the flag) is applied in the same script: the turn
goes ``paused --stop--> done`` at once, so a stop is never lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from wsinfer.contract import ClientMessageType, FinishReason, TurnStatus
from wsinfer.sessions.schema import Control


class Action(str, Enum):
    START = "start"  # client: generate (a new turn)
    CLAIM = "claim"  # engine: take a queued turn, or a running one whose lease expired
    ENGINE_PAUSE = "engine_pause"  # engine: halted at the client's request or when idle
    FINISH = "finish"  # engine: the turn ended
    PAUSE = "pause"  # client: pause a turn that has not started running yet
    STOP = "stop"  # client: cancel a turn that is not running
    RESUME = "resume"  # client: continue a paused turn
    CONTINUE = "continue"  # client: extend a turn that ended by length
    REQUEST_PAUSE = "request_pause"  # client: ask the engine to pause a running turn
    REQUEST_STOP = "request_stop"  # client: ask the engine to stop a running turn
    RELEASE = "release"  # engine: hand a running turn back to the queue (drain on SIGTERM)


class Outcome(Enum):
    """What a client's ``stop``, ``pause`` or ``resume`` does, given the status
    its lookup found the turn in."""

    APPLY = "apply"  # the store moves the turn, or flags it for the engine running it
    REPORT_PAUSED = "report_paused"  # already paused: the requester is told so again
    NOTHING = "nothing"  # the turn is followed as it is (a done one's ``done`` was sent)
    REFUSE = "refuse"  # not in this status: a ``conflict``, and nothing changes


# An effect that sets the meta's ``control`` flag for the engine: this, then the flag.
FLAG_PREFIX = "control:"


class Effect(str, Enum):
    """What the store does to a turn a control applies to: the CONTROL script's
    effect codes (``scripts.py`` is rendered with these values)."""

    FLAG_STOP = FLAG_PREFIX + Control.STOP.value  # running: the engine stops it between steps
    FLAG_PAUSE = FLAG_PREFIX + Control.PAUSE.value  # running: the engine pauses it between steps
    CANCEL = "done_cancelled"  # not running: ended now, with a cancelled ``done``
    PAUSE = "paused"  # not yet running: paused before any engine takes it
    REQUEUE = "requeue"  # paused: queued again (the frontend writes the work item)

    @property
    def flag(self) -> Control:
        """The meta's ``control`` flag this effect sets for the engine (NONE: none)."""
        if not self.value.startswith(FLAG_PREFIX):
            return Control.NONE
        return Control(self.value.removeprefix(FLAG_PREFIX))


@dataclass(frozen=True)
class ControlRule:
    outcome: Outcome
    # With APPLY: the store's transition, what it does, and the status it leads to.
    action: Action | None = None
    effect: Effect | None = None
    leads_to: TurnStatus | None = None
    # Only a turn that ended so: the store checks it with the status, atomically
    # (the meta's ``finish``, which the engine's final publish records).
    finished: FinishReason | None = None


def _apply(
    action: Action, effect: Effect, leads_to: TurnStatus, finished: FinishReason | None = None
) -> ControlRule:
    return ControlRule(Outcome.APPLY, action, effect, leads_to, finished)


_M, _S = ClientMessageType, TurnStatus

# docs/protocol.md, "Messages" and "Clarifications": every client control of a
# turn, for every status its lookup can find. The frontend's plan reads the
# outcome; the store tries the APPLY rows' transitions, which are also the
# client rows of TRANSITIONS below; a test holds the docs' clarifications to it.
CONTROL: dict[tuple[ClientMessageType, TurnStatus], ControlRule] = {
    (_M.STOP, _S.QUEUED): _apply(Action.STOP, Effect.CANCEL, _S.DONE),
    (_M.STOP, _S.RUNNING): _apply(Action.REQUEST_STOP, Effect.FLAG_STOP, _S.RUNNING),
    (_M.STOP, _S.PAUSED): _apply(Action.STOP, Effect.CANCEL, _S.DONE),
    (_M.STOP, _S.DONE): ControlRule(Outcome.NOTHING),  # a no-op: it has ended
    (_M.PAUSE, _S.QUEUED): _apply(Action.PAUSE, Effect.PAUSE, _S.PAUSED),
    (_M.PAUSE, _S.RUNNING): _apply(Action.REQUEST_PAUSE, Effect.FLAG_PAUSE, _S.RUNNING),
    (_M.PAUSE, _S.PAUSED): ControlRule(Outcome.REPORT_PAUSED),
    (_M.PAUSE, _S.DONE): ControlRule(Outcome.NOTHING),
    (_M.RESUME, _S.QUEUED): ControlRule(Outcome.NOTHING),  # rejoined as it is
    (_M.RESUME, _S.RUNNING): ControlRule(Outcome.NOTHING),
    (_M.RESUME, _S.PAUSED): _apply(Action.RESUME, Effect.REQUEUE, _S.QUEUED),
    (_M.RESUME, _S.DONE): ControlRule(Outcome.NOTHING),  # its history is replayed
    (_M.CONTINUE, _S.QUEUED): ControlRule(Outcome.REFUSE),  # it has not ended
    (_M.CONTINUE, _S.RUNNING): ControlRule(Outcome.REFUSE),
    (_M.CONTINUE, _S.PAUSED): ControlRule(Outcome.REFUSE),  # resume it instead
    (_M.CONTINUE, _S.DONE): _apply(Action.CONTINUE, Effect.REQUEUE, _S.QUEUED, FinishReason.LENGTH),
}


def required_finish(action: Action) -> FinishReason | None:
    """How a turn must have ended for ``action`` (a row's ``finished``), if at all."""
    for rule in CONTROL.values():
        if rule.action is action and rule.finished is not None:
            return rule.finished
    return None


def store_candidates(message: ClientMessageType) -> list[tuple[Action, Effect]]:
    """The transitions the store tries for a control, in the table's order, each
    once: at most one allows the status the store finds (a test holds them
    disjoint), whatever the lookup saw."""
    out: list[tuple[Action, Effect]] = []
    for (msg, _), rule in CONTROL.items():
        candidate = (rule.action, rule.effect)
        if msg is message and rule.action and rule.effect and candidate not in out:
            out.append((rule.action, rule.effect))
    return out


TRANSITIONS: dict[tuple[TurnStatus, Action], TurnStatus] = {
    (_S.NEW, Action.START): _S.QUEUED,
    (_S.DONE, Action.START): _S.QUEUED,
    (_S.QUEUED, Action.CLAIM): _S.RUNNING,
    (_S.RUNNING, Action.CLAIM): _S.RUNNING,
    (_S.RUNNING, Action.ENGINE_PAUSE): _S.PAUSED,
    (_S.RUNNING, Action.FINISH): _S.DONE,
    (_S.RUNNING, Action.RELEASE): _S.QUEUED,
    # and the clients' controls, from the table above
    **{
        (status, rule.action): rule.leads_to
        for (_, status), rule in CONTROL.items()
        if rule.action is not None and rule.leads_to is not None
    },
}


class IllegalTransition(Exception):
    """An action is not allowed from the turn's current status."""

    def __init__(self, action: Action, current: str) -> None:
        super().__init__(f"cannot {action.value} a turn that is {current}")
        self.action = action
        self.current = current


def allowed_from(action: Action) -> list[TurnStatus]:
    return [state for (state, act) in TRANSITIONS if act is action]


def statuses_arg(statuses: list[TurnStatus]) -> str:
    """Statuses as a script receives them (``allowed_from``): comma-separated."""
    return ",".join(status.value for status in statuses)


def target(action: Action) -> TurnStatus:
    targets = {new for (_, act), new in TRANSITIONS.items() if act is action}
    (only,) = targets  # every action leads to exactly one status
    return only


def is_unfinished(status: str) -> bool:
    return status in (TurnStatus.QUEUED.value, TurnStatus.RUNNING.value, TurnStatus.PAUSED.value)
