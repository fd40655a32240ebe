"""Incremental detokenization with stop strings.

Decoding token by token breaks two things: a UTF-8 character split across
byte-level tokens decodes to U+FFFD, and SentencePiece drops the leading space
of a token decoded on its own. Two decoders get it right:

- ``ByteDetokenizer``, for byte-level BPE vocabularies (GPT-2's, Llama 3's,
  SmolLM2's, Qwen's), where a token's text is a fixed string of bytes: it
  appends each token's bytes to an incremental UTF-8 decoder, which holds back
  a character's leading bytes until its last one comes. One table lookup a
  token, where decoding a window costs two calls into the tokenizer (14 us a
  token on SmolLM2, most of the engine's host time per row at a large batch).
- ``IncrementalDetokenizer``, for any other tokenizer: like vLLM and TGI it
  decodes a small window of previous tokens (``prefix_offset``..) and emits
  only the text that the newest tokens added to it, once it no longer ends in
  a partial character.

``Detokenizers`` picks one per tokenizer, once: the byte decoder only where it
gives exactly what the tokenizer's own ``decode`` gives on a probe text.

Everything here is a pure function of the token ids fed in, so an engine that
replays a turn's token log rebuilds the exact state, including how much text
was already emitted.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from typing import Any, Protocol

from .logprobs import TokenBytes

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context so the first generated token gets its space right.
CONTEXT_TOKENS = 5
# Checked through both decoders when a tokenizer is loaded: multi-byte characters
# split across tokens, runs of spaces, newlines, punctuation a clean-up would move.
PROBE_TEXT = "Hello , world . isn't it?\n\n  naïve café 日本語 😀🎉 x\t= 4,2 ; 'q' \"r\""


class Detokenizer(Protocol):
    text: str  # all text decoded so far (what the turn says, stop string included)
    emitted: int  # len of the prefix of ``text`` that was handed out
    stopped: bool  # a stop string matched; nothing more will be emitted

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that became final."""
        ...

    def flush(self) -> str:
        """The turn ended without a stop string: hand out everything still held back."""
        ...


class _StopStrings:
    """What both decoders share: the text so far, and holding back what may begin a
    stop string."""

    def __init__(self, stop: tuple[str, ...] | list[str]) -> None:
        self.matcher = StopStrings(tuple(s for s in stop if s))
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _release(self) -> str:
        if self.matcher.stop:
            cut = self.matcher.find(self.text, self.emitted)
            if cut is not None:
                self.stopped = True
                self.text = self.text[:cut]
                return self._emit_until(cut)
            return self._emit_until(len(self.text) - self.matcher.held_back(self.text))
        return self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out

    def _emit_rest(self) -> str:
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out


class ByteDetokenizer(_StopStrings):
    """A byte-level vocabulary's tokens, as bytes through an incremental UTF-8 decoder."""

    def __init__(
        self, pieces: Callable[[int], bytes], stop: tuple[str, ...] | list[str] = ()
    ) -> None:
        """``pieces``: a token's bytes (``TokenPieces`` for a tokenizer)."""
        super().__init__(stop)
        self.pieces = pieces
        # Invalid bytes become U+FFFD, as the tokenizer's own (lossy) decode has them.
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.held = ""  # decoded, but kept back with a partial character after it

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.held += self.utf8.decode(self.pieces(int(token_id)))
        # Text joins ``text`` when the window decoder's would: once no character is
        # left incomplete (nor ends in U+FFFD). Both then cut deltas alike, so an
        # engine of either kind can take over a turn the other published.
        if self.held and not self.utf8.getstate()[0] and not self.held.endswith(REPLACEMENT_CHAR):
            self.text += self.held
            self.held = ""
        return self._release()

    def flush(self) -> str:
        if self.stopped:
            return ""
        self.text += self.held + self.utf8.decode(b"", final=True)
        self.held = ""
        return self._emit_rest()


