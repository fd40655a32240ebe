"""OpenAI's legacy text completions (``POST /v1/completions``), sans I/O.

A prompt in, text out: a raw-text wsinfer session (the WebSocket ``generate``
with ``prompt``), whose next turn continues the text exactly. The request is
checked by the same rules as a chat completion; the answers are
``text_completion`` objects, streamed as the chat chunks are (``id: SEQ``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    flag,
    json_object,
    openai_finish_reason,
    openai_usage,
    params_of,
    stream_options,
)
from wsinfer.messages import Limits

OBJECT = "text_completion"
# The legacy endpoint's own options, accepted only where they change nothing.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    **OFF_VALUES,
    "best_of": (None, 1),
    "echo": (None, False),
    "logprobs": (None,),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
}


def parse_completion_request(
    body: bytes, limits: Limits, model: str, session: str | None, token: str | None
) -> ChatRequest:
    """Validate a ``POST /v1/completions`` body as a ``generate`` with a ``prompt``."""
    data = json_object(body)
    # Its logprobs is an integer with a shape of its own (not offered yet): no top_logprobs.
    known = {"model", "prompt", "stream", "stream_options", "max_tokens", *PARAMS}
    known -= {"logprobs", "top_logprobs"}
    check_fields(data, known, _OFF_VALUES, IGNORED)
    check_model(data, model)
    stream = flag(data, "stream")
    include_usage = stream_options(data.get("stream_options"), stream)
    generate = {
        "type": "generate",
        "prompt": _prompt(data.get("prompt")),
        "params": params_of(data),
    }
    return ChatRequest(as_generate(generate, limits, session, token), stream, include_usage)


def _prompt(raw: Any) -> str:
    """A string, or a list of one string (OpenAI's batch of prompts, of one)."""
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if not isinstance(raw, str):
        raise bad_request("prompt must be a string (or a list of one string)", "prompt")
    return raw


@dataclass(frozen=True)
class TextCompletion(Completion):
    """A completion's names and shapes: ``Completion``'s, as ``text_completion``."""

    @property
    def id(self) -> str:
        return f"cmpl-{self.session}-{self.turn}"

    def opening(self) -> dict[str, Any] | None:
        return None  # text has no role: the first chunk carries text

    def chunk(
        self,
        delta: dict[str, str],
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        reason = None if finish_reason is None else openai_finish_reason(finish_reason)
        choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None}
        return self._envelope(OBJECT, choices=[{**choice, "finish_reason": reason}])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return self._envelope(OBJECT, choices=[], usage=openai_usage(usage))

    def whole(
        self, text: str, done: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        reason = openai_finish_reason(done["finish_reason"])
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        return self._envelope(OBJECT, choices=[choice], usage=openai_usage(done["usage"]))
