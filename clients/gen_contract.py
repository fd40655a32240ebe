"""Write ``clients/browser/contract.js`` (and its types, ``contract.d.ts``)
from ``wsinfer/contract.py``.

The browser client cannot import Python, so it gets the same table as a
generated ES module; a test fails when the file is stale. Run after changing
wsinfer/contract.py::

    python -m wsinfer.clients.gen_contract
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path

from wsinfer import contract

TARGET = Path(__file__).resolve().parent / "browser" / "contract.js"
TYPES = TARGET.with_suffix(".d.ts")

HEADER = """\
// The wire contract's vocabulary, generated from wsinfer/contract.py by
// `python -m wsinfer.clients.gen_contract`: do not edit by hand.
"""

ENUMS: tuple[type[Enum], ...] = (
    contract.ClientMessageType,
    contract.ServerMessageType,
    contract.ErrorCode,
    contract.ClientErrorCode,
    contract.FinishReason,
    contract.TurnStatus,
    contract.Subprotocol,
    contract.FieldKind,
)


def _frozen(name: str, members: dict[str, object]) -> str:
    body = "".join(f"  {key}: {json.dumps(value)},\n" for key, value in members.items())
    return f"export const {name} = Object.freeze({{\n{body}}});\n"


def _close_codes() -> dict[str, object]:
    return {k: v for k, v in vars(contract.CloseCode).items() if k.isupper()}


def render() -> str:
    """The whole text of contract.js (deterministic, so staleness is a diff)."""
    parts = [HEADER]
    for enum in ENUMS:
        parts.append(_frozen(enum.__name__, {m.name: m.value for m in enum}))
    parts.append(_frozen("CloseCode", _close_codes()))
    messages: dict[str, object] = {
        kind.value: {
            "fields": [
                {"name": f.name, "kind": f.kind.value, "required": f.required} for f in spec.fields
            ],
            "answers": [a.value for a in spec.answers],
            "controls_turn": spec.controls_turn,
            "rejoins": spec.rejoins,
        }
        for kind, spec in contract.CLIENT_MESSAGES.items()
    }
    parts.append(_frozen("CLIENT_MESSAGES", messages))
    answers: dict[str, object] = {
        k.value: [a.value for a in v] for k, v in contract.CONTROL_ANSWERS.items()
    }
    parts.append(_frozen("CONTROL_ANSWERS", answers))
    classes: dict[str, object] = {
        code.value: {"fault": kind.fault.value, "retryable": kind.retryable}
        for code, kind in contract.ERROR_CLASSES.items()
    }
    parts.append(_frozen("ERROR_CLASSES", classes))
    parts.append(f"export const IDEMPOTENCY_KEY_HEX = {contract.IDEMPOTENCY_KEY_HEX};\n")
    return "\n".join(parts)


def _union(values: list[str]) -> str:
    return " | ".join(json.dumps(v) for v in values)


def render_types() -> str:
    """The whole text of contract.d.ts: the names ``wsinfer.d.ts`` types its
    calls with, so a new control is typed where it is declared."""
    kinds = [kind.value for kind in contract.ClientMessageType]
    controls = [k.value for k, spec in contract.CLIENT_MESSAGES.items() if spec.controls_turn]
    return (
        HEADER
        + f"\nexport type ClientMessageTypeName = {_union(kinds)};\n"
        + "\n// The controls of a turn: `turn.control(type)`.\n"
        + f"export type ControlType = {_union(controls)};\n"
    )


def main() -> int:
    TARGET.write_text(render(), encoding="utf-8")
    TYPES.write_text(render_types(), encoding="utf-8")
    print(f"wrote {TARGET} and {TYPES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
