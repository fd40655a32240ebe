"""OpenAI's legacy text completions (``POST /v1/completions``), sans I/O.

A prompt in, text out: a raw-text wsinfer session (the WebSocket ``generate``
with ``prompt``), whose next turn continues the text exactly. The request is
checked by the same rules as a chat completion; the answers are
``text_completion`` objects, streamed as the chat chunks are (``id: SEQ``).

``logprobs: N`` asks for the legacy shape: per token its text, log-probability,
the ``N`` most likely tokens as a map, and its character offset in the text.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Any

from wsinfer.contract import DoneMessage
from wsinfer.http.openai import (
    IGNORED,
    OFF_VALUES,
    PARAMS,
    ChatRequest,
    Completion,
    as_generate,
    bad_request,
    check_fields,
    check_model,
    choices,
    finish_reason_of,
    flag,
    ignored_fields,
    json_object,
    openai_finish_reason,
    openai_usage,
    params_of,
    stream_options,
)
from wsinfer.messages import Limits
from wsinfer.sessions.schema import MAX_TOP_LOGPROBS

OBJECT = "text_completion"
# The legacy endpoint's own options, accepted only where they change nothing.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    **OFF_VALUES,
    "best_of": (None, 1),  # n is taken: n choices
    "echo": (None, False),
    "suffix": (None, ""),
    # Text in, text out: the legacy endpoint has no tools.
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
}


def parse_completion_request(
    body: bytes, limits: Limits, model: str, session: str | None, token: str | None
) -> ChatRequest:
    """Validate a ``POST /v1/completions`` body as a ``generate`` with a ``prompt``."""
    data = json_object(body)
    # Its logprobs is an integer, the number of most likely tokens beside each drawn one
    # (0: the drawn one's only): there is no top_logprobs.
    known = {"model", "prompt", "stream", "stream_options", "max_tokens", "n", *PARAMS}
    check_fields(data, known - {"top_logprobs", *_OFF_VALUES}, _OFF_VALUES, IGNORED)
    check_model(data, model)
    stream = flag(data, "stream")
    include_usage = stream_options(data.get("stream_options"), stream)
    params = params_of({k: v for k, v in data.items() if k != "logprobs" and k not in _OFF_VALUES})
    top = data.get("logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
            message = f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (or null)"
            raise bad_request(message, "logprobs")
        params.update(logprobs=True, top_logprobs=top)
    generate = {"type": "generate", "prompt": _prompt(data.get("prompt")), "params": params}
    names = {"max_new_tokens": "max_tokens", "top_logprobs": "logprobs"}
    text = as_generate(generate, limits, session, token, names)
    return ChatRequest(text, stream, include_usage, choices(data), ignored_fields(data, IGNORED))


def _prompt(raw: Any) -> str:
    """A string, or a list of one string (OpenAI's batch of prompts, of one)."""
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if not isinstance(raw, str):
        raise bad_request("prompt must be a string (or a list of one string)", "prompt")
    return raw


class TextOffsets:
    """Where each token's text starts in the text this answer delivers, in characters:
    the bytes of the tokens so far, decoded as far as they make whole characters (a
    token that ends inside a character starts where that character does)."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def legacy(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """The legacy ``logprobs`` object of ``entries`` (the chat shape's, in order)."""
        offsets = []
        for entry in entries:
            offsets.append(self.chars)
            self.chars += len(self._decoder.decode(bytes(entry["bytes"])))
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [
                {top["token"]: top["logprob"] for top in e.get("top_logprobs", ())} for e in entries
            ],
            "text_offset": offsets,
        }


@dataclass(frozen=True)
class TextCompletion(Completion):
    """A completion's names and shapes: ``Completion``'s, as ``text_completion``.

    One per answer (a response, or one stream of chunks): its log-probabilities'
    ``text_offset`` count from the start of what that answer delivers."""

    offsets: TextOffsets = field(default_factory=TextOffsets, compare=False, repr=False)

    @property
    def id(self) -> str:
        return f"cmpl-{self.session}-{self.turn}"

    def opening(self) -> dict[str, Any] | None:
        return None  # text has no role: the first chunk carries text

    def chunk(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        reason = None if finish_reason is None else openai_finish_reason(finish_reason)
        legacy = None if logprobs is None else self.offsets.legacy(logprobs)
        choice = {"index": self.index, "text": delta.get("content", ""), "logprobs": legacy}
        return self._envelope(OBJECT, choices=[{**choice, "finish_reason": reason}])

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return self._envelope(OBJECT, choices=[], usage=usage)

    def whole(
        self,
        text: str,
        done: DoneMessage,
        logprobs: list[dict[str, Any]] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,  # a text session has none
    ) -> dict[str, Any]:
        reason = openai_finish_reason(finish_reason_of(done))
        legacy = None if logprobs is None else TextOffsets().legacy(logprobs)
        choice = {"index": self.index, "text": text, "logprobs": legacy, "finish_reason": reason}
        return self._envelope(OBJECT, choices=[choice], usage=openai_usage(done["usage"]))