class IncrementalDetokenizer(_StopStrings):
    """Any tokenizer: the text a window of recent tokens adds, decoded by the tokenizer."""

    def __init__(
        self,
        tokenizer: Any,
        context_ids: list[int] | None = None,
        stop: tuple[str, ...] | list[str] = (),
    ) -> None:
        super().__init__(stop)
        self.tokenizer = tokenizer
        context = list(context_ids or [])[-CONTEXT_TOKENS:]
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        self.text += self._decode_new()
        return self._release()

    def flush(self) -> str:
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix_offset :])
        held = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(tail) > len(held):
            self.text += tail[len(held) :]
        self.read_offset = len(self.ids)
        return self._emit_rest()

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _decode_new(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            # Partial UTF-8 sequence (or a token with no text yet): wait for more tokens.
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]


class TokenPieces:
    """A byte-level vocabulary's token id -> the bytes ``decode`` gives it (memoized):
    special tokens give none (decoding skips them), other added tokens their text."""

    def __init__(self, tokenizer: Any, token_bytes: TokenBytes | None = None) -> None:
        self.token_bytes = token_bytes or TokenBytes(tokenizer)
        self.byte_level = self.token_bytes.byte_level
        self.cache: dict[int, bytes] = {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        for token_id in added:
            text = tokenizer.decode([token_id], skip_special_tokens=True)
            self.cache[int(token_id)] = str(text).encode("utf-8")

    def __call__(self, token_id: int) -> bytes:
        piece = self.cache.get(token_id)
        if piece is None:
            piece = self.cache[token_id] = self.token_bytes(token_id)
        return piece


class Detokenizers:
    """Makes each turn's detokenizer, the byte decoder where the tokenizer allows it.
    ``token_bytes``: the core's own, for logprobs (one memo of a token's bytes)."""

    def __init__(self, tokenizer: Any, token_bytes: TokenBytes | None = None) -> None:
        self.tokenizer = tokenizer
        pieces = TokenPieces(tokenizer, token_bytes)
        self.pieces: TokenPieces | None = pieces if _agrees(tokenizer, pieces) else None

    @property
    def byte_level(self) -> bool:
        return self.pieces is not None

    def new(self, context_ids: list[int], stop: tuple[str, ...] | list[str]) -> Detokenizer:
        if self.pieces is not None:
            return ByteDetokenizer(self.pieces, stop)
        return IncrementalDetokenizer(self.tokenizer, context_ids, stop)


def _agrees(tokenizer: Any, pieces: TokenPieces) -> bool:
    """Whether the byte decoder hands out, token for token, what the window decoder
    does on the probe text (a vocabulary that is not byte-level, or a decode that
    cleans up or strips spaces, does not)."""
    if not pieces.byte_level:
        return False
    ids = list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))
    special = getattr(tokenizer, "all_special_ids", None) or []
    ids = ids + [int(i) for i in special]  # decoding skips them
    window: Detokenizer = IncrementalDetokenizer(tokenizer, ids[:2])
    byte: Detokenizer = ByteDetokenizer(pieces)
    deltas = [[d.add(i) for i in ids] + [d.flush()] for d in (window, byte)]
    return deltas[0] == deltas[1]


class StopStrings:
    """A turn's stop strings, prepared once: where one begins in the text, and how
    much of the text's tail could begin one (looked up in a set of their proper
    beginnings, not by scanning every stop string each token)."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.longest_stop = max((len(s) for s in stop), default=0)
        self.prefixes = frozenset(s[:n] for s in stop for n in range(1, len(s)))
        self.longest_prefix = max((len(p) for p in self.prefixes), default=0)
        self.ends = frozenset(p[-1] for p in self.prefixes)  # their last characters

    def find(self, text: str, emitted: int) -> int | None:
        """Index where the earliest stop string starts, searching only unemitted text."""
        start = max(0, emitted - self.longest_stop + 1)
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could begin a stop string."""
        if not text or text[-1] not in self.ends:
            return 0
        for n in range(min(self.longest_prefix, len(text)), 0, -1):
            if text[-n:] in self.prefixes:
                return n
        return 0
