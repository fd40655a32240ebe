"""EngineCore: continuous batching over a paged KV pool, decode as CUDA graphs.

Knows nothing of transport: ``add`` / ``abort`` requests, call ``step`` in a
loop, publish its outputs. Each step (``lifecycle.CoreBase.step``)

1. ends pending aborts and pauses (their KV is retained in the pool);
2. asks the ``scheduler.Scheduler`` what to run: it admits waiting requests
   while the batch and the pool have room, starting from a session's retained
   KV where it matches, or from the longest prefix of whole blocks any earlier
   prompt left in the pool (automatic prefix caching), gives every running row
   a KV slot (preempting a row when the pool is full) and picks the newcomers'
   prefill chunks;
3. launches, through the ``runner.ModelRunner``, one decode step for every
   running row (a captured CUDA graph on a GPU: the model, paged attention and
   sampling, no host sync) and one prefill forward over up to
   ``prefill_chunk_tokens`` newcomer tokens, then tells the scheduler what ran;
4. hands out the tokens of a step: on a GPU those of the step before, while
   this one runs (``async_steps``), so detokenizing and publishing never
   leave the GPU idle; on CPU those of this step.

Only Llama-family models run here (``llama.FastLlama``); ``build_core`` falls
back to ``EagerEngineCore`` for any other transformers model.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from . import native
from .attention_cpu import batch_invariant_here
from .batch import DecodeRows
from .eager import EagerEngineCore
from .grammar import Grammars
from .kvpool import KVHandles, KVPool
from .lifecycle import CoreBase, EngineConfig, EngineRequest, RequestOutput, Sequence
from .llama import FastLlama, UnsupportedModel, fast_model_for
from .logprobs import HostLogprobs, host_copy
from .model import LoadedModel
from .quant import cpu_quantized_model
from .runner import ModelRunner
from .sampling import RowSampling, Variant, to_device, variant_of
from .scheduler import PagedSequence, ScheduledStep, Scheduler
from .stats import CoreStats, kept_caches

__all__ = ["EngineConfig", "EngineCore", "EngineRequest", "RequestOutput", "build_core"]

log = structlog.get_logger("wsinfer.engine")

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass
class _Launch:
    """One step's sampled tokens: which sequence each belongs to, and their host copy."""

    decode: list[PagedSequence | None]  # by row; None: the row computed nothing useful
    prefilled: list[PagedSequence]  # at last_tokens[max_rows + j]
    host: torch.Tensor
    event: torch.cuda.Event | None  # the step's end on the GPU (CUDA only)
    start: torch.cuda.Event | None = None  # its start on the GPU
    previous_end: torch.cuda.Event | None = None  # the end of the step launched before
    logprobs: tuple[torch.Tensor, ...] | None = None  # host copies, when a row asked


