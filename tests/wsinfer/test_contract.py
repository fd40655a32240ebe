"""docs/protocol.md and wsinfer.contract name the same things."""

from __future__ import annotations

import re
import typing
from enum import Enum
from pathlib import Path

import pytest

from wsinfer import contract
from wsinfer.messages import session_message

DOC = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()


def _table_names(heading: str) -> set[str]:
    """The backticked first cells of the table under ``heading``."""
    section = DOC.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE))


def _values(enum: type[Enum]) -> set[str]:
    return {member.value for member in enum}


def test_client_messages_are_the_docs_table() -> None:
    assert _table_names("Client to server") == _values(contract.ClientMessageType)


def test_server_messages_are_the_docs_table() -> None:
    assert _table_names("Server to client") == _values(contract.ServerMessageType)


def test_the_subprotocols_are_the_docs_and_the_servers() -> None:
    from wsinfer.clients.codec import SUBPROTOCOLS as CLIENT_SUBPROTOCOLS
    from wsinfer.messages import SUBPROTOCOLS

    named = set(re.findall(r"`(wsinfer\.v\d+\.\w+)`", DOC))
    assert named == _values(contract.Subprotocol)
    assert set(SUBPROTOCOLS) == set(CLIENT_SUBPROTOCOLS.values()) == named


def test_error_codes_are_the_docs_list() -> None:
    line = next(row for row in DOC.splitlines() if row.startswith("| `error` |"))
    listed = set(re.findall(r"`([a-z_]+)`", line.split("codes:", 1)[1]))
    assert listed == _values(contract.ErrorCode)


def test_the_finish_reason_type_and_enum_hold_the_same_values() -> None:
    assert set(typing.get_args(contract.FinishReasonName)) == _values(contract.FinishReason)


@pytest.mark.parametrize("reason", sorted(_values(contract.FinishReason)))
def test_every_finish_reason_is_documented(reason: str) -> None:
    line = next(row for row in DOC.splitlines() if row.startswith("| `done` |"))
    assert f"`{reason}`" in line


@pytest.mark.parametrize(
    ("names", "enum"),
    [
        (contract.TurnStatusName, contract.TurnStatus),
        (contract.ErrorCodeName, contract.ErrorCode),
    ],
)
def test_each_literal_type_holds_its_enums_values(names: object, enum: type[Enum]) -> None:
    assert set(typing.get_args(names)) == _values(enum)


def test_the_server_message_types_are_one_per_message_type() -> None:
    """Each map of ``ServerMessage`` is tagged by one ``type``, all of them together
    ``ServerMessageType``."""
    tags = [typing.get_type_hints(m)["type"] for m in typing.get_args(contract.ServerMessage)]
    assert sorted(typing.get_args(t)[0] for t in tags) == sorted(
        _values(contract.ServerMessageType)
    )


def test_a_session_message_never_says_new() -> None:
    """``new`` is the status of a session that does not exist: no client is told it
    (a type error where a caller could pass it, and refused here if one did)."""
    assert "new" not in typing.get_args(contract.WireStatusName)
    with pytest.raises(ValueError, match="turn that exists"):
        session_message("s", "t", 1, contract.TurnStatus.NEW, None)
    for status in set(contract.TurnStatus) - {contract.TurnStatus.NEW}:
        assert session_message("s", "t", 1, status, None)["status"] == status.value


def test_the_error_classes_are_the_docs_table() -> None:
    section = DOC.split("## Error codes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (request|service) \| (yes|no) \|", section, re.M)
    documented = {code: (fault, retry == "yes") for code, fault, retry in rows}
    assert documented == {
        code.value: (kind.fault.value, kind.retryable)
        for code, kind in contract.ERROR_CLASSES.items()
    }
