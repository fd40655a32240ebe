"""The one control table (``sessions/states.py``) and what is generated from it:
complete, consistent with the state machine, and the only place its values are
spelt (the Lua scripts are rendered from it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wsinfer.contract import CONTROL_ANSWERS, ClientMessageType, ServerMessageType, TurnStatus
from wsinfer.sessions import scripts
from wsinfer.sessions.schema import Control
from wsinfer.sessions.states import (
    CONTROL,
    TRANSITIONS,
    Effect,
    Outcome,
    allowed_from,
    store_candidates,
)

CONTROLS = (ClientMessageType.STOP, ClientMessageType.PAUSE, ClientMessageType.RESUME)
LOOKED_UP = [s for s in TurnStatus if s is not TurnStatus.NEW]  # a lookup finds a turn


@pytest.mark.parametrize("message", CONTROLS)
def test_every_control_has_a_rule_for_every_status_a_lookup_finds(
    message: ClientMessageType,
) -> None:
    assert {status for (msg, status) in CONTROL if msg is message} == set(LOOKED_UP)
    assert message in CONTROL_ANSWERS


@pytest.mark.parametrize(("message", "status"), sorted(CONTROL, key=str))
def test_a_rule_applies_exactly_where_its_transition_moves_the_turn(
    message: ClientMessageType, status: TurnStatus
) -> None:
    rule = CONTROL[(message, status)]
    applies = rule.outcome is Outcome.APPLY
    assert applies == (rule.action is not None and rule.effect is not None)
    if applies:
        assert rule.action is not None
        assert TRANSITIONS[(status, rule.action)] is rule.leads_to
    # The store, which sees the status as it is then, finds this rule's move and no other.
    moves = [(a, e) for a, e in store_candidates(message) if status in allowed_from(a)]
    assert moves == ([(rule.action, rule.effect)] if applies else [])


def test_the_docs_clarifications() -> None:
    """docs/protocol.md: a stop of a done turn is a no-op; a pause of a paused turn
    answers ``paused`` again; a resume of a turn that is not paused rejoins it."""
    assert CONTROL[(ClientMessageType.STOP, TurnStatus.DONE)].outcome is Outcome.NOTHING
    assert CONTROL[(ClientMessageType.PAUSE, TurnStatus.PAUSED)].outcome is Outcome.REPORT_PAUSED
    for status in (TurnStatus.QUEUED, TurnStatus.RUNNING, TurnStatus.DONE):
        assert CONTROL[(ClientMessageType.RESUME, status)].outcome is Outcome.NOTHING
    assert CONTROL_ANSWERS[ClientMessageType.STOP] == (ServerMessageType.DONE,)


def test_flags_are_the_effects_that_leave_the_turn_to_its_engine() -> None:
    for (_, status), rule in CONTROL.items():
        if rule.effect is not None and rule.effect.flag:
            assert status is TurnStatus.RUNNING and rule.leads_to is TurnStatus.RUNNING
    assert {e.flag for e in Effect if e.flag} == {Control.STOP, Control.PAUSE}


def test_the_scripts_spell_no_status_or_effect_of_their_own() -> None:
    """Every status and effect a script compares with comes from the enums."""
    source = Path(scripts.__file__).read_text()
    values = {s.value for s in TurnStatus} | {e.value for e in Effect}
    values |= {c.value for c in Control if c.value}
    quoted = {m for m in re.findall(r"'([a-z_:]+)'", source) if m in values}
    assert quoted == set()
    assert "$" not in scripts.CONTROL + scripts.START_TURN + scripts.PUBLISH + scripts.CLOSE
    assert f"'{Effect.CANCEL.value}'" in scripts.CONTROL  # rendered, not left out
