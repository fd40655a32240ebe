"""Log-probabilities of the drawn tokens, for turns that ask for them (``logprobs``).

They are the model's own: ``log_softmax`` of the raw logits (soft-capped where the
family caps them), before temperature, repetition penalty, top-k/top-p and
``min_tokens`` shape the draw, as vLLM reports them by default. So a token drawn at
temperature 0.8 carries the log-probability the model gives it, and the numbers
do not depend on how it was drawn.

Computed on the device beside the draw, for the whole batch when any row asks
(one ``log_softmax`` and one ``topk`` of ``MAX_TOP_LOGPROBS``), and copied to the
host with the tokens; rows that did not ask are never read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wsinfer.sessions.schema import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class TokenLogprob:
    """One drawn token's log-probability and the most likely tokens at its place."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), most likely first


class LogprobBuffers:
    """Per-row results of the last draw: the drawn token's log-probability and the
    ``MAX_TOP_LOGPROBS`` most likely tokens (rows indexed as the runner's tokens)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.chosen = torch.zeros(rows, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(rows, MAX_TOP_LOGPROBS, dtype=torch.long, device=device)
        self.top = torch.zeros(rows, MAX_TOP_LOGPROBS, dtype=torch.float32, device=device)

    def record(self, start: int, logprobs: torch.Tensor, tokens: torch.Tensor) -> None:
        """Rows ``start:start + len(tokens)`` from ``logprobs`` [B, V] and the drawn tokens."""
        end = start + tokens.shape[0]
        self.chosen[start:end] = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = min(MAX_TOP_LOGPROBS, logprobs.shape[1])
        top = logprobs.topk(k, dim=-1)
        self.top[start:end, :k] = top.values
        self.top_ids[start:end, :k] = top.indices


def model_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """float32 [B, V] log-probabilities of ``logits`` (taken before sampling, which may
    change the logits in place)."""
    return torch.log_softmax(logits.float(), dim=-1)


def host_copy(buffers: LogprobBuffers, rows: int) -> tuple[torch.Tensor, ...]:
    """The first ``rows`` rows of ``buffers``, copied to the host (asynchronously on CUDA)."""
    pin = buffers.chosen.device.type == "cuda"
    out = []
    for tensor in (buffers.chosen, buffers.top_ids, buffers.top):
        host = torch.empty(tensor[:rows].shape, dtype=tensor.dtype, pin_memory=pin)
        host.copy_(tensor[:rows], non_blocking=True)
        out.append(host)
    return tuple(out)


class HostLogprobs:
    """The copied rows, read once the step's copy is done; ``at(i, token, k)``."""

    def __init__(self, copies: tuple[torch.Tensor, ...]) -> None:
        chosen, top_ids, top = copies
        self.chosen: list[float] = chosen.tolist()
        self.top_ids: list[list[int]] = top_ids.tolist()
        self.top: list[list[float]] = top.tolist()

    def at(self, row: int, token: int, k: int) -> TokenLogprob:
        pairs = tuple(zip(self.top_ids[row][:k], self.top[row][:k], strict=True))
        return TokenLogprob(token, self.chosen[row], pairs)


# --- on the wire ---------------------------------------------------------------------

# OpenAI's stand-in for a log-probability too small to print (JSON has no -inf).
LOGPROB_FLOOR = -9999.0


def wire_entries(
    logprobs: list[TokenLogprob], token_bytes: Callable[[int], bytes]
) -> list[dict[str, Any]]:
    """The entries of a delta, in OpenAI's chat shape: ``token`` (its text; a piece of
    a multi-byte character shows as U+FFFD), ``logprob``, ``bytes`` (exact),
    ``top_logprobs`` (the same, without a ``top_logprobs`` of their own)."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token)
        return {
            "token": raw.decode("utf-8", "replace"),
            "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(raw),
        }

    out = []
    for lp in logprobs:
        entry = item(lp.token, lp.logprob)
        entry["top_logprobs"] = [item(t, v) for t, v in lp.top]
        out.append(entry)
    return out


class TokenBytes:
    """A token id's bytes under ``tokenizer`` (memoized).

    Byte-level BPE vocabularies (GPT-2's, Llama 3's, SmolLM2's, Qwen's) spell each byte
    with a printable stand-in character; those are mapped back exactly. Any other
    tokenizer's token is decoded alone and encoded as UTF-8."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, bytes] = {}
        probe = tokenizer.convert_ids_to_tokens(tokenizer.encode(" the", add_special_tokens=False))
        self.byte_level = any(isinstance(t, str) and t.startswith("\u0120") for t in probe)

    def __call__(self, token: int) -> bytes:
        cached = self.cache.get(token)
        if cached is None:
            cached = self.cache[token] = self._bytes(token)
        return cached

    def _bytes(self, token: int) -> bytes:
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return str(self.tokenizer.decode([token])).encode("utf-8")


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest for
    the characters from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(0x100 + i) for i, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_of_char()
