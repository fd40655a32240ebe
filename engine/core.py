"""EngineCore: continuous batching over a paged KV pool, decode as CUDA graphs.

Knows nothing of transport: ``add`` / ``abort`` requests, call ``step`` in a
loop, publish its outputs. Each step (``lifecycle.CoreBase.step``, planned and
run as ``scheduled.ScheduledCore`` does for the eager core too)

1. ends pending aborts and pauses (their KV is retained in the pool);
2. asks the ``scheduler.Scheduler`` for the step's plan (``ScheduledStep``): it
   admits waiting requests while the batch and the pool have room, starting
   from a session's retained KV where it matches, or from the longest prefix
   of whole blocks any earlier prompt left in the pool (automatic prefix
   caching), gives every running row a KV slot (preempting a row when the pool
   is full) and picks the newcomers' prefill chunks;
3. has the ``runner.ModelRunner`` execute the plan: one decode step for every
   running row (a captured CUDA graph on a GPU: the model, paged attention and
   sampling, no host sync) and one prefill forward over up to
   ``prefill_chunk_tokens`` newcomer tokens (a ``runner.Launch``, its draws on
   their way to the host);
4. hands the scheduler one ``StepResult`` (``Scheduler.update``): what was
   launched, and the draws that reached the host: on a GPU those of the step
   before, while this one runs (``async_steps``), so detokenizing and
   publishing never leave the GPU idle; on CPU those of this step;
5. hands those draws to the lifecycle (``CoreBase._accept``), whose output
   processor turns each into its ``RequestOutput``.

Only Llama-family models run here (``llama.FastLlama``); ``build_core`` falls
back to ``EagerEngineCore`` for any other transformers model.
"""

from __future__ import annotations

import structlog
import torch

from . import native
from .attention_cpu import batch_invariant_here
from .batch import DecodeRows
from .eager import EagerEngineCore
from .grammar import Grammars
from .kvpool import KVHandles, KVPool
from .lifecycle import EngineConfig, EngineRequest, RequestOutput, UnsupportedConfig
from .llama import FastLlama, UnsupportedModel, fast_model_for
from .model import LoadedModel
from .quant import cpu_quantized_model
from .runner import Launch, ModelRunner
from .sampling import Variant, variant_of
from .scheduled import ScheduledCore
from .scheduler import PagedSequence, Scheduler
from .stats import CoreStats, kept_caches

__all__ = ["EngineConfig", "EngineCore", "EngineRequest", "RequestOutput", "build_core"]

log = structlog.get_logger("wsinfer.engine")

DEFAULT_MAX_MODEL_LEN = 8192


class EngineCore(ScheduledCore):
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
        self._variant: Variant | None = None  # of the decode rows; None: recompute
        self.graph_capture_seconds = 0.0
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

    def _kv_dtype(self) -> torch.dtype:
        """The pool's elements: the model's, or float16 where the native CPU attention
        reads it (elsewhere the torch attention would compute in it: refused)."""
        wanted, model = self.config.kv_dtype, self.model
        if wanted == "auto" or getattr(torch, wanted) == model.dtype:
            return model.dtype
        # A float32 CPU model whose forward runs the C++ kernels, but for soft-capped
        # scores (runner.use_native_attention's rule, before there is a pool to ask).
        native_attends = model.attn_softcap is None and native.on_native_path(model.embed)
        if wanted == "float16" and native_attends:
            return torch.float16
        raise UnsupportedConfig(
            f"--kv-dtype {wanted}: only the CPU engine's native attention, on a float32 "
            f"model, reads a KV cache of another dtype than the model's ({model.dtype})"
        )

    def _allocate_pool(self) -> KVPool:
        cfg, model = self.config, self.model
        dtype = self._kv_dtype()
        per_token = model.kv_bytes_per_token(dtype)
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
            dtype, model.device, idle,
        )  # fmt: skip

    # --- public API ---------------------------------------------------------------

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

    # --- launching a step ------------------------------------------------------------

    def _launch(self) -> Launch | None:
        """The scheduler's plan, run by the runner; None: nothing to run."""
        plan = self.scheduler.schedule()
        self._track_repetition(plan.admitted)
        if plan.empty:
            return None
        rows = self.scheduler.rows
        if plan.decode:
            self._variant = self._variant or variant_of([s.request.params for s in rows.seqs])
        return self.runner.execute(plan, rows, self._variant, self.grammars)

    def _joined(self, joined: list[PagedSequence]) -> None:
        """Newcomers took decode rows (their first draw at the runner's ``max_rows + j``):
        the runner's per-row state follows, and the rows' sampling variant is redone."""
        if joined:
            self._variant = None
        base = self.runner.max_rows
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

    # --- leaving ------------------------------------------------------------------------

    def _row_left(self, row: int, moved_from: int | None) -> None:
        """The scheduler vacated decode ``row`` (filled from ``moved_from``, if any): the
        runner's per-row state follows, and the rows' sampling variant is redone."""
        if moved_from is not None:
            self.runner.move_seen(moved_from, row)
        self._variant = None


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
