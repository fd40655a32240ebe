"""A call's arguments handed out as the model draws them (``tools.CallStream``), in
every format: the parts of a call joined are its arguments, whatever the cuts of
the text, and a parser rebuilt from the text already out goes on exactly where
the first one was; a call cut short stays as far as its parts went.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from wsinfer.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, ToolFormat
from wsinfer.tools import ArgumentsText

NAMES = ["get_weather", "get_time", "run_code"]
FORMATS = [HERMES, LLAMA3_JSON, MISTRAL]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + ["list", "dict"] * (depth < 2)
    kind = rng.choice(kinds)
    if kind == "str":
        alphabet = ["a", "é", '"', "\\", "\n", "\t", "/", "😀", " ", "\x01", "</tool_", "{", "}"]
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return rng.choice([0.5, -2.25, 1e-7, 3e20, 12.0])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def random_calls(rng: random.Random) -> list[tuple[str, dict[str, Any]]]:
    return [
        (rng.choice(NAMES), {f"a{i}": random_value(rng) for i in range(rng.randint(0, 3))})
        for _ in range(rng.randint(1, 3))
    ]


def random_cuts(rng: random.Random, text: str) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 40))))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def run(parser: Any, pieces: list[str]) -> list[Any]:
    outs = [parser.feed(piece) for piece in pieces]
    return [*outs, parser.finish()]


def joined_parts(outs: list[Any]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for out in outs:
        for part in out.parts:
            joined[part["index"]] = joined.get(part["index"], "") + part["function"]["arguments"]
    return joined


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_the_parts_of_each_call_join_to_its_arguments_however_the_text_is_cut(
    fmt: ToolFormat,
) -> None:
    rng = random.Random(f"parts-{fmt.name}")
    for _ in range(300):
        calls = random_calls(rng)
        text = fmt.calls_text(calls)
        whole = run(fmt.parser(NAMES, "c"), [text])
        outs = run(fmt.parser(NAMES, "c", streams=True), random_cuts(rng, text))
        got = [c for out in outs for c in out.calls]
        # The same calls and content (Hermes' newline between calls) as the parser
        # that hands them out whole.
        assert got == [c for out in whole for c in out.calls]
        assert "".join(out.content for out in outs) == "".join(out.content for out in whole)
        assert [json.loads(c["function"]["arguments"]) for c in got] == [a for _, a in calls]
        assert joined_parts(outs) == {c["index"]: c["function"]["arguments"] for c in got}
        for out in outs:
            indexes = [p["index"] for p in out.parts]
            assert len(indexes) == len(set(indexes))  # one part per call an output
            # The output completing a call carries a part of it, after its first.
            assert {c["index"] for c in out.calls} <= set(indexes)
        firsts = [p for out in outs for p in out.parts if "type" in p]
        assert [(p["index"], p["function"]["name"]) for p in firsts] == [
            (i, name) for i, (name, _) in enumerate(calls)
        ]
        assert all(p["id"] == f"c_{p['index']}" for out in outs for p in out.parts)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_parser_rebuilt_from_the_text_out_goes_on_where_the_first_was(fmt: ToolFormat) -> None:
    """A turn taken over, or continued: the new parser is fed the text published so
    far in one piece, and hands out from there on what the first would have."""
    rng = random.Random(f"rebuilt-{fmt.name}")
    for _ in range(300):
        text = fmt.calls_text(random_calls(rng))
        pieces = random_cuts(rng, text)
        at = rng.randint(0, len(pieces))
        first = fmt.parser(NAMES, "c", streams=True)
        for piece in pieces[:at]:
            first.feed(piece)
        rebuilt = fmt.parser(NAMES, "c", streams=True)
        rebuilt.feed("".join(pieces[:at]))
        assert run(rebuilt, pieces[at:]) == run(first, pieces[at:])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_call_cut_short_stays_as_far_as_its_parts_went(fmt: ToolFormat) -> None:
    rng = random.Random(f"cut-{fmt.name}")
    for _ in range(200):
        calls = random_calls(rng)
        text = fmt.calls_text(calls)
        cut = rng.randint(1, len(text) - 1)
        outs = run(fmt.parser(NAMES, "c", streams=True), random_cuts(rng, text[:cut]))
        done = [c for out in outs for c in out.calls]
        parts = joined_parts(outs)
        # Whole calls are whole; those cut short (Mistral's list holds several) went
        # as far as their parts, each a prefix of its arguments, and are not text.
        assert set(parts) - {c["index"] for c in done} == set(range(len(done), len(parts)))
        for index, drawn in parts.items():
            assert json.dumps(calls[index][1], ensure_ascii=False).startswith(drawn)
        if len(parts) > len(done):
            assert "{" not in "".join(out.content for out in outs)


def test_a_turn_continued_after_a_cut_goes_on_as_its_clients_saw_it() -> None:
    """A turn that ended by length and is continued: the new parser is fed what was
    published and finished as the first was, so nothing is handed out twice. Held to
    its calls, the call cut short goes on drawing; free, the text the first turn's end
    let out as text stays text (it would otherwise come again as a call)."""
    rng = random.Random("continued")
    for fmt in FORMATS:
        for _ in range(200):
            calls = random_calls(rng)
            text = fmt.calls_text(calls)
            cut = rng.randint(1, len(text) - 1)
            for streams in (True, False):
                first = run(fmt.parser(NAMES, "c", streams), random_cuts(rng, text[:cut]))
                again = fmt.parser(NAMES, "c", streams)
                again.feed(text[:cut])
                again.finish()
                outs = first + run(again, random_cuts(rng, text[cut:]))
                got = [c for out in outs for c in out.calls]
                content = "".join(out.content for out in outs)
                # What went out as text is not a call too: each character once at most.
                bodies = [fmt._body(c["function"]["name"], json.loads(c["function"]["arguments"]))
                          for c in got]  # fmt: skip
                assert len(content) + sum(map(len, bodies)) <= len(text)
                if streams:  # a call cut short goes on, and its parts join to it
                    cut_short = set(joined_parts(first)) - {
                        c["index"] for o in first for c in o.calls
                    }
                    assert cut_short <= {c["index"] for c in got}
                    assert joined_parts(outs) == {
                        c["index"]: c["function"]["arguments"] for c in got
                    }


def test_a_free_turn_hands_its_calls_out_whole_only() -> None:
    text = HERMES.calls_text([("get_time", {"tz": "UTC"})])
    outs = run(HERMES.parser(NAMES, "c"), list(text))
    assert not [p for out in outs for p in out.parts]
    assert [c["function"]["arguments"] for out in outs for c in out.calls] == ['{"tz": "UTC"}']


@pytest.mark.parametrize(
    "raw",
    [
        '{"s": "a\\"b\\\\c\\u00e9\\ud83d\\ude00\\n\\/x", "n": [1, 2.50, -3e2, true, null]}',
        '{ "a" :{"b":[ ]} ,"c":{}}',
        '{"lone": "\\ud83dx", "nan": NaN, "inf": -Infinity}',
    ],
)
def test_arguments_are_written_as_json_writes_them_whatever_the_cuts(raw: str) -> None:
    want = json.dumps(json.loads(raw), ensure_ascii=False)
    rng = random.Random(raw)
    for _ in range(200):
        args, written = ArgumentsText(), ""
        for piece in random_cuts(rng, raw + "}\n</tool_call>"):
            written += args.feed(piece)[0]
            assert want.startswith(written)
        assert args.complete and not args.broken and written == want


def test_arguments_that_are_not_an_object_or_not_json_are_broken() -> None:
    for raw in ['"{}"', '{"a": tru e}', "{'a': 1}", '{"a": "\\x"}']:
        args = ArgumentsText()
        args.feed(raw)
        assert args.broken or not args.complete, raw
