"""The one output processor: what each sampled token means for its turn.

Every core (``EngineCore`` on the paged fast path, ``EagerEngineCore``, the
model-free ``fake.FakeCore``) hands every sampled token to
``OutputProcessor.accept``, through the lifecycle (``CoreBase._accept``). It
owns the detokenizer (text held back for a partial UTF-8 character or a
possible stop string, rebuilt from a turn's token log), the end-of-sequence
tokens, stop strings, the length and context limits, the response_format's
matcher, and the logprobs entries that ride with a token, and a turn's tool
calls (its text split into content and completed calls, ``tool_calls.py``);
and it builds every output. The cores keep only what depends on how the forward runs: where a
sequence's KV goes when it ends, and how it leaves the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from wsinfer.contract import ErrorCode, FinishReasonName
from wsinfer.sessions.schema import GenerationParams, TurnError, Usage
from wsinfer.tool_formats import CallParser, ToolFormat, format_for_template

from .detokenizer import Detokenizer, Detokenizers
from .logprobs import TokenBytes, TokenLogprob
from .model import LoadedModel
from .requests import EngineRequest, RequestOutput, Sequence
from .tool_calls import call_parser, split_calls, with_tools


@dataclass(frozen=True)
class Accepted:
    """What one sampled token gives its turn: the ids and text of its output, and
    why the turn ends here, if it does."""

    new_ids: list[int]
    text: str
    reason: FinishReasonName | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: TurnError | None = None


class MakesDetokenizers(Protocol):
    """Where a turn's detokenizer comes from (``detokenizer.Detokenizers`` for a model)."""

    def new(self, context_ids: list[int], stop: tuple[str, ...] | list[str]) -> Detokenizer: ...


class OutputProcessor:
    def __init__(
        self,
        eos: Iterable[int],
        max_context: int,
        token_bytes: Callable[[int], bytes],
        detokenizers: MakesDetokenizers,
        tool_format: ToolFormat,
    ) -> None:
        self.eos = frozenset(eos)
        self.max_context = max_context
        self.token_bytes = token_bytes  # for logprobs entries
        self.detokenizers = detokenizers
        self.tool_format = tool_format  # the model writes its calls so: read back alike

    @classmethod
    def for_model(cls, loaded: LoadedModel, max_context: int) -> OutputProcessor:
        """A loaded model's: its tokenizer's detokenizers, its chat template's tool calls."""
        token_bytes = TokenBytes(loaded.tokenizer)
        detokenizers = Detokenizers(loaded.tokenizer, token_bytes)
        tool_format = format_for_template(getattr(loaded.tokenizer, "chat_template", None))
        return cls(loaded.eos_token_ids, max_context, token_bytes, detokenizers, tool_format)

    def ends(self, params: GenerationParams) -> frozenset[int]:
        """The tokens that end a turn: the model's end-of-sequence tokens, unless ignored."""
        return frozenset() if params.ignore_eos else self.eos

    def admitted(self, request: EngineRequest) -> EngineRequest:
        """``request`` as the core runs it (a turn with tools: held to its calls)."""
        return with_tools(request, self.tool_format)

    def calls(self, request: EngineRequest) -> CallParser | None:
        """A turn with tools: the parser of its calls, past the text already out."""
        return call_parser(request, self.tool_format)

    def detokenizer(self, request: EngineRequest) -> Detokenizer:
        """A request's detokenizer, rebuilt past its token log: the text of those
        tokens was published already."""
        detok = self.detokenizers.new(request.prompt_ids, request.params.stop)
        ends = self.ends(request.params)
        for token in request.generated_ids:
            if token not in ends:
                detok.add(token)
        if request.released:
            detok.flush()  # what it would hold back went out with the turn's end
        return detok

    def already_done(self, seq: Sequence) -> FinishReasonName | None:
        """A rebuilt turn that had in fact ended (the caller missed its end)."""
        generated = seq.request.generated_ids
        if seq.detok.stopped or (generated and generated[-1] in self.ends(seq.request.params)):
            return "stop"
        if generated and seq.constraint is not None and seq.constraint.done:
            return "stop"
        if seq.num_generated >= seq.request.params.max_new_tokens:
            return "length"
        return None

    def accept(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> Accepted:
        """``token``, just appended to ``seq``: its text, and whether it ends the turn."""
        logprobs = [logprob] if logprob is not None else []
        constraint = seq.constraint
        if constraint is not None:
            failure = constraint.failure()
            if failure is not None or not constraint.accept(token):
                error = _broken_format(token, failure)
                return Accepted([], seq.detok.flush(), "error", logprobs, error)
        if token in self.ends(seq.request.params):
            return Accepted([token], seq.detok.flush(), "stop")
        text = seq.detok.add(token)
        reason: FinishReasonName | None = None
        if seq.detok.stopped:
            reason = "stop"
        elif constraint is not None and constraint.done:
            reason, text = "stop", text + seq.detok.flush()  # the document is complete
        elif self.out_of_room(seq):
            reason, text = "length", text + seq.detok.flush()
        return Accepted([token], text, reason, logprobs)

    def out_of_room(self, seq: Sequence) -> bool:
        max_new = seq.request.params.max_new_tokens
        return seq.num_generated >= max_new or len(seq.tokens) >= self.max_context

    def output(self, seq: Sequence, accepted: Accepted) -> RequestOutput:
        """The output of a token that did not end ``seq``'s turn."""
        out = RequestOutput(
            seq.id, accepted.new_ids, accepted.text, seq.num_generated, logprobs=accepted.logprobs
        )
        return self._split(seq, out)

    def final(
        self,
        seq: Sequence,
        reason: FinishReasonName | None,
        new_ids: list[int],
        text: str,
        *,
        error: TurnError | None = None,
        logprobs: list[TokenLogprob] | None = None,
        kv_len: int | None = None,
    ) -> RequestOutput:
        """A sequence's last output, as it ended (``seq.status``: paused or finished)."""
        usage = Usage(len(seq.request.prompt_ids), seq.num_generated, seq.cached_tokens)
        out = RequestOutput(
            seq.id,
            new_ids,
            text,
            seq.num_generated,
            status=seq.status,
            finish_reason=reason,
            usage=usage,
            kv_len=kv_len,
            error=error,
            logprobs=logprobs or [],
        )
        return self._split(seq, out)

    def _split(self, seq: Sequence, out: RequestOutput) -> RequestOutput:
        return split_calls(seq.calls, out) if seq.calls is not None else out


def _broken_format(token: int, failure: str | None) -> TurnError:
    """The error that ends a turn whose draw its grammar did not allow."""
    if failure is not None:  # the schema grew too complex to follow: the client's to fix
        message = f"the response_format could not be followed: {failure[:300]}"
        return TurnError(ErrorCode.BAD_REQUEST, message)
    # The mask lets no such token through: a bug of ours, not the client's doing.
    return TurnError(ErrorCode.INTERNAL, f"token {token} breaks the turn's response_format")
