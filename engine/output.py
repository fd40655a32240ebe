"""The one output processor: what each sampled token means for its turn.

Both model cores (``EngineCore`` on the paged fast path, ``EagerEngineCore``)
hand every sampled token to ``OutputProcessor.accept``. It owns the
detokenizer (text held back for a partial UTF-8 character or a possible stop
string, rebuilt from a turn's token log), the end-of-sequence tokens, stop
strings, the length and context limits, the response_format's matcher, and
the logprobs entries that ride with a token; and it builds every final
output. The cores keep only what depends on how the forward runs: where a
sequence's KV goes when it ends, and how it leaves the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from wsinfer.contract import ErrorCode, FinishReasonName
from wsinfer.sessions.schema import GenerationParams, TurnError, Usage

from .detokenizer import Detokenizer, Detokenizers
from .logprobs import TokenBytes, TokenLogprob
from .model import LoadedModel
from .requests import EngineRequest, RequestOutput, Sequence


@dataclass(frozen=True)
class Accepted:
    """What one sampled token gives its turn: the ids and text of its output, and
    why the turn ends here, if it does."""

    new_ids: list[int]
    text: str
    reason: FinishReasonName | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: TurnError | None = None


class OutputProcessor:
    def __init__(self, loaded: LoadedModel, max_context: int) -> None:
        self.eos = frozenset(loaded.eos_token_ids)
        self.max_context = max_context
        self.token_bytes = TokenBytes(loaded.tokenizer)  # for logprobs entries
        self.detokenizers = Detokenizers(loaded.tokenizer, self.token_bytes)

    def ends(self, params: GenerationParams) -> frozenset[int]:
        """The tokens that end a turn: the model's end-of-sequence tokens, unless ignored."""
        return frozenset() if params.ignore_eos else self.eos

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

    def final(
        self,
        seq: Sequence,
        reason: FinishReasonName | None,
        new_ids: list[int],
        text: str,
        *,
        paused: bool = False,
        error: TurnError | None = None,
        logprobs: list[TokenLogprob] | None = None,
        kv_len: int | None = None,
    ) -> RequestOutput:
        """A sequence's last output (``paused``: it is kept for a resume)."""
        usage = Usage(len(seq.request.prompt_ids), seq.num_generated, seq.cached_tokens)
        return RequestOutput(
            seq.id,
            new_ids,
            text,
            seq.num_generated,
            finished=not paused,
            finish_reason=reason,
            paused=paused,
            usage=usage,
            kv_len=kv_len,
            error=error,
            logprobs=logprobs or [],
        )


def _broken_format(token: int, failure: str | None) -> TurnError:
    """The error that ends a turn whose draw its grammar did not allow."""
    if failure is not None:  # the schema grew too complex to follow: the client's to fix
        message = f"the response_format could not be followed: {failure[:300]}"
        return TurnError(ErrorCode.BAD_REQUEST, message)
    # The mask lets no such token through: a bug of ours, not the client's doing.
    return TurnError(ErrorCode.INTERNAL, f"token {token} breaks the turn's response_format")
