"""What crosses the engine core's boundary, and a request's state inside it:
``EngineRequest`` in, ``RequestOutput`` out, ``Sequence`` between (a leaf the
lifecycle, the output processor and the schedulers share), and the one
``SequenceStatus`` both of them carry."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from wsinfer.contract import FinishReasonName
from wsinfer.sessions.schema import GenerationParams, TurnError, Usage
from wsinfer.tool_formats import CallParser

from .detokenizer import Detokenizer
from .grammar import Constraint
from .logprobs import TokenLogprob


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; a ``RequestOutput`` carries the one its
    sequence had when the output was built (RUNNING, or how it ended)."""

    WAITING = "waiting"  # queued (or preempted back to the queue): not in a batch
    RUNNING = "running"  # admitted: prefilling, or a decode row
    PAUSED = "paused"  # ended, its KV kept for a resume
    FINISHED = "finished"  # ended for good

    @property
    def ended(self) -> bool:
        return self in (SequenceStatus.PAUSED, SequenceStatus.FINISHED)


@dataclass(frozen=True)
class ToolCalls:
    """A turn with tools asks its text be split into content and completed calls:
    the calls' ids begin with ``call_id_prefix``; ``published`` is the text already
    out (a rebuilt turn's parser starts past it)."""

    call_id_prefix: str
    published: str = ""


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
    tool_calls: ToolCalls | None = None  # split the text into content and calls


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    text: str  # a turn with tools: its content, the calls taken out
    num_generated: int
    status: SequenceStatus = SequenceStatus.RUNNING
    finish_reason: FinishReasonName | None = None
    usage: Usage | None = None
    kv_len: int | None = None
    error: TurnError | None = None  # with finish_reason "error": its code, chosen here
    # With params.logprobs: one per new token but end-of-sequence ones (not content).
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # A turn with tools: what the model wrote, where ``text`` differs from it, the
    # calls completed here, in OpenAI's shape, and (a turn held to its calls) the
    # parts of calls drawn here (``wsinfer.tools.CallStream``).
    raw: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_parts: list[dict[str, Any]] | None = None

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def paused(self) -> bool:
        return self.status is SequenceStatus.PAUSED


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
    calls: CallParser | None = None  # a turn with tools: reads the calls out of its text
    status: SequenceStatus = SequenceStatus.WAITING

    @property
    def id(self) -> str:
        return self.request.request_id
