"""What crosses the engine core's boundary, and a request's state inside it:
``EngineRequest`` in, ``RequestOutput`` out, ``Sequence`` between (a leaf the
lifecycle, the output processor and the schedulers share)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from wsinfer.contract import FinishReasonName
from wsinfer.sessions.schema import GenerationParams, TurnError, Usage

from .detokenizer import Detokenizer
from .grammar import Constraint
from .logprobs import TokenLogprob


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: GenerationParams
    generated_ids: list[int] = field(default_factory=list)
    cache_key: str | None = None
    # The whole text of ``generated_ids`` is out, what a detokenizer holds back
    # included: the turn ended once (its end flushed that text) and goes on.
    released: bool = False


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str
    num_generated: int
    finished: bool = False
    finish_reason: FinishReasonName | None = None
    paused: bool = False
    usage: Usage | None = None
    kv_len: int | None = None
    error: TurnError | None = None  # with finish_reason "error": its code, chosen here
    # With params.logprobs: one per new token but end-of-sequence ones (not content).
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    """Engine-side state of one request."""

    request: EngineRequest
    tokens: list[int]  # prompt + generated so far (as known on the host)
    detok: Detokenizer
    seed: int
    num_generated: int
    computed: int = 0  # leading tokens whose KV exists
    cached_tokens: int = 0
    seen: torch.Tensor | None = None  # context-token mask for repetition_penalty
    constraint: Constraint | None = None  # its response_format's matcher

    @property
    def id(self) -> str:
        return self.request.request_id