class EngineCore(CoreBase):
    grammars: Grammars

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        super().__init__(loaded, config)
        cfg = self.config
        on_cuda = self.device.type == "cuda"
        self.max_context = min(loaded.max_context, cfg.max_model_len or DEFAULT_MAX_MODEL_LEN)
        dtype = next(loaded.model.parameters()).dtype
        transposed = cfg.pack_cpu_weights and not on_cuda and dtype == torch.float32
        self.model: FastLlama = fast_model_for(loaded.model, self.max_context, transposed)
        if transposed and cfg.quantized_cpu_weights and loaded.gguf is not None:
            self.model = cpu_quantized_model(loaded.model, self.model, loaded.gguf)
        self.vocab_size = self.model.vocab_size
        self.grammars = Grammars(loaded.tokenizer, self.vocab_size, loaded.eos_token_ids)
        self._check_cpu_attention()
        self.pool = self._allocate_pool()
        offload = torch.device("cpu") if cfg.kv_offload_cpu and on_cuda else None
        self.store = KVHandles(self.pool, cfg.kv_cache_bytes, offload)
        self.scheduler = Scheduler(cfg, self.max_context, self.pool, self.store, self._row_left)
        max_blocks = self.pool.blocks_for(self.max_context)  # a row's whole context
        self.runner = ModelRunner(
            self.model, self.pool, cfg.max_batch_size, max_blocks, cfg.max_batch_size,
            cfg.graph_batch_sizes, sorted(loaded.eos_token_ids),
        )  # fmt: skip
        self.async_steps = on_cuda if cfg.async_steps is None else cfg.async_steps
        self._launched: _Launch | None = None  # this step's, until handed on
        self._pending: _Launch | None = None  # async steps: the last step's, not yet handed out
        self._variant: Variant | None = None  # of the decode rows; None: recompute
        self._hosts = [self._host_buffer() for _ in range(2)]
        self._flip = 0
        self.graph_capture_seconds = 0.0
        # GPU time spent waiting for the host between steps (CUDA): what async steps and
        # pipelined publishing are meant to keep near zero.
        self.gpu_idle_seconds = 0.0
        self.steps = 0
        self._last_end: torch.cuda.Event | None = None
        if cfg.cuda_graphs if cfg.cuda_graphs is not None else on_cuda:
            self.graph_capture_seconds = self.runner.capture_graphs(
                lambda line: log.info(line, pool_blocks=self.pool.num_blocks)
            )

    # --- set-up ----------------------------------------------------------------

    def _check_cpu_attention(self) -> None:
        """Warn where this CPU's kernels break the batch-invariant attention's premises:
        tokens would then still be exactly-once, but a seeded turn could draw others
        alone than batched, or after a takeover."""
        model = self.model
        if self.device.type != "cpu" or model.attn_softcap is not None:
            return
        if model.dtype == torch.float32 and native.kernels() is not None:
            # The C++ kernels attend (their order is their code's), loaded now rather
            # than at the first request (built first where `wsinfer prepare` was not run).
            return
        shape = (model.num_heads, model.num_kv_heads, model.head_dim, self.config.block_size)
        if not batch_invariant_here(*shape):
            log.warning(
                "CPU attention is not batch-invariant on this machine: seeded turns may "
                "draw differently in another batch or after a takeover",
                cpu=torch.backends.cpu.get_cpu_capability(),
            )

    def _allocate_pool(self) -> KVPool:
        cfg, model = self.config, self.model
        per_token = model.kv_bytes_per_token()
        budget = cfg.kv_pool_bytes
        if budget is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(0.9 * (free - cfg.gpu_memory_reserve_bytes))
        if budget is None:
            # CPU: room for every row at full context plus the retained caches; the pages
            # are only touched as blocks are used.
            budget = cfg.kv_cache_bytes + cfg.max_batch_size * self.max_context * per_token
        blocks = max(2, budget // (per_token * cfg.block_size))
        # Blocks of the prefix cache nobody holds are kept within the retained caches'
        # budget: beyond it the oldest go back to the free list.
        idle = cfg.kv_cache_bytes // (per_token * cfg.block_size)
        return KVPool(
            model.num_layers, blocks, cfg.block_size, model.num_kv_heads, model.head_dim,
            model.dtype, model.device, idle,
        )  # fmt: skip

    def _host_buffer(self) -> torch.Tensor:
        pin = self.device.type == "cuda"
        return torch.zeros(2 * self.config.max_batch_size, dtype=torch.long, pin_memory=pin)

    # --- public API ---------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._immediate or self._pending)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def stats(self) -> CoreStats:
        scheduler, pool = self.scheduler, self.pool
        return CoreStats(
            **kept_caches(self.store),
            pool_blocks=pool.num_blocks,
            pool_free_blocks=pool.free_blocks,
            pool_cached_blocks=pool.cached_blocks,
            preemptions=scheduler.preemptions,
            prefill_tokens=scheduler.prefill_tokens,
            prefix_cache_queries=scheduler.prefix_cache_queries,
            prefix_cache_hits=scheduler.prefix_cache_hits,
            gpu_idle_seconds=self.gpu_idle_seconds,
            graph_capture_seconds=self.graph_capture_seconds,
        )

    # The scheduler's state and counters, read by benchmarks and tests.

    @property
    def rows(self) -> DecodeRows:
        return self.scheduler.rows

    @property
    def preemptions(self) -> int:
        return self.scheduler.preemptions

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens that went through the model."""
        return self.scheduler.prefill_tokens

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens of admitted requests (vllm:prefix_cache_queries)."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens a kept or shared KV cache spared (vllm:prefix_cache_hits)."""
        return self.scheduler.prefix_cache_hits

    # --- the step (``CoreBase.step``) --------------------------------------------------

    def _forward(self) -> list[RequestOutput]:
        """Launch this step; its tokens are handed out by ``_after_forward``."""
        self._launched = self._launch()
        return []

    def _after_forward(self) -> list[RequestOutput]:
        """Hand out the tokens of the step before (async steps) or of this one; a failed
        launch left none (and ``_fail_all`` dropped the pending one)."""
        launch, self._launched = self._launched, None
        if self.async_steps:
            previous, self._pending = self._pending, launch
        else:
            previous = launch
        return self._process(previous) if previous is not None else []

    # --- admission -----------------------------------------------------------------

    def _sequence_type(self) -> type[Sequence]:
        return PagedSequence

    def _enqueue(self, seq: PagedSequence) -> None:
        self.scheduler.add(seq)

    def _track_repetition(self, admitted: list[PagedSequence]) -> None:
        """Mark the context tokens of newly admitted sequences a repetition penalty reads."""
        for seq in admitted:
            if seq.request.params.repetition_penalty != 1.0:
                seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seq.seen[to_device(seq.tokens, self.device)] = True

    # --- launching a step ------------------------------------------------------------

    def _launch(self) -> _Launch | None:
        step = self.scheduler.schedule()
        self._track_repetition(step.admitted)
        if step.empty:
            return None
        start = _timing_event() if self.device.type == "cuda" else None
        decode = step.decode
        logprobs = False
        if decode:
            rows = self.scheduler.rows
            self._variant = self._variant or variant_of([s.request.params for s in rows.seqs])
            logprobs = any(s is not None and s.request.params.logprobs for s in decode)
            allowed = self.grammars.bitmask([s.constraint if s else None for s in decode])
            self.runner.decode(rows, self._variant, logprobs, allowed)
            self.scheduler.decoded(decode)
        prefilled = self._run_prefill(step) if step.prefill else []
        logprobs = logprobs or any(s.request.params.logprobs for s in prefilled)
        launch = self._record(decode, prefilled, logprobs)
        launch.start, launch.previous_end = start, self._last_end
        self._last_end = launch.event
        return launch

    def _run_prefill(self, step: ScheduledStep) -> list[PagedSequence]:
        complete = step.completing
        draws = [RowSampling(s.request.params, s.seed, s.num_generated) for s in complete]
        logprobs = any(s.request.params.logprobs for s in complete)
        allowed = self.grammars.bitmask([s.constraint for s in complete])
        self.runner.prefill(step.prefill, draws, logprobs, allowed)
        base = self.runner.max_rows  # where the runner put their first tokens
        joined = self.scheduler.prefilled(step.prefill, base)
        if joined:
            self._variant = None  # the rows' sampling parameters changed
        for j, seq in enumerate(joined):
            params = seq.request.params
            if params.repetition_penalty == 1.0 and not params.counts_tokens:
                continue
            assert seq.row is not None
            if params.repetition_penalty != 1.0:
                self.runner.reset_seen(seq.row, seq.tokens, base + j)
            if params.counts_tokens:  # the turn's tokens: those after its prompt
                turn = seq.tokens[len(seq.request.prompt_ids) :]
                self.runner.reset_counts(seq.row, turn, base + j)
        return joined

    def _record(
        self, decode: list[PagedSequence | None], prefilled: list[PagedSequence], logprobs: bool
    ) -> _Launch:
        """Start copying the step's tokens (and log-probabilities, if a row asked) to the
        host; the step's only sync waits for it."""
        host = self._hosts[self._flip]
        self._flip ^= 1
        last = self.runner.last_tokens
        n = len(last) if prefilled else len(decode)
        host[:n].copy_(last[:n], non_blocking=True)
        copies = host_copy(self.runner.logprobs, n) if logprobs else None
        event = _timing_event() if self.device.type == "cuda" else None
        return _Launch(decode, prefilled, host, event, logprobs=copies)

    # --- handing out tokens -------------------------------------------------------------

    def _process(self, launch: _Launch) -> list[RequestOutput]:
        if launch.event is not None:
            launch.event.synchronize()
            self._count_idle(launch)
        self.steps += 1
        tokens = launch.host.tolist()
        base = self.runner.max_rows
        rows = [(s, i) for i, s in enumerate(launch.decode) if s is not None]
        rows += [(s, base + j) for j, s in enumerate(launch.prefilled)]
        logprobs = HostLogprobs(launch.logprobs) if launch.logprobs is not None else None
        outputs = []
        for seq, i in rows:
            if not seq.status.ended:  # not ended or aborted since the launch
                self.scheduler.token_received(seq)
                params = seq.request.params
                lp = None
                if logprobs is not None and params.logprobs:
                    lp = logprobs.at(i, tokens[i], params.top_logprobs)
                outputs.append(self._accept(seq, tokens[i], lp))
        return outputs

    def _count_idle(self, launch: _Launch) -> None:
        if launch.start is not None and launch.previous_end is not None:
            gap = launch.previous_end.elapsed_time(launch.start) / 1000
            self.gpu_idle_seconds += max(0.0, gap)

    # --- leaving ------------------------------------------------------------------------

    def _retain(self, seq: PagedSequence) -> int | None:
        return self.scheduler.retain(seq)

    def _remove(self, seq: PagedSequence) -> None:
        self._seqs.pop(seq.id, None)
        self.scheduler.remove(seq)

    def _row_left(self, row: int, moved_from: int | None) -> None:
        """The scheduler vacated decode ``row`` (filled from ``moved_from``, if any): the
        runner's per-row state follows, and the rows' sampling variant is redone."""
        if moved_from is not None:
            self.runner.move_seen(moved_from, row)
        self._variant = None

    def _fail_all(self, message: str) -> list[RequestOutput]:
        failed = self.scheduler.running_and_prefilling()
        self._pending = None
        return self._faulted(failed, message)


def _timing_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def build_core(
    loaded: LoadedModel, config: EngineConfig | None = None
) -> EngineCore | EagerEngineCore:
    """The paged ``EngineCore`` where the model family is supported, else the eager one."""
    try:
        core = EngineCore(loaded, config)
    except UnsupportedModel as exc:
        log.info("using the eager engine", reason=str(exc))
        return EagerEngineCore(loaded, config)
    family = core.model.config.model_type
    log.info("using the fast engine", reason=f"model type {family!r} is one of its families")
    return core
