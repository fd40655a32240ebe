"""Turn chat messages or raw text into prompt token ids."""

from __future__ import annotations

import weakref
from typing import Any

from wsinfer.tool_formats import ToolFormat, format_for_template
from wsinfer.tools import template_messages, template_tools

_PROBE_TOOL = [{"type": "function", "function": {"name": "probe", "parameters": {}}}]
_knows_tools: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: str | None = None
) -> list[int]:
    """The whole conversation through the chat template, ready for the assistant's
    reply; with ``tools`` (canonical JSON), told of them as wsinfer/tools.py says."""
    native = knows_tools(tokenizer)
    if not native:  # the template cannot write calls: they are written as the model does
        calls = format_for_template(getattr(tokenizer, "chat_template", None))
        messages = [_as_text(m, calls) for m in messages]
    conversation = template_messages(messages, tools, native)
    extra = {"tools": template_tools(tools)} if native and tools else {}
    ids = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
    )
    # Some tokenizer versions still hand back an encoding despite return_dict=False.
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _as_text(message: dict[str, Any], calls: ToolFormat) -> dict[str, Any]:
    """A message for a template that knows no tools: an assistant's calls written
    into its content in the model's format; a tool result without its call id."""
    if "tool_calls" in message:
        written = [
            (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
        ]
        parts = [message["content"]] if message["content"] else []
        return {"role": message["role"], "content": "\n".join([*parts, calls.calls_text(written)])}
    if "tool_call_id" in message:
        return {"role": message["role"], "content": message["content"]}
    return message


def knows_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders tools (Qwen's, Hermes', Llama
    3.1's do; SmolLM2's ignores them): asked once per tokenizer, by rendering."""
    known = _knows_tools.get(tokenizer)
    if known is None:
        probe = [{"role": "user", "content": "x"}]
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        try:
            told = tokenizer.apply_chat_template(probe, tools=_PROBE_TOOL, tokenize=False)
        except Exception:  # a template that refuses tools (raise_exception) does not know them
            told = plain
        known = _knows_tools[tokenizer] = plain != told
    return known


def render_text(tokenizer: Any, prompt: str, history_ids: list[int]) -> list[int]:
    """Raw completion mode: the history followed by the prompt's tokens.

    The BOS token only opens a conversation; a continuation must not repeat it.
    """
    ids = [int(i) for i in tokenizer.encode(prompt, add_special_tokens=False)]
    if history_ids:
        return list(history_ids) + ids
    if _wants_bos(tokenizer) and not (ids and ids[0] == tokenizer.bos_token_id):
        ids.insert(0, int(tokenizer.bos_token_id))
    return ids


def _wants_bos(tokenizer: Any) -> bool:
    if tokenizer.bos_token_id is None:
        return False
    flag = getattr(tokenizer, "add_bos_token", None)
    if flag is not None:
        return bool(flag)
    # Fall back to what the tokenizer's own post-processor does with special tokens.
    probe = tokenizer.encode("a", add_special_tokens=True)
    return bool(probe) and probe[0] == tokenizer.bos_token_id
