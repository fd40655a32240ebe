"""Tool calling: the tools a turn may call, how the model is told of them, and its
calls read back out of its text.

The shapes are OpenAI's (chat completions, and the WebSocket ``params``):

- ``tools``: ``[{"type": "function", "function": {"name", "description"?,
  "parameters"?, "strict"?}}]``;
- ``tool_choice``: ``"none"``, ``"auto"`` (the default), ``"required"`` (at least
  one call), or ``{"type": "function", "function": {"name"}}`` (that one);
- ``parallel_tool_calls``: false allows at most one call.

The model writes its calls in the Hermes format, which Qwen2.5/Qwen3, Hermes 2/3,
SmolLM3 and most open models' chat templates teach:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that knows tools renders them itself; one that does not (SmolLM2's)
gets them in a system message worded as Qwen2.5's template words it, and its
``tool`` messages as ``<tool_response>`` blocks in a user message. ``required`` and
a named function are enforced while sampling: a grammar (``call_format``) holds the
draws to calls of the allowed tools, each with arguments valid for its parameters.

Checked values travel as strings (canonical JSON, a mode, or ``function:NAME``), so
the turn record stays flat and the parameters stay hashable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

import llguidance

# Tools travel in every turn's record and their schemas are compiled: bounded.
MAX_TOOLS = 64
MAX_TOOLS_CHARS = 32_768
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MODES = ("none", "auto", "required")
# How a call is written: compact JSON with the usual separators (as the grammar
# allows it), so a conversation resent with its calls renders the same tokens.
SEPARATORS = (", ", ": ")


class ToolsError(ValueError):
    """``tools``, ``tool_choice`` or a message's tool calls are malformed."""


# --- checking what comes in --------------------------------------------------------


def canonical_tools(raw: Any) -> str | None:
    """The checked tools as canonical JSON (None for none): OpenAI's shape, with
    ``parameters`` defaulted to an object schema and ``strict`` to false."""
    if raw is None:
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ToolsError(f"tools must be a list of at most {MAX_TOOLS} tools")
    if not raw:
        return None
    tools = [_tool(item, i) for i, item in enumerate(raw)]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ToolsError("tool names must be unique")
    text = json.dumps(tools, separators=(",", ":"), ensure_ascii=False)
    if len(text) > MAX_TOOLS_CHARS:
        raise ToolsError(f"tools are longer than {MAX_TOOLS_CHARS} characters")
    return text


def _tool(item: Any, index: int) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(item, dict) or item.get("type") != "function":
        raise ToolsError(f'{where} must be {{"type": "function", "function": {{...}}}}')
    _only(item, {"type", "function"}, where)
    function = item.get("function")
    if not isinstance(function, dict):
        raise ToolsError(f"{where}.function must be an object")
    _only(function, {"name", "description", "parameters", "strict"}, f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ToolsError(f"{where}.function.name must be 1-64 letters, digits, _ or -")
    out: dict[str, Any] = {"name": name}
    description = function.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise ToolsError(f"{where}.function.description must be a string")
        out["description"] = description
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ToolsError(f"{where}.function.parameters must be a JSON schema (an object)")
    out["parameters"] = parameters
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolsError(f"{where}.function.strict must be a boolean")
    out["strict"] = bool(strict)
    return {"type": "function", "function": out}


def canonical_choice(raw: Any) -> str:
    """``none``, ``auto``, ``required`` or ``function:NAME``."""
    if isinstance(raw, str) and raw in MODES:
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        _only(raw, {"type", "function"}, "tool_choice")
        function = raw.get("function")
        if isinstance(function, dict) and set(function) == {"name"}:
            name = function["name"]
            if isinstance(name, str) and NAME.fullmatch(name):
                return f"function:{name}"
    raise ToolsError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}'
    )


def check_choice(tools: str | None, choice: str | None) -> None:
    """A choice that asks for a call needs tools, and a named one one of them."""
    if choice is None or choice in ("none", "auto"):
        return
    names = tool_names(tools)
    if not names:
        raise ToolsError(f"tool_choice {openai_choice(choice)!r} needs tools")
    if choice.startswith("function:") and choice[len("function:") :] not in names:
        raise ToolsError(f"tool_choice names {choice[len('function:') :]!r}, not one of the tools")


def openai_choice(choice: str) -> Any:
    """A checked choice in OpenAI's shape again."""
    if choice.startswith("function:"):
        return {"type": "function", "function": {"name": choice[len("function:") :]}}
    return choice


def tool_list(tools: str | None) -> list[dict[str, Any]]:
    return list(json.loads(tools)) if tools else []


