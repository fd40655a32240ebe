"""The formats models write their tool calls in, chosen by the model's chat template.

- **Hermes** (Qwen2.5/Qwen3, Hermes 2/3, SmolLM3 and most open models; the
  default): each call in ``<tool_call>`` tags, ``{"name", "arguments"}`` inside
  (``wsinfer/tools.py``'s parser).
- **Llama 3.x JSON** (Llama 3.1/3.2/3.3 with custom tools): the reply is the call,
  ``{"name": ..., "parameters": {...}}``; several are joined by ``; ``.
- **Mistral** (v0.3 and the templates that follow it): ``[TOOL_CALLS]`` and then a
  JSON list of ``{"name", "arguments"}``. ``[TOOL_CALLS]`` is a control token, which
  the detokenizer leaves out of the text, so a reply that *is* such a list counts
  too.

A format says how a call is written (an assistant message's calls for a template
that does not render them itself, and the grammar that holds a required call's
draws) and how calls are read back out of the model's text. Each format's calls
come at the start of the reply in the two JSON formats, anywhere in Hermes'.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from wsinfer.tools import (
    CLOSE,
    SEPARATORS,
    CallStream,
    Parsed,
    ToolCallParser,
    call_text,
    grammar_for,
    read_call,
    spec_parallel,
)


class CallParser(Protocol):
    count: int  # calls handed out so far

    def feed(self, piece: str) -> Parsed: ...

    def finish(self) -> Parsed: ...


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # The key a call's arguments go under as the model writes them.
    arguments_key: str
    # Written before the calls ('' for none), and between two calls.
    lead: str
    joiner: str

    def calls_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """An assistant's calls as the model writes them."""
        if self is HERMES:
            return "\n".join(call_text(name, arguments) for name, arguments in calls)
        bodies = [self._body(name, arguments) for name, arguments in calls]
        if self is MISTRAL:
            return self.lead + "[" + self.joiner.join(bodies) + "]"
        return self.joiner.join(bodies)

    def _body(self, name: str, arguments: dict[str, Any]) -> str:
        data = {"name": name, self.arguments_key: arguments}
        return json.dumps(data, separators=SEPARATORS, ensure_ascii=False)

    def parser(
        self, names: Iterable[str], call_id_prefix: str, streams: bool = False
    ) -> CallParser:
        """The reader of a turn's calls; ``streams``: it hands out each call's
        arguments as drawn (``tools.CallStream``), for a turn held to its calls."""
        if self is HERMES:
            return ToolCallParser(names, call_id_prefix, streams)
        return LeadingCalls(self, names, call_id_prefix, streams)

    def grammar_start(self, parallel: bool) -> list[str] | None:
        """The Lark rules around the call bodies (``body``) of a required call (None:
        Hermes', ``tools.grammar_for``'s own)."""
        if self is HERMES:
            return None
        if self is MISTRAL:
            many = ' (", " body)*' if parallel else ""
            return [f'start: "[" body{many} "]"']
        return ['start: body ("; " body)*' if parallel else "start: body"]

    @property
    def stop(self) -> str | None:
        """The stop string that ends a turn at its one call's end (no parallel calls):
        Hermes' closing tag; the JSON formats end with the model's end token."""
        return CLOSE if self is HERMES else None


HERMES = ToolFormat("hermes", "arguments", "", "\n")
LLAMA3_JSON = ToolFormat("llama3_json", "parameters", "", "; ")
MISTRAL = ToolFormat("mistral", "arguments", "[TOOL_CALLS]", ", ")
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


def call_grammar(spec: str, fmt: ToolFormat) -> str:
    """The grammar of a required call (``tools.call_format``'s spec) in ``fmt``."""
    return grammar_for(spec, fmt.grammar_start(spec_parallel(spec)), fmt.arguments_key)


