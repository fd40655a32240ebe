"""The typed script layer cannot drift: each script reads KEYS and ARGV only in
the header its declaration generates, and replies only with ``Reply`` codes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from wsinfer.sessions import scripting, scripts
from wsinfer.sessions.scripting import Script, arg, counted, key, rest_keys
from wsinfer.sessions.scripts import Reply

DECLARED = [
    v
    for v in vars(scripts).values()
    if isinstance(v, type) and issubclass(v, Script) and v is not Script
]

# What the header generator writes, and nothing else.
HEADER_LINE = re.compile(
    r"local \w+ = (KEYS\[\d+\]|ARGV\[\d+\]|cmsgpack\.unpack\(ARGV\[\d+\]\)|\{\})"
    r"|for i = \d+, #KEYS do \w+\[#\w+ \+ 1\] = KEYS\[i\] end"
    r"|for i = 0, tonumber\(ARGV\[\d+\]\) - 1 do \w+\[i \+ 1\] = \{[^}]*\} end"
)
# A reply is a table whose first element is a quoted code: returned, assigned
# to be returned (CLAIM's), or the alternative of an ``or``.
REPLY_HEAD = re.compile(r"(?:\breturn|=|\bor)\s*\{\s*'(\w+)'")


def test_every_script_is_declared_once_and_rendered() -> None:
    """``ClaimCall``'s script is ``CLAIM``, which the stores register."""
    assert len(DECLARED) == 8
    for spec in DECLARED:
        name = re.sub(r"(?<=[a-z])(?=[A-Z])", "_", spec.__name__.removesuffix("Call")).upper()
        assert getattr(scripts, name) is spec.LUA, name


@pytest.mark.parametrize("spec", DECLARED, ids=lambda spec: spec.__name__)
def test_only_the_generated_header_reads_keys_and_argv(spec: type[Script]) -> None:
    header = spec.header()
    assert spec.LUA.startswith(header)
    for line in header.splitlines():
        assert HEADER_LINE.fullmatch(line), line
    body = spec.LUA[len(header) :]
    assert "ARGV[" not in body and "KEYS[" not in body


@pytest.mark.parametrize("spec", DECLARED, ids=lambda spec: spec.__name__)
def test_every_reply_code_a_script_returns_is_a_reply(spec: type[Script]) -> None:
    codes = set(REPLY_HEAD.findall(spec.LUA))
    assert Reply.NOT_FOUND in codes  # the guards' (TOUCH's) or its own
    assert codes <= set(Reply), codes - set(Reply)


def test_every_reply_is_one_some_script_returns() -> None:
    codes = {code for spec in DECLARED for code in REPLY_HEAD.findall(spec.LUA)}
    assert codes == set(Reply)


def test_the_callers_spell_no_reply_code_of_their_own() -> None:
    quoted = "|".join(reply.value for reply in Reply)
    for module in ("store.py", "worker.py"):
        source = (Path(scripts.__file__).parent / module).read_text()
        assert re.findall(rf"[\"']({quoted})[\"']", source) == [], module


class Example(Script):
    first: str = key()
    more: Sequence[str] = rest_keys()
    name: str = arg()
    turn: int = arg()
    rows: Sequence[tuple[str, str]] = counted("left", "right")


def test_a_call_lays_out_its_fields_in_the_declared_order() -> None:
    call = Example(turn=3, rows=[("a", "b"), ("c", "d")], name="n", more=["k2", "k3"], first="k1")
    assert call.keys() == ["k1", "k2", "k3"]
    assert call.args() == ["n", 3, 2, "a", "b", "c", "d"]
    assert Example.header().splitlines() == [
        "local first = KEYS[1]",
        "local more = {}",
        "for i = 2, #KEYS do more[#more + 1] = KEYS[i] end",
        "local name = ARGV[1]",
        "local turn = ARGV[2]",
        "local rows = {}",
        "for i = 0, tonumber(ARGV[3]) - 1 do rows[i + 1] = "
        "{left = ARGV[4 + 2 * i], right = ARGV[5 + 2 * i]} end",
    ]
    with pytest.raises(ValueError):
        Example(first="k", more=[], name="n", turn=1, rows=[("a",)]).args()


def test_a_bad_declaration_fails_at_import() -> None:
    with pytest.raises(TypeError, match="no Lua name"):

        class Reserved(Script):
            end: str = arg()

    with pytest.raises(TypeError, match="takes the rest"):

        class AfterTheRest(Script):
            rest: Sequence[str] = rest_keys()
            late: str = key()

    class Shadowing(Script):
        counters: str = arg()  # the prelude's function of that name

    with pytest.raises(TypeError, match="prelude"):
        scripts._declare(Shadowing, "return 1")
    assert scripting.Slot.PACKED  # PUBLISH's turns: decoded in the header
