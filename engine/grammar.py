"""Structured output in the engine: a turn's draws held to its response_format.

Each constrained sequence has an llguidance matcher (``Constraint``), advanced by
every token the turn accepts, and at its start by the tokens it already has (a
turn rebuilt after a takeover, or resumed). Before a step the host computes each
constrained row's allowed tokens into a packed bitmask, one bit per token (about
30 µs for SmolLM2's 49k tokens); the runner sets every other logit of that row to
-inf before sampling (``apply_bitmask``), so greedy, seeded and top-k/top-p draws
alike only ever pick an allowed token. Unconstrained rows are left untouched, bit
for bit. Log-probabilities stay the model's own, as for every other shaping of
the draw (docs/protocol.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.hf
import torch

from wsinfer import tools
from wsinfer.response_format import ResponseFormatError, grammar_for
from wsinfer.tool_formats import ToolFormat, call_grammar, format_for_template

ALL_ALLOWED = -1  # an int32 word with every bit set
# Compiled formats kept for the next turn that sends the same one (an application
# sends its schema again and again); compiling a large schema takes milliseconds.
COMPILED_FORMATS = 64
# From this many constrained rows in a step, masks are computed on llguidance's thread
# pool (a GPU batch: 256 rows one after another would be ~8 ms of host time a step).
PARALLEL_MASK_ROWS = 16


class Constraint:
    """One turn's matcher: what it may draw next, and whether its document is done."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar does not allow it."""
        return bool(self.matcher.consume_token(token))

    def failure(self) -> str | None:
        """Why the matcher gave up before the last draw (a schema whose parse grew past
        llguidance's limits: its mask then allowed nothing), or None."""
        return str(self.matcher.get_error()) if self.matcher.is_error() else None

    @property
    def done(self) -> bool:
        """The document is complete: nothing (but the end of the sequence) may follow."""
        return bool(self.matcher.is_stopped())


class Grammars:
    """Compiles response formats against the model's tokenizer (built once, lazily:
    about half a second) and hands out a ``Constraint`` per turn."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Iterable[int]) -> None:
        self._hf = tokenizer
        # How this model writes tool calls, for the grammar of a required one.
        self.calls = format_for_template(getattr(tokenizer, "chat_template", None))
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._eos = sorted(eos_ids)
        self._tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # format -> pristine matcher
        self._executor: Any = None

    def constraint(self, response_format: str, tokens: Sequence[int] = ()) -> Constraint:
        """The constraint of a checked format, advanced past ``tokens`` (already drawn).
        Raises ``ResponseFormatError`` where it cannot be built or ``tokens`` break it."""
        matcher = self._compile(response_format).deep_copy()
        if tokens and not matcher.consume_tokens(list(tokens)):
            raise ResponseFormatError("the turn's tokens so far break its response_format")
        return Constraint(matcher)

    def _compile(self, response_format: str) -> Any:
        pristine = self._compiled.get(response_format)
        if pristine is not None:
            self._compiled.move_to_end(response_format)
            return pristine
        if self._tokenizer is None:  # about half a second, once
            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        pristine = llguidance.LLMatcher(self._tokenizer, _grammar(response_format, self.calls))
        if pristine.is_error():
            raise ResponseFormatError(f"response_format cannot be enforced: {pristine.get_error()}")
        self._compiled[response_format] = pristine
        if len(self._compiled) > COMPILED_FORMATS:
            self._compiled.popitem(last=False)
        return pristine

    def bitmask(self, constraints: Sequence[Constraint | None]) -> torch.Tensor | None:
        """[rows, words] int32: each constrained row's allowed tokens, all bits set for
        the others; None if no row is constrained."""
        if all(c is None for c in constraints):
            return None
        mask = torch.full((len(constraints), self.words), ALL_ALLOWED, dtype=torch.int32)
        rows = [(c.matcher, row) for row, c in enumerate(constraints) if c is not None]
        if len(rows) >= PARALLEL_MASK_ROWS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(rows, mask.data_ptr(), 4 * self.words, len(mask))
        else:
            for matcher, row in rows:
                target = mask[row]
                matcher.unsafe_compute_mask_ptr(target.data_ptr(), 4 * self.words)
        return mask


def _grammar(fmt: str, calls: ToolFormat) -> str:
    """A format's grammar: a response_format's, or the calls a tool_choice requires,
    as the model writes them (``calls``)."""
    return call_grammar(fmt, calls) if tools.is_call_format(fmt) else grammar_for(fmt)


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [rows, vocab] with every token whose bit is clear set to -inf (rows
    past the bitmask's are left as they are). A new tensor: the input is not touched."""
    rows, vocab = bitmask.shape[0], logits.shape[1]
    words = bitmask.to(logits.device, non_blocking=True)
    bits = (words.unsqueeze(-1) >> _BITS.to(logits.device)) & 1  # [rows, words, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()
    out = logits.clone()
    out[:rows] = logits[:rows].masked_fill(~allowed, float("-inf"))
    return out