def format_for_template(template: str | None) -> ToolFormat:
    """The format a chat template teaches: by the markers only its family's use."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return MISTRAL
    if "<|python_tag|>" in text or ('"parameters"' in text and "ipython" in text):
        return LLAMA3_JSON
    return HERMES


class LeadingCalls:
    """Reads the calls a JSON format writes at the start of the reply.

    As ``ToolCallParser``, what it hands out depends only on the text fed so far
    and is never taken back: while the reply may still be calls (it begins as one
    would) it is held; a complete call is handed out whole; text that is not a
    call, and all that follows it, is content. At the end (``finish``) whatever is
    held and is not a complete call is content.
    """

    def __init__(
        self, fmt: ToolFormat, names: Iterable[str], call_id_prefix: str, streams: bool = False
    ) -> None:
        self.fmt = fmt
        self.names = frozenset(names)
        self.call_id_prefix = call_id_prefix
        self.text = ""
        self.done = 0  # text[:done] is handed out
        self.count = 0
        self.content_mode = False  # the reply turned out to be text: all of it is content
        self._decoder = json.JSONDecoder()
        self.streams = streams
        # The calls of the value being drawn (Mistral's list holds several), their
        # parts out, and where the next of them may begin.
        self.drawn: list[CallStream] = []
        self._next_at = 0

    def feed(self, piece: str) -> Parsed:
        self.text += piece
        out = Parsed()
        if not self.content_mode:
            self._calls(out)
        if self.content_mode:
            out.content += self.text[self.done :]
            self.done = len(self.text)
        return out

    def finish(self) -> Parsed:
        out = self.feed("")
        if self.drawn:  # cut short after parts went out: they stay as far as they went
            return out  # (and a continue of the turn goes on drawing them), not text
        if self.done < len(self.text):  # held, and not a whole call: the model's text
            out.content += self.text[self.done :]
            self.done = len(self.text)
        return out

    def _calls(self, out: Parsed) -> None:
        while True:
            at = self._skip(self.done)
            rest = self.text[at:]
            if not rest:
                return
            if not self._may_be_calls(rest):
                self.content_mode = True
                return
            self._stream(out, at)
            try:
                value, end = self._decoder.raw_decode(self.text, at)
            except ValueError:
                return  # incomplete so far: held
            drawn, self.drawn = self.drawn, []
            calls = self._as_calls(value)
            if calls is None:
                self.content_mode = True
                return
            for call, stream in zip(calls, drawn, strict=False):
                stream.complete(call, out)
            out.calls += calls
            self.done = end

    def _stream(self, out: Parsed, at: int) -> None:
        """The parts of the calls of the value that begins at ``at``, drawn so far."""
        if not self.streams:
            return
        text = self.text
        if not self.drawn:  # the value may only now begin here (its lead was cut)
            self._next_at = at + 1 if self.fmt is MISTRAL else at  # past the list's "["
        while True:
            if self.drawn:
                last = self.drawn[-1]
                last.advance(text, len(text), out)
                if not last.args.complete or last.args.broken:
                    return
                after = _past(text, last.fed, "}")  # the end of that call's object
                if self.fmt is not MISTRAL or after is None:
                    return
                following = _past(text, after, ",")
                if following is None:
                    return
                self._next_at = following
            stream = CallStream.opening(
                text, self._next_at, len(text), self.names, (self.fmt.arguments_key, "arguments"),
                self.count + len(self.drawn), self.call_id_prefix, out,
            )  # fmt: skip
            if stream is None:
                return
            self.drawn.append(stream)
            self._next_at = len(text)  # moved on once this call's object has ended

    def _skip(self, at: int) -> int:
        """Past whitespace, the format's lead and the joiner between calls."""
        text = self.text
        while True:
            start = at
            while at < len(text) and text[at].isspace():
                at += 1
            for marker in (self.fmt.lead, self.fmt.joiner.strip()):
                if marker and text.startswith(marker, at):
                    at += len(marker)
            if at == start:
                return at

    def _may_be_calls(self, rest: str) -> bool:
        opening = "[" if self.fmt is MISTRAL else "{"
        lead = self.fmt.lead
        if lead and lead.startswith(rest):  # the lead itself, cut so far
            return True
        if not rest.startswith(opening):
            return False
        probe = rest[1:].lstrip()
        if self.fmt is MISTRAL:
            probe = probe[1:].lstrip() if probe.startswith("{") else probe
            if not probe:
                return True
        want = '"name"'
        return want.startswith(probe[: len(want)]) if probe else True

    def _as_calls(self, value: Any) -> list[dict[str, Any]] | None:
        items = value if isinstance(value, list) and self.fmt is MISTRAL else [value]
        if self.fmt is MISTRAL and not isinstance(value, list):
            return None
        calls = []
        for item in items:
            call = self._call(item)
            if call is None:
                return None
            calls.append(call)
        return calls

    def _call(self, item: Any) -> dict[str, Any] | None:
        if not isinstance(item, dict) or set(item) - {"name", "arguments", "parameters"}:
            return None
        arguments = item.get(self.fmt.arguments_key, item.get("arguments"))
        call = read_call(item.get("name"), arguments, self.names, self.call_id_prefix, self.count)
        if call is None:
            return None
        self.count += 1
        return call


def _past(text: str, at: int, mark: str) -> int | None:
    """Just past ``mark`` if it comes next in ``text`` (whitespace before it aside)."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at + 1 if text.startswith(mark, at) else None
