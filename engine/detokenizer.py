"""Incremental detokenization with stop strings.

Decoding token by token breaks two things: a UTF-8 character split across
byte-level tokens decodes to U+FFFD, and SentencePiece drops the leading space
of a token decoded on its own. Like vLLM and TGI we decode a small window of
previous tokens (``prefix_offset``..) and emit only the text that the newest
tokens added to it, once it no longer ends in a partial character.

Everything here is a pure function of the token ids fed in, so an engine that
replays a turn's token log rebuilds the exact state, including how much text
was already emitted.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context so the first generated token gets its space right.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        context_ids: list[int] | None = None,
        stop: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.tokenizer = tokenizer
        context = list(context_ids or [])[-CONTEXT_TOKENS:]
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.stop = tuple(s for s in stop if s)
        self.text = ""  # all text decoded so far (what the turn says, stop string included)
        self.emitted = 0  # len of the prefix of ``text`` that was handed out
        self.stopped = False  # a stop string matched; nothing more will be emitted

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the text that became final."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        self.text += self._decode_new()
        return self._release()

    def flush(self) -> str:
        """The turn ended without a stop string: hand out everything still held back."""
        if self.stopped:
            return ""
        tail = self._decode(self.ids[self.prefix_offset :])
        held = self._decode(self.ids[self.prefix_offset : self.read_offset])
        if len(tail) > len(held):
            self.text += tail[len(held) :]
        self.read_offset = len(self.ids)
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out

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

    def _release(self) -> str:
        if self.stop:
            cut = find_stop(self.text, self.stop, self.emitted)
            if cut is not None:
                self.stopped = True
                self.text = self.text[:cut]
                return self._emit_until(cut)
            return self._emit_until(len(self.text) - held_back(self.text, self.stop))
        return self._emit_until(len(self.text))

    def _emit_until(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted : end]
        self.emitted = end
        return out


def find_stop(text: str, stop: tuple[str, ...], emitted: int) -> int | None:
    """Index where the earliest stop string starts, searching only unemitted text."""
    start = max(0, emitted - max(len(s) for s in stop) + 1)
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that could begin a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
