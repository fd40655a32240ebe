"""A turn's ``response_format``: checked where it comes in, and the grammar that holds
the engine's draws to it.

The shapes are OpenAI's (chat completions; the Responses API's ``text.format`` and
the WebSocket ``params.response_format`` are read into the same):

- ``{"type": "text"}``: no constraint (the same as none);
- ``{"type": "json_object"}``: the output is one JSON object;
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
  "description"?}}``: the output is a JSON document that validates against
  ``schema``. With ``strict: true`` a schema keyword the grammar cannot enforce is
  refused; without, it is ignored (as OpenAI's non-strict mode promises less).

A checked format travels as compact JSON (``canonical``), a string: the turn
record in Redis stays flat and a format is hashable. The engine compiles it with
llguidance (``engine/grammar.py``) and masks every draw, so every token keeps the
output a prefix of a valid document, and a turn that ends by itself (not cut by
``max_new_tokens`` or a stop string) parses and validates.

Why llguidance, not xgrammar or outlines: a Rust core with no Python dependencies
(xgrammar's wheel requires triton, hundreds of MB on a CPU box), a mask in tens of
microseconds for SmolLM2's 49k tokens without precompiling the vocabulary per
schema, and JSON Schema, regular expressions and Lark in one library; vLLM and
SGLang ship it as a structured-output backend.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

# A schema larger than this is refused: compiling is per turn, and a frame is 1 MiB.
MAX_FORMAT_CHARS = 16_384
# Compact JSON with the usual separators: no run of whitespace for a small model to
# wander into (a grammar that allows any whitespace lets it emit newlines forever).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ResponseFormatError(ValueError):
    """A ``response_format`` that is malformed or asks for what cannot be enforced."""


def canonical(raw: Any) -> str | None:
    """The checked format as canonical JSON; None for plain text."""
    if not isinstance(raw, dict):
        raise ResponseFormatError("response_format must be an object")
    kind = raw.get("type")
    if kind == "text":
        _only(raw, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only(raw, {"type"}, "response_format")
        spec: dict[str, Any] = {"type": "json_object"}
    elif kind == "json_schema":
        _only(raw, {"type", "json_schema"}, "response_format")
        spec = {"type": "json_schema", "json_schema": _json_schema(raw.get("json_schema"))}
    else:
        raise ResponseFormatError("response_format.type must be text, json_object or json_schema")
    # Keys keep the client's order: a document's properties come in the schema's order.
    text = json.dumps(spec, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_FORMAT_CHARS:
        raise ResponseFormatError(f"response_format is longer than {MAX_FORMAT_CHARS} characters")
    problem = llguidance.LLMatcher.validate_grammar(grammar_for(text))
    if problem:
        raise ResponseFormatError(f"response_format cannot be enforced: {problem[:300]}")
    return text


def _json_schema(raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ResponseFormatError("response_format.json_schema must be an object")
    _only(raw, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    name = raw.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ResponseFormatError(
            "response_format.json_schema.name must be 1-64 letters, digits, _ or -"
        )
    schema = raw.get("schema", {})
    if not isinstance(schema, dict):
        raise ResponseFormatError("response_format.json_schema.schema must be an object")
    strict = raw.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ResponseFormatError("response_format.json_schema.strict must be a boolean")
    return {"name": name, "schema": schema, "strict": bool(strict)}


def _only(raw: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ResponseFormatError(f"unknown fields in {where}: {', '.join(unknown)}")


def grammar_for(text: str) -> str:
    """The llguidance grammar of a canonical format."""
    spec = json.loads(text)
    strict = spec["type"] == "json_schema" and spec["json_schema"]["strict"]
    schema = _schema(spec)
    options: Any = {**JSON_LAYOUT, "lenient": not strict}  # llguidance's JsonCompileOptions
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options))
    except ValueError as exc:
        raise ResponseFormatError(f"response_format cannot be enforced: {exc}") from exc


def schema_of(text: str) -> dict[str, Any]:
    """The JSON schema a canonical format's output validates against."""
    return _schema(json.loads(text))


def _schema(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["type"] == "json_object":
        return {"type": "object"}
    return dict(spec["json_schema"]["schema"])


def responses_format(text: str | None) -> dict[str, Any]:
    """A canonical format as the Responses API shows it (``text.format``)."""
    if text is None:
        return {"type": "text"}
    spec = json.loads(text)
    if spec["type"] == "json_schema":
        return {"type": "json_schema", **spec["json_schema"]}
    return dict(spec)