def tool_names(tools: str | None) -> list[str]:
    return [t["function"]["name"] for t in tool_list(tools)]


def _only(raw: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in raw if k not in allowed)
    if unknown:
        raise ToolsError(f"unknown fields in {where}: {', '.join(unknown)}")


# --- messages: calls and results as the conversation's text -------------------------


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it."""
    body = json.dumps(
        {"name": name, "arguments": arguments}, separators=SEPARATORS, ensure_ascii=False
    )
    return f"{OPEN}\n{body}\n{CLOSE}"


def assistant_text(content: str | None, tool_calls: Any, where: str) -> str:
    """An assistant message that made calls, as the Hermes text the model wrote for
    it: its content (if any), then each call (OpenAI's ``arguments`` is JSON text)."""
    parts = [content] if content else []
    parts += [call_text(call["function"]["name"], call["function"]["arguments"])
              for call in checked_calls(tool_calls, where)]  # fmt: skip
    return "\n".join(parts)


def checked_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` (OpenAI's shape, ``arguments`` as JSON
    text), checked, as the turn record keeps them and chat templates take them:
    ``{"type": "function", "function": {"name", "arguments": {...}}}``."""
    if not isinstance(tool_calls, list) or not tool_calls:
        raise ToolsError(f"{where}.tool_calls must be a non-empty list")
    out = []
    for i, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{i}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ToolsError(f'{at} must be {{"id", "type": "function", "function"}}')
        _only(call, {"id", "type", "function", "index"}, at)
        function = call.get("function")
        if not isinstance(function, dict):
            raise ToolsError(f"{at}.function must be an object")
        _only(function, {"name", "arguments"}, f"{at}.function")
        name, arguments = function.get("name"), function.get("arguments", "{}")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ToolsError(f"{at}.function.name must be 1-64 letters, digits, _ or -")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise ToolsError(f"{at}.function.arguments must be a JSON object, as text")
        kept: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": parsed}}
        if isinstance(call.get("id"), str):  # templates that pair calls and results use it
            kept["id"] = call["id"]
        out.append(kept)
    return out


def template_messages(
    messages: list[dict[str, Any]], tools: str | None, native: bool
) -> list[dict[str, str]]:
    """The conversation for a chat template: as it is where the template knows tools
    (``native``), else with the tools in a system message and each run of ``tool``
    messages as one user message of ``<tool_response>`` blocks."""
    if native:
        return messages
    out: list[dict[str, str]] = []
    results: list[str] = []  # the run of tool results not yet written
    for message in [*messages, {"role": "end", "content": ""}]:
        if message["role"] == "tool":
            results.append(f"<tool_response>\n{message['content']}\n</tool_response>")
            continue
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results = []
        if message["role"] != "end":
            out.append(message)
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def tools_prompt(tools: str) -> str:
    """The tools as Qwen2.5's chat template tells them to the model."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in _for_prompt(tools))
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def template_tools(tools: str | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template takes them (``apply_chat_template(tools=...)``)."""
    return _for_prompt(tools) if tools else None


def _for_prompt(tools: str) -> list[dict[str, Any]]:
    out = []
    for tool in tool_list(tools):
        function = {k: v for k, v in tool["function"].items() if k != "strict"}
        out.append({"type": "function", "function": function})
    return out


# --- the grammar of a required call -------------------------------------------------


def call_format(tools: str | None, choice: str | None, parallel: bool) -> str | None:
    """The constraint a choice puts on the draws, as a format the engine compiles
    (``grammar_for``); None where the model is free (``auto``, ``none``)."""
    if not tools or choice is None or choice in ("none", "auto"):
        return None
    allowed = tool_list(tools)
    if choice.startswith("function:"):
        allowed = [t for t in allowed if t["function"]["name"] == choice[len("function:") :]]
    spec = {
        "type": "tool_calls",
        "tools": [t["function"] for t in allowed],
        "parallel": parallel,
    }
    return json.dumps(spec, separators=(",", ":"), ensure_ascii=False)


def is_call_format(text: str) -> bool:
    return text.startswith('{"type":"tool_calls"')


def grammar_for(
    text: str, around: list[str] | None = None, arguments_key: str = "arguments"
) -> str:
    """A Lark grammar for llguidance: one call (or, in parallel, several), each
    ``{"name": N, "arguments": {...}}`` for one of the allowed tools, with arguments
    valid for that tool's parameters. ``around``: the rules that place the calls
    (``body``), by default the Hermes tags, a newline between calls; a format that
    writes the arguments under another key names it (``wsinfer/tool_formats.py``)."""
    spec = json.loads(text)
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    strict = all(t["strict"] for t in spec["tools"])
    bodies = []
    for tool in spec["tools"]:
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, arguments_key: tool["parameters"]},
            "required": ["name", arguments_key],
            "additionalProperties": False,
            "x-guidance": {**layout, "lenient": not strict},
        }
        bodies.append("%json " + json.dumps(schema, ensure_ascii=False))
    if around is None:
        start = 'start: call ("\\n" call)*' if spec["parallel"] else "start: call"
        around = [start, f'call: "{OPEN}\\n" body "\\n{CLOSE}"']
    return "\n".join(
        [
            *around,
            "body: " + " | ".join(f"body{i}" for i in range(len(bodies))),
            *(f"body{i}: {body}" for i, body in enumerate(bodies)),
        ]
    )


def spec_parallel(text: str) -> bool:
    """Whether a required call's spec (``call_format``) allows several calls."""
    return bool(json.loads(text)["parallel"])


def check_grammar(text: str) -> None:
    problem = llguidance.LLMatcher.validate_grammar(grammar_for(text))
    if problem:
        raise ToolsError(f"the tools' parameters cannot be enforced: {problem[:300]}")


# --- reading calls back out of the model's text -------------------------------------


@dataclass
class Parsed:
    """What a piece of the model's text was: content to show, calls it completed,
    and the parts of calls drawn so far (``CallStream``)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    parts: list[dict[str, Any]] = field(default_factory=list)

    def add(self, later: Parsed) -> None:
        self.content += later.content
        self.calls += later.calls
        self.parts += later.parts


class ArgumentsText:
    """A call's arguments, fed as the model draws them, written out as they become
    certain: the JSON text ``json.dumps(json.loads(all of it), ensure_ascii=False)``
    gives (", " and ": " between items, no other whitespace, strings escaped as
    Python's ``json`` escapes them), built piece by piece.

    What it has written depends only on the text fed so far, never on how it was
    cut: a number or a literal waits for what ends it, an escape in a string for
    its last character (a high surrogate for the low one it may pair with). It
    stops at the end of the first value (``complete``); ``broken`` once the text
    cannot be JSON (nothing more is written).
    """

    def __init__(self) -> None:
        self.text = ""  # what it has written
        self.depth = 0
        self.started = self.complete = self.broken = False
        self._string: str | None = None  # the raw text of the string it is inside
        self._scalar = ""  # a number or literal, until what ends it

    def feed(self, piece: str) -> tuple[str, int]:
        """What ``piece`` adds to the text, and how much of it was taken (all of
        it, unless the value ended inside it)."""
        out: list[str] = []
        taken = 0
        for char in piece:
            if self.complete or self.broken:
                break
            taken += 1
            self._char(char, out)
        if self._string and not self.broken:
            out.append(self._decoded(_safe_end(self._string)))
        written = "".join(out)
        self.text += written
        return written, taken

    def _char(self, char: str, out: list[str]) -> None:
        if self._string is not None:
            if char == '"' and not _escaping(self._string):
                out.append(self._decoded(len(self._string)) + '"')
                self._string = None
                self._value_done()
            else:
                self._string += char
            return
        if self._scalar and not (char.isalnum() or char in "+-."):
            self._flush_scalar(out)
            if self.broken or self.complete:
                return
        if char.isspace():
            return
        if not self.started and char != "{":  # arguments are an object
            self.broken = True
            return
        self.started = True
        if char in "{[":
            self.depth += 1
            out.append(char)
        elif char in "}]":
            self.depth -= 1
            out.append(char)
            self._value_done()
        elif char == ",":
            out.append(", ")
        elif char == ":":
            out.append(": ")
        elif char == '"':
            self._string = ""
            out.append('"')
        elif char.isalnum() or char in "+-.":
            self._scalar += char
        else:
            self.broken = True

    def _decoded(self, end: int) -> str:
        """The string's raw text up to ``end``, as ``json`` writes it (taken)."""
        assert self._string is not None
        raw, self._string = self._string[:end], self._string[end:]
        if not raw:
            return ""
        try:
            value = json.loads('"' + raw + '"')
        except ValueError:
            self.broken = True
            return ""
        return str(encode_basestring(value))[1:-1]

    def _flush_scalar(self, out: list[str]) -> None:
        try:
            value = json.loads(self._scalar)
        except ValueError:
            self.broken = True
            return
        self._scalar = ""
        out.append(json.dumps(value))
        self._value_done()

    def _value_done(self) -> None:
        if self.depth == 0:
            self.complete = True


def _escaping(raw: str) -> bool:
    """Whether a quote after ``raw`` (a string's text so far) is escaped."""
    run = len(raw) - len(raw.rstrip("\\"))
    return run % 2 == 1


def _safe_end(raw: str) -> int:
    """How much of a string's raw text decodes as it will in the whole string: not
    an escape cut short, nor a high surrogate that the next escape may pair with."""
    at = 0
    safe = 0
    while at < len(raw):
        if raw[at] != "\\":
            at += 1
            safe = at
            continue
        if at + 1 >= len(raw):
            return safe
        if raw[at + 1] != "u":
            at += 2
            safe = at
            continue
        if at + 6 > len(raw):
            return safe
        if _is_high_surrogate(raw[at + 2 : at + 6]):
            pair = raw[at + 6 : at + 12]
            if len(pair) < 6 and "\\u".startswith(pair[:2]):
                return safe  # the escape after it, which it may pair with, is not whole
            at += 12 if pair.startswith("\\u") else 6
        else:
            at += 6
        safe = at
    return safe


def _is_high_surrogate(digits: str) -> bool:
    try:
        return 0xD800 <= int(digits, 16) < 0xDC00
    except ValueError:
        return False  # not JSON: decoding the whole string says so


# A call's opening as every format writes it: its name, then its arguments' key.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(\w+)"\s*:\s*')


class CallStream:
    """A call whose arguments are handed out as the model draws them (a turn held to
    its calls by a grammar, where what begins as a call can only end as one).

    Its parts are OpenAI's streamed ``tool_calls`` entries: the first, once the model
    has written the call's name and its arguments' key, with ``type`` and
    ``function.name``; each part with ``index``, ``id`` and the next piece of
    ``function.arguments``. The pieces joined are the call's ``arguments``, and the
    part that the call's completing output carries may be empty.
    """

    def __init__(self, index: int, call_id_prefix: str, head: re.Match[str]) -> None:
        self.index, self.name = index, head[1]
        self.call_id = f"{call_id_prefix}_{index}"  # as ``read_call`` names it
        self.args = ArgumentsText()
        self.begins = head.start()  # where its object begins in the model's text
        self.fed = head.end()  # the model's text is fed to the arguments up to here

    @classmethod
    def opening(
        cls,
        text: str,
        at: int,
        end: int,
        names: frozenset[str],
        keys: tuple[str, ...],
        index: int,
        call_id_prefix: str,
        out: Parsed,
    ) -> CallStream | None:
        """The call ``index`` if ``text[at:end]`` opens one of ``names`` with one of
        ``keys`` for its arguments (``CALL_HEAD``), its first part in ``out``."""
        head = CALL_HEAD.match(text, at, end)
        if head is None or head[1] not in names or head[2] not in keys:
            return None
        stream = cls(index, call_id_prefix, head)
        part = stream._part(out, "")
        part["type"] = "function"
        part["function"] = {"name": stream.name, **part["function"]}
        return stream

    def advance(self, text: str, end: int, out: Parsed) -> None:
        """Feed the arguments the text drawn since, up to ``end``."""
        if end <= self.fed:
            return
        piece, taken = self.args.feed(text[self.fed : end])
        self.fed += taken
        if piece:
            self._part(out, piece)

    def complete(self, call: dict[str, Any], out: Parsed) -> None:
        """``call``, whole (it is, in OpenAI's shape), is this one: its arguments are
        the pieces handed out (the same JSON ``read_call`` writes, but for a key the
        model repeated), and the output that completes it carries its last part."""
        whole = call["function"]["arguments"]
        streamed = self.args.text
        if self.args.complete and not self.args.broken:
            call["function"]["arguments"] = streamed
            self._part(out, "")
        else:  # not JSON as drawn, but a call (models that write arguments as text)
            self._part(out, whole[len(streamed) :] if whole.startswith(streamed) else "")

    @staticmethod
    def shows(part: dict[str, Any]) -> bool:
        """Whether a part has news for a reader: it opens its call, or has a piece."""
        return "type" in part or bool(part["function"]["arguments"])

    def _part(self, out: Parsed, piece: str) -> dict[str, Any]:
        """This call's part of ``out`` (one per output), with ``piece`` added."""
        for part in out.parts:
            if part["index"] == self.index:
                part["function"]["arguments"] += piece
                return part
        part = {"index": self.index, "id": self.call_id, "function": {"arguments": piece}}
        out.parts.append(part)
        return part


class ToolCallParser:
    """Splits a turn's text, fed in pieces, into content and complete calls.

    What it hands out depends only on the text fed so far, never on how it was cut
    into pieces (an engine that rebuilds a turn feeds it the text already published
    in one piece), and it never takes back what it handed out: text that may start
    a call (``<tool_``) is held until it is known not to. A call is handed out whole,
    once its closing tag arrives; one whose body is not ``{"name": one of the tools,
    "arguments": {...}}`` stays text, as the model wrote it. At the end of the turn
    (``finish``) what is held is content, but a call whose closing tag never came
    whole (the model ended the turn after its JSON, or was cut inside the tag)
    counts if its body is a call.
    """

    def __init__(self, names: Iterable[str], call_id_prefix: str, streams: bool = False) -> None:
        self.names = frozenset(names)
        self.call_id_prefix = call_id_prefix
        self.text = ""
        self.done = 0  # text[:done] is handed out
        self.count = 0  # calls handed out
        # Hand out each call's arguments as drawn (``CallStream``): only where a
        # grammar holds the turn to its calls, so that none can turn out to be text.
        self.streams = streams
        self.open: CallStream | None = None  # the call being drawn, its parts out

    def feed(self, piece: str) -> Parsed:
        self.text += piece
        out = Parsed()
        while True:
            start = self.text.find(OPEN, self.done)
            if start < 0:
                end = len(self.text) - _partial(OPEN, self.text, self.done)
                self._content(out, end)
                return out
            self._content(out, start)
            close = self.text.find(CLOSE, start + len(OPEN))
            self._stream(out, start + len(OPEN), len(self.text) if close < 0 else close)
            if close < 0:
                return out
            end = close + len(CLOSE)
            self._call_or_text(out, start + len(OPEN), close, end)

    def _stream(self, out: Parsed, body_start: int, body_end: int) -> None:
        """The parts of the call whose body begins at ``body_start``, drawn so far."""
        if not self.streams:
            return
        if self.open is None:
            self.open = CallStream.opening(
                self.text, body_start, body_end, self.names, ("arguments",),
                self.count, self.call_id_prefix, out,
            )  # fmt: skip
        if self.open is not None:
            self.open.advance(self.text, body_end, out)

    def finish(self) -> Parsed:
        """The turn ended: everything held is handed out, but a call whose parts went
        out and that is not whole: it stays as far as they went (and a continue of
        the turn goes on drawing it)."""
        out = self.feed("")
        start = self.text.find(OPEN, self.done)
        if start >= 0:  # a call cut short, maybe inside its closing tag
            self._content(out, start)
            body_start = start + len(OPEN)
            body_end = len(self.text) - _partial(CLOSE, self.text, body_start)
            if not self._call_or_text(out, body_start, body_end, len(self.text), ended=True):
                return out  # the call being drawn stays open
        self._content(out, len(self.text))
        return out

    def _content(self, out: Parsed, end: int) -> None:
        if end > self.done:
            out.content += self.text[self.done : end]
            self.done = end

    def _call_or_text(
        self, out: Parsed, body_start: int, body_end: int, end: int, ended: bool = False
    ) -> bool:
        """The body a call, or text; False where it is neither: a call whose parts went
        out and is not whole stays as far as they went, and is not text (at the turn's
        end, ``ended``, it stays open, for a continue to go on drawing it)."""
        call = self._call(self.text[body_start:body_end])
        drawn, self.open = self.open, None
        if call is None and drawn is not None:
            if ended:
                self.open = drawn
            else:
                self.done = end
            return False
        if call is None:
            self._content(out, end)
            return True
        if drawn is not None:
            drawn.complete(call, out)
        out.calls.append(call)
        self.count += 1
        self.done = end
        return True

    def _call(self, body: str) -> dict[str, Any] | None:
        try:
            data = json.loads(body)
        except ValueError:
            return None
        if not isinstance(data, dict) or set(data) != {"name", "arguments"}:
            return None
        return read_call(
            data["name"], data["arguments"], self.names, self.call_id_prefix, self.count
        )


def read_call(
    name: Any, arguments: Any, names: frozenset[str], call_id_prefix: str, index: int
) -> dict[str, Any] | None:
    """A call the model wrote, in OpenAI's shape (``arguments`` as JSON text), if it
    names one of ``names`` with an object of arguments (which some models write as
    JSON text); None where it is not a call, whatever the format it was written in."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if name not in names or not isinstance(arguments, dict):
        return None
    return {
        "index": index,
        "id": f"{call_id_prefix}_{index}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _partial(tag: str, text: str, start: int) -> int:
    """How many characters at the end of ``text`` (from ``start``) begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - size :]):
            return size
    return 0
