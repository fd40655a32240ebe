"""Write ``clients/browser/contract.js`` from ``wsinfer/contract.py``.

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


def main() -> int:
    TARGET.write_text(render(), encoding="utf-8")
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
