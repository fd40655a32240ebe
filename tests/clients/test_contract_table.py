"""One table for both clients: contract.js is wsinfer/contract.py, and neither
client (nor the chat page, nor the docs) uses a code or type outside it."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from enum import Enum
from pathlib import Path

import pytest

from wsinfer import contract
from wsinfer.clients import errors, gen_contract

REPO = Path(__file__).resolve().parents[2]
BROWSER = REPO / "clients" / "browser"
WSINFER_JS = (BROWSER / "wsinfer.js").read_text()
CHAT_JS = (BROWSER / "chat.js").read_text()
DOC = (REPO / "docs" / "protocol.md").read_text()


def _values(*enums: type[Enum]) -> set[str]:
    return {member.value for enum in enums for member in enum}


CODES = _values(contract.ErrorCode, contract.ClientErrorCode)


def test_contract_js_is_generated_from_contract_py() -> None:
    stale = "stale: run `python -m wsinfer.clients.gen_contract`"
    assert gen_contract.TARGET.read_text() == gen_contract.render(), stale
    assert gen_contract.TYPES.read_text() == gen_contract.render_types(), stale


def test_generator_writes_every_enum() -> None:
    text = gen_contract.render()
    for member in contract.ClientErrorCode:
        assert f'{member.name}: "{member.value}"' in text
    assert "SERVICE_RESTART: 1012" in text


def test_python_exceptions_are_the_code_table() -> None:
    classes = [errors.WsinferError]
    found: set[str] = set()
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        if cls.__dict__.get("code") not in (None, "error"):
            found.add(str(cls.code))
    assert found == CODES


def test_browser_client_names_codes_and_types_only_through_the_table() -> None:
    """No literal code or message type in wsinfer.js: each goes through contract.js."""
    literals = re.findall(r"new WsinferError\(\s*\"([a-z_]+)\"", WSINFER_JS)
    assert literals == []
    used = set(re.findall(r"\b(ErrorCode|ClientErrorCode)\.([A-Z_]+)\b", WSINFER_JS))
    table = {
        (e.__name__, m.name) for e in (contract.ErrorCode, contract.ClientErrorCode) for m in e
    }
    assert used and used <= table
    sent = set(re.findall(r"\bSend\.([A-Z_]+)\b", WSINFER_JS))
    assert sent == {m.name for m in contract.ClientMessageType}
    assert not re.search(r"type: \"[a-z_]+\"", WSINFER_JS)


def test_browser_client_handles_every_server_message() -> None:
    handlers = set(re.findall(r"^  _on_([a-z_]+)\(msg\)", WSINFER_JS, re.MULTILINE))
    assert handlers == _values(contract.ServerMessageType)


def test_chat_page_explains_only_known_codes() -> None:
    table = CHAT_JS.split("const ERROR_TEXT = {", 1)[1].split("};", 1)[0]
    explained = set(re.findall(r"^\s+([a-z_]+):", table, re.MULTILINE))
    assert explained == CODES


def test_type_declarations_list_the_codes() -> None:
    dts = (BROWSER / "wsinfer.d.ts").read_text()
    server = dts.split("export type ServerErrorCode =", 1)[1].split(";", 1)[0]
    client = dts.split("export type ClientErrorCode =", 1)[1].split(";", 1)[0]
    assert set(re.findall(r'"([a-z_]+)"', server)) == _values(contract.ErrorCode)
    assert set(re.findall(r'"([a-z_]+)"', client)) == _values(contract.ClientErrorCode)


def test_docs_list_the_client_codes() -> None:
    section = DOC.split("## Clients", 1)[1].split("\n## ", 1)[0]
    assert set(re.findall(r"^\| `([a-z_]+)` \|", section, re.MULTILINE)) == _values(
        contract.ClientErrorCode
    )


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed")
def test_the_browser_clients_errors_classify_as_the_pythons() -> None:
    # Every code the server sends, the clients' own and an unknown one, through
    # the browser client's WsinferError (under node) and the Python client's.
    codes = [*_values(contract.ErrorCode), *_values(contract.ClientErrorCode), "from_a_newer_one"]
    script = (
        f"import {{ WsinferError }} from {json.dumps(str(BROWSER / 'wsinfer.js'))};\n"
        f"const codes = {json.dumps(codes)};\n"
        "const out = {};\n"
        "for (const c of codes) { const e = new WsinferError(c, 'x');"
        " out[c] = [e.fault, e.retryable]; }\n"
        "console.log(JSON.stringify(out));\n"
    )
    done = subprocess.run(
        ["node", "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    python_side = {
        code: [
            None if (e := _client_error(code)).fault is None else e.fault.value,
            e.retryable,
        ]
        for code in codes
    }
    assert json.loads(done.stdout) == python_side


def _client_error(code: str) -> errors.WsinferError:
    own = {
        errors.ConnectionLost.code: errors.ConnectionLost,
        errors.ClientClosed.code: errors.ClientClosed,
    }
    return own[code]() if code in own else errors.error_from_wire({"code": code})


def test_type_declarations_list_every_generation_param() -> None:
    """``GenerateParams`` in wsinfer.d.ts names exactly what the server accepts in
    ``params`` (sessions/schema.py), so a new parameter is typed for browser users."""
    from wsinfer.sessions.schema import _PARAM_CHECKS

    dts = (BROWSER / "wsinfer.d.ts").read_text()
    block = dts.split("export interface GenerateParams {", 1)[1].split("\n}", 1)[0]
    declared = set(re.findall(r"^  ([a-z_]+)\?:", block, re.MULTILINE))
    assert declared == set(_PARAM_CHECKS)
