"""What every engine core shares: requests, outputs, and a request's life.

An engine core (``EngineCore`` on the paged fast path, ``EagerEngineCore`` for
any other transformers model, the model-free ``fake.FakeCore``) takes ``add`` /
``abort`` and returns ``RequestOutput`` lists from ``step``; ``Core`` is that
API, typed. ``CoreBase`` owns the part that does not depend on how the forward
pass runs: the step's skeleton (aborts and pauses, the forward, what a failed
forward does to its requests), admission checks, rebuilding a request from its
token log, and a sequence's end (its KV retained, its final output); what a
sampled token means (end-of-sequence, stop strings, length, tool calls, the
outputs) is the ``OutputProcessor``'s (``output.py``), which every core's draws
go through (``_accept``, ``_accept_tokens``).
Subclasses run the forward and say how a sequence's KV is retained and how it
leaves the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from wsinfer.contract import ErrorCode, FinishReasonName
from wsinfer.response_format import ResponseFormatError
from wsinfer.sessions.schema import TurnError, Usage

from .grammar import Grammars
from .logprobs import TokenLogprob
from .output import Accepted, OutputProcessor
from .requests import EngineRequest, RequestOutput, Sequence, SequenceStatus
from .sampling import fresh_seed
from .stats import CoreStats, kept_caches


class UnsupportedConfig(ValueError):
    """An ``EngineConfig`` this model or device cannot run: one line at start-up."""


@dataclass
class EngineConfig:
    max_batch_size: int = 16
    prefill_chunk_tokens: int = 512  # newcomers' prefill is chunked so running streams don't stall
    kv_cache_bytes: int = 2 * 2**30  # budget for retained KV caches (LRU)
    kv_offload_cpu: bool = False  # keep retained caches in host memory (saves GPU memory)
    compact_min_columns: int = 64  # eager path: trim shared left padding once it is this wide
    # Re-lay out CPU float32 linear weights for small batches. Decode steps on SmolLM2,
    # 2 threads, best of 3 interleaved: 1.01x at 1 stream, 1.16x at 4, 1.14x at 8.
    pack_cpu_weights: bool = True
    # CPU, a model loaded from a GGUF: multiply its Q4_1 blocks as they are (int4 kernel,
    # bfloat16 activations) instead of the de-quantized float32 copy (engine/quant.py):
    # about 2x the tokens/s. Its tokens are not the float32 path's (near-ties flip), but
    # as batch- and takeover-invariant (engine/attention_cpu.py).
    quantized_cpu_weights: bool = True
    # --- the paged fast path (Llama family) ---
    block_size: int = 16  # tokens per KV block
    # The KV pool's elements: "auto" (the model's dtype), "float32" or "float16". The
    # CPU's native attention widens float16 exactly as it loads it (engine/native_cpu.cpp):
    # half the bytes a long context's decode step reads.
    kv_dtype: str = "auto"
    # Share the KV blocks of any earlier prompt's beginning with a later one that starts
    # alike, whatever its session (engine/blocks.py).
    prefix_caching: bool = True
    max_model_len: int | None = None  # context limit; None: the model's, at most 8192
    kv_pool_bytes: int | None = None  # None: CUDA: from free memory; CPU: cache + running
    gpu_memory_reserve_bytes: int = 3 * 2**30  # CUDA: left free for activations and graphs
    cuda_graphs: bool | None = None  # None: on CUDA
    async_steps: bool | None = None  # overlap host work with the next step; None: on CUDA
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Core(Protocol):
    """What the engine process and its metrics use of a core: ``EngineCore``,
    ``EagerEngineCore`` and the model-free ``fake.FakeCore`` all have it, and
    the process holds none of them by its concrete type."""

    def stats(self) -> CoreStats:
        """Its counters now (read from the metrics' thread: plain reads)."""

    def add(self, request: EngineRequest) -> None: ...

    def abort(self, request_id: str, *, pause: bool = False) -> None:
        """End the request at the next step; ``pause`` keeps its KV for a resume."""

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished(self) -> bool: ...

    def cached_length(self, cache_key: str) -> int: ...

    def drop_cache(self, cache_key: str) -> None: ...

    @property
    def token_bytes(self) -> Callable[[int], bytes]:
        """A token's bytes, for logprobs entries."""

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


class CoreBase:
    """Request bookkeeping common to the engine cores; subclasses run the model."""

    store: Any  # retained KV caches by cache key (``length``, ``drop``)
    grammars: Grammars | None = None  # set by the cores whose sampling can be masked

    # What a response_format is refused with where the core has no grammars.
    no_grammar = "this engine cannot follow a response_format"

    def __init__(
        self, loaded: Any, config: EngineConfig | None, output: OutputProcessor | None = None
    ) -> None:
        """``loaded``: a ``LoadedModel`` (or a stand-in with its ``device``, where
        ``output`` is given: the output processor is otherwise the model's)."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.device = loaded.device
        self.output = output or OutputProcessor.for_model(loaded, loaded.max_context)
        self.eos = self.output.eos
        self.token_bytes = self.output.token_bytes  # for logprobs entries
        self._seqs: dict[str, Any] = {}
        self._immediate: dict[str, RequestOutput] = {}  # outputs due at the next step
        self._aborts: dict[str, bool] = {}  # request id -> pause

    @property
    def max_context(self) -> int:
        return self.output.max_context

    @max_context.setter
    def max_context(self, tokens: int) -> None:  # a core may serve less than the model's
        self.output.max_context = tokens

    # --- public API ---------------------------------------------------------

    def stats(self) -> CoreStats:
        return CoreStats(**kept_caches(self.store))

    def add(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self._seqs or rid in self._immediate:
            raise ValueError(f"duplicate request id {rid!r}")
        request = self.output.admitted(request)
        error = self._validate(request)
        if error is not None:
            self._immediate[rid] = refused(request, error)
            return
        seq = self._new_sequence(request)
        if request.params.response_format is not None:
            error = self._constrain(seq)
            if error is not None:
                self._immediate[rid] = refused(request, error)
                return
        done = self.output.already_done(seq)
        if done is not None:  # it ended before it was queued: no KV to keep, no place to leave
            seq.status = SequenceStatus.FINISHED
            self._immediate[rid] = self.output.final(seq, done, [], "")
            return
        self._seqs[rid] = seq
        self._enqueue(seq)

    def abort(self, request_id: str, *, pause: bool = False) -> None:
        if request_id in self._seqs:
            self._aborts[request_id] = pause

    def step(self) -> list[RequestOutput]:
        outputs = list(self._immediate.values())
        self._immediate.clear()
        with torch.inference_mode():
            outputs += self._process_aborts()
            try:
                outputs += self._forward()
            except Exception as exc:  # a failed forward must end its requests, not hang them
                outputs += self._fail_all(f"{type(exc).__name__}: {exc}")
            outputs += self._after_forward()
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._immediate)

    def cached_length(self, cache_key: str) -> int:
        """Tokens of ``cache_key``'s retained KV (0: none)."""
        return int(self.store.length(cache_key))

    def drop_cache(self, cache_key: str) -> None:
        self.store.drop(cache_key)

    # --- for subclasses ----------------------------------------------------------

    def _forward(self) -> list[RequestOutput]:
        """The step's model work; the outputs it has for now."""
        raise NotImplementedError

    def _after_forward(self) -> list[RequestOutput]:
        """What follows the forward, failed or not (outside its error handling)."""
        return []

    def _fail_all(self, message: str) -> list[RequestOutput]:
        """End every running request: the forward failed with ``message``."""
        raise NotImplementedError

    def _enqueue(self, seq: Any) -> None:
        raise NotImplementedError

    def _retain(self, seq: Any) -> int | None:
        """Keep ``seq``'s KV under its cache key; the retained length, or None."""
        raise NotImplementedError

    def _remove(self, seq: Any) -> None:
        raise NotImplementedError

    def _sequence_type(self) -> type[Sequence]:
        return Sequence

    # --- admission -----------------------------------------------------------

    def _validate(self, request: EngineRequest) -> TurnError | None:
        total = len(request.prompt_ids) + len(request.generated_ids)
        if total == 0:
            return TurnError(ErrorCode.BAD_REQUEST, "empty prompt")
        if total >= self.max_context:
            message = f"prompt of {total} tokens does not fit the context of {self.max_context}"
            return TurnError(ErrorCode.TOO_LARGE, message)
        return None

    def _new_sequence(self, request: EngineRequest) -> Any:
        params = request.params
        detok = self.output.detokenizer(request)
        seed = params.seed if params.seed is not None else fresh_seed()
        tokens = list(request.prompt_ids) + list(request.generated_ids)
        seq = self._sequence_type()(request, tokens, detok, seed, len(request.generated_ids))
        seq.calls = self.output.calls(request)
        return seq

    def _constrain(self, seq: Sequence) -> TurnError | None:
        """Give ``seq`` its response_format's matcher, past the tokens it already has."""
        fmt = seq.request.params.response_format
        if self.grammars is None or fmt is None:
            return TurnError(ErrorCode.BAD_REQUEST, self.no_grammar)
        try:
            seq.constraint = self.grammars.constraint(fmt, seq.request.generated_ids)
        except ResponseFormatError as exc:
            return TurnError(ErrorCode.BAD_REQUEST, str(exc))
        return None

    # --- results -------------------------------------------------------------------

    def _accept(
        self, seq: Sequence, token: int, logprob: TokenLogprob | None = None
    ) -> RequestOutput:
        """``seq``'s next sampled token, through the output processor: its output."""
        out = self._append(seq, token, logprob)
        if out.reason is not None:
            return self._final_output(
                seq, out.reason, out.new_ids, out.text, error=out.error, logprobs=out.logprobs
            )
        return self.output.output(seq, out)

    def _accept_tokens(
        self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob | None]
    ) -> RequestOutput:
        """Several of ``seq``'s tokens at once (up to the first that ends it), in one
        output: as ``_accept`` for each, their ids, text and logprobs joined."""
        if len(tokens) == 1:
            return self._accept(seq, tokens[0], logprobs[0])
        ids: list[int] = []
        text: list[str] = []
        entries: list[TokenLogprob] = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            out = self._append(seq, token, logprob)
            ids += out.new_ids
            text.append(out.text)
            entries += out.logprobs
            if out.reason is not None:
                return self._final_output(
                    seq, out.reason, ids, "".join(text), error=out.error, logprobs=entries
                )
        return self.output.output(seq, Accepted(ids, "".join(text), logprobs=entries))

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> Accepted:
        seq.tokens.append(token)
        seq.num_generated += 1
        if seq.seen is not None and token < seq.seen.shape[0]:
            seq.seen[token] = True
        return self.output.accept(seq, token, logprob)

    def _process_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid, pause in self._aborts.items():
            seq = self._seqs.get(rid)
            if seq is None:
                continue
            # Text still held back (the possible start of a stop string) is not
            # released: with no new token its delta would repeat the last delta's seq,
            # which followers drop as already seen. The turn's text ends before it.
            reason: FinishReasonName | None = None if pause else "cancelled"
            status = SequenceStatus.PAUSED if pause else SequenceStatus.FINISHED
            outputs.append(self._final_output(seq, reason, [], "", status=status))
        self._aborts.clear()
        return outputs

    def _final_output(
        self,
        seq: Sequence,
        reason: FinishReasonName | None,
        new_ids: list[int],
        text: str,
        *,
        status: SequenceStatus = SequenceStatus.FINISHED,
        error: TurnError | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RequestOutput:
        """End ``seq`` as ``status`` (retaining its KV under its cache key) and build its
        last output. Its status changes once it is removed: removing reads where it was."""
        kv_len = self._retain(seq) if error is None else None
        self._remove(seq)
        seq.status = status
        return self.output.final(
            seq, reason, new_ids, text, error=error, logprobs=logprobs, kv_len=kv_len
        )

    def _faulted(self, failed: list[Any], message: str) -> list[RequestOutput]:
        """End ``failed`` with an error of ours (a forward broke), not the requests'."""
        error = TurnError(ErrorCode.INTERNAL, message)
        return [self._final_output(s, "error", [], "", error=error) for s in failed]


def refused(request: EngineRequest, error: TurnError) -> RequestOutput:
    """The one output of a request ended before it ran (by ``error``)."""
    n = len(request.generated_ids)
    usage = Usage(len(request.prompt_ids), n, 0)
    finished = SequenceStatus.FINISHED
    return RequestOutput(request.request_id, [], "", n, finished, "error", usage=usage, error=error)
