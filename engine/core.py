"""EngineCore: continuous batching over a paged KV pool, decode as CUDA graphs.

Knows nothing of transport: ``add`` / ``abort`` requests, call ``step`` in a
loop, publish its outputs. Each step

1. ends pending aborts and pauses (their KV is retained in the pool);
2. admits waiting requests while the batch and the pool have room, starting
   from a session's retained KV where it matches, or from the longest prefix
   of whole blocks any earlier prompt left in the pool (automatic prefix
   caching, ``blocks.BlockAllocator``: shared read-only, whatever the session);
3. launches one decode step for every running row (a captured CUDA graph on
   a GPU: the model, paged attention and sampling, no host sync) and one
   prefill forward over up to ``prefill_chunk_tokens`` newcomer tokens;
4. hands out the tokens of a step: on a GPU those of the step before, while
   this one runs (``async_steps``), so detokenizing and publishing never
   leave the GPU idle; on CPU those of this step.

Only Llama-family models run here (``llama.FastLlama``); ``build_core`` falls
back to ``EagerEngineCore`` for any other transformers model.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import structlog
import torch

from .attention_cpu import batch_invariant_here
from .batch import DecodeRows, PrefillPiece
from .blocks import ROOT
from .eager import EagerEngineCore
from .grammar import Grammars
from .kvbuffer import common_prefix
from .kvpool import KVHandles, KVPool
from .lifecycle import CoreBase, EngineConfig, EngineRequest, RequestOutput, Sequence
from .llama import FastLlama, UnsupportedModel, fast_model_for
from .logprobs import HostLogprobs, host_copy
from .model import LoadedModel
from .quant import cpu_quantized_model
from .runner import ModelRunner
from .sampling import RowSampling, Variant, to_device, variant_of

__all__ = ["EngineConfig", "EngineCore", "EngineRequest", "RequestOutput", "build_core"]

log = structlog.get_logger("wsinfer.engine")

DEFAULT_MAX_MODEL_LEN = 8192

# A newcomer whose prompt begins with at least this many tokens of an earlier newcomer's
# waits for that one to compute them (and put them in the prefix cache) instead of
# computing them too: 32 sessions arriving with one long system prompt prefill it once.
# Prompts sharing less (a chat template's header) are not worth a step's wait.
SHARED_PREFIX_WAIT_TOKENS = 128


@dataclass(eq=False)
class _Seq(Sequence):
    blocks: list[int] = field(default_factory=list)
    row: int | None = None  # decode row
    target: int = 0  # prefill: context tokens to compute before the first draw
    pending: int = 0  # tokens sampled on the device, not yet seen by the host
    chain: list[int] = field(default_factory=list)  # prefix-cache nodes of its full blocks
    looked_up: bool = False  # the prefix cache was searched since its admission
    preempted: bool = False


@dataclass
class _Launch:
    """One step's sampled tokens: which sequence each belongs to, and their host copy."""

    decode: list[_Seq | None]  # by row; None: the row computed nothing useful
    prefilled: list[_Seq]  # at last_tokens[max_rows + j]
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
        max_blocks = -(-self.max_context // cfg.block_size)
        self.pool = self._allocate_pool()
        offload = torch.device("cpu") if cfg.kv_offload_cpu and on_cuda else None
        self.store = KVHandles(self.pool, cfg.kv_cache_bytes, offload)
        self.rows = DecodeRows(cfg.max_batch_size, max_blocks, cfg.block_size)
        self.runner = ModelRunner(
            self.model, self.pool, cfg.max_batch_size, max_blocks, cfg.max_batch_size,
            cfg.graph_batch_sizes, sorted(loaded.eos_token_ids),
        )  # fmt: skip
        self.async_steps = on_cuda if cfg.async_steps is None else cfg.async_steps
        self._waiting: deque[_Seq] = deque()
        self._prefilling: list[_Seq] = []
        self._pending: _Launch | None = None
        self._variant: Variant | None = None  # of the decode rows; None: recompute
        self._hosts = [self._host_buffer() for _ in range(2)]
        self._flip = 0
        self.graph_capture_seconds = 0.0
        # GPU time spent waiting for the host between steps (CUDA): what async steps and
        # pipelined publishing are meant to keep near zero.
        self.gpu_idle_seconds = 0.0
        self.steps = 0
        self.preemptions = 0
        self.prefill_tokens = 0  # prompt tokens that went through the model
        # Prompt tokens of admitted requests, and those their prefill was spared by a kept
        # or shared KV cache (vllm:prefix_cache_queries / _hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
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

    def step(self) -> list[RequestOutput]:
        outputs = list(self._immediate.values())
        self._immediate.clear()
        with torch.inference_mode():
            outputs += self._process_aborts()
            try:
                launch = self._launch()
            except Exception as exc:  # a failed forward must end its requests, not hang them
                outputs += self._fail_all(f"{type(exc).__name__}: {exc}")
                launch = None
            if self.async_steps:
                previous, self._pending = self._pending, launch
            else:
                previous = launch
            if previous is not None:
                outputs += self._process(previous)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._immediate or self._pending)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._prefilling)

    # --- admission -----------------------------------------------------------------

    def _sequence_type(self) -> type[Sequence]:
        return _Seq

    def _enqueue(self, seq: _Seq) -> None:
        self._waiting.append(seq)

    def _admit(self) -> None:
        room = self.config.max_batch_size - len(self.rows) - len(self._prefilling)
        while self._waiting and room > 0 and not self._waiting[0].pending:
            seq = self._waiting.popleft()
            self._resume_from_cache(seq)
            seq.target = len(seq.tokens)
            if seq.request.params.repetition_penalty != 1.0:
                seq.seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=self.device)
                seq.seen[to_device(seq.tokens, self.device)] = True
            self._prefilling.append(seq)
            room -= 1

    def _resume_from_cache(self, seq: _Seq) -> None:
        """Start from the retained KV of the session's last turn, where it matches."""
        key = seq.request.cache_key
        entry = self.store.take(key) if key else None
        if entry is None:
            return
        # At least one token must go through the model: its logits pick the next token.
        reuse = min(common_prefix(entry.token_ids, seq.tokens), len(seq.tokens) - 1)
        blocks = entry.blocks
        if entry.host is not None:
            blocks = self._allocate(entry.host.k.shape[1]) or []
            if blocks:
                self.pool.copy_in(entry.host, blocks)
            else:
                reuse = 0
        keep = self.pool.blocks_for(reuse) if reuse > 0 else 0
        self.pool.release(blocks[keep:])
        seq.blocks = blocks[:keep]
        seq.computed = seq.cached_tokens = max(0, reuse)

    def _cached_prefix(self, seq: _Seq) -> tuple[list[int], list[int]]:
        """The registered blocks holding ``seq``'s prompt's longest shareable beginning:
        (their prefix-cache nodes, the blocks); none without prefix caching."""
        if not self.config.prefix_caching:
            return [], []
        allocator = self.pool.blocks
        return allocator.match(seq.tokens, allocator.limit_for(len(seq.tokens)))

    def _share_cached_prefix(self, seq: _Seq, nodes: list[int], blocks: list[int]) -> None:
        """Start ``seq`` from ``blocks`` (``_cached_prefix``), where they hold more than
        its session's retained KV gave it."""
        size = self.config.block_size
        if len(blocks) * size > seq.computed:
            self.pool.blocks.share(blocks)
            self.pool.release(seq.blocks)
            seq.blocks, seq.computed = blocks, len(blocks) * size
        seq.chain = nodes[: seq.computed // size]
        self._own_partial_block(seq)
        seq.looked_up = True
        if not seq.preempted:
            seq.cached_tokens = seq.computed
            self.prefix_cache_queries += len(seq.tokens)
            self.prefix_cache_hits += seq.computed

    def _own_partial_block(self, seq: _Seq) -> None:
        """The block ``seq`` goes on writing into (a retained turn continued from inside
        it) must be its own: unregistered, or copied where another sequence shares it."""
        size = self.config.block_size
        if seq.computed % size == 0:
            return
        i = seq.computed // size
        block = seq.blocks[i]
        if self.pool.blocks.writable(block):
            return
        fresh = self._allocate(1)
        if fresh is None:  # no room for a copy: recompute the block's leading tokens
            seq.computed = i * size
            self.pool.release(seq.blocks[i:])
            del seq.blocks[i:]
            return
        self.pool.copy_block(block, fresh[0])
        self.pool.release([block])
        seq.blocks[i] = fresh[0]

    def _register_full_blocks(self, seq: _Seq) -> None:
        """Make ``seq``'s newly completed blocks findable by later prompts."""
        if not self.config.prefix_caching or not seq.looked_up:
            return
        size = self.config.block_size
        full = min(seq.computed, len(seq.tokens)) // size
        chain, register = seq.chain, self.pool.blocks.register
        for i in range(len(chain), full):
            tokens = seq.tokens[i * size : (i + 1) * size]
            chain.append(register(chain[-1] if chain else ROOT, tokens, seq.blocks[i]))

    def _allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, evicting retained caches (least recently used first) as needed."""
        while self.pool.free_blocks < n and self.store.evict_oldest():
            pass
        return self.pool.allocate(n)

    # --- launching a step ------------------------------------------------------------

    def _launch(self) -> _Launch | None:
        self._admit()
        decode = self._schedule_decode()
        pieces = self._schedule_prefill()
        if not decode and not pieces:
            return None
        start = _timing_event() if self.device.type == "cuda" else None
        logprobs = False
        if decode:
            self._variant = self._variant or variant_of([s.request.params for s in self.rows.seqs])
            logprobs = any(s is not None and s.request.params.logprobs for s in decode)
            allowed = self.grammars.bitmask([s.constraint if s else None for s in decode])
            self.runner.decode(self.rows, self._variant, logprobs, allowed)
            self._advance_rows(decode)
        prefilled = self._run_prefill(pieces) if pieces else []
        logprobs = logprobs or any(s.request.params.logprobs for s in prefilled)
        launch = self._record(decode, prefilled, logprobs)
        launch.start, launch.previous_end = start, self._last_end
        self._last_end = launch.event
        return launch

    def _schedule_decode(self) -> list[_Seq | None]:
        """Give every running row a slot for its next token; None for rows that need none."""
        rows = self.rows
        active: list[_Seq | None] = []
        row = 0
        while row < len(rows):
            seq = rows.seqs[row]
            # A constrained row whose last token is still on the device waits a step:
            # its grammar needs that token before it can say what may follow.
            if self._saturated(seq) or (seq.constraint is not None and seq.pending):
                active.append(None)
            elif not self._ensure_blocks(seq, seq.computed + 1):
                continue  # a row was preempted (maybe this one): look at this row again
            else:
                active.append(seq)
            row += 1
        rows.active[: len(active)] = [s is not None for s in active]
        return active if any(s is not None for s in active) else []

    def _saturated(self, seq: _Seq) -> bool:
        """Its pending token already ends it by length: computing more would be wasted."""
        if not seq.pending:
            return False
        reached = seq.num_generated + seq.pending >= seq.request.params.max_new_tokens
        return reached or len(seq.tokens) + seq.pending >= self.max_context

    def _ensure_blocks(self, seq: _Seq, tokens: int) -> bool:
        """Blocks for ``tokens`` tokens of ``seq``; False if a row had to be preempted."""
        missing = self.pool.blocks_for(tokens) - len(seq.blocks)
        if missing <= 0:
            return True
        blocks = self._allocate(missing)
        if blocks is not None:
            if seq.row is not None:
                start = len(seq.blocks)
                self.rows.block_table[seq.row, start : start + missing] = blocks
                self.rows.tables_dirty = True
            seq.blocks += blocks
            return True
        victim = self.rows.seqs[-1] if self.rows.seqs else seq
        self._preempt(victim)
        return False

    def _preempt(self, seq: _Seq) -> None:
        """Out of KV blocks: send ``seq`` back to the queue, to be recomputed from its tokens."""
        log.warning("kv pool full; preempting", request=seq.id, tokens=len(seq.tokens))
        self.preemptions += 1
        self._leave_batch(seq)
        self.pool.release(seq.blocks)  # its full blocks stay findable: recomputing is cheap
        seq.blocks, seq.computed, seq.chain = [], 0, []
        seq.looked_up, seq.preempted = False, True
        self._waiting.appendleft(seq)

    def _advance_rows(self, decode: list[_Seq | None]) -> None:
        rows = self.rows
        for row, seq in enumerate(decode):
            if seq is not None:
                seq.computed += 1
                seq.pending += 1
                rows.positions[row] += 1
                rows.src[row] = row

    def _schedule_prefill(self) -> list[PrefillPiece]:
        """Chunks of newcomers within the step's token budget; those that finish first."""
        budget = self.config.prefill_chunk_tokens
        done: list[PrefillPiece] = []
        partial: list[PrefillPiece] = []
        for k, seq in enumerate(self._prefilling):
            if not seq.looked_up:
                nodes, shared = self._cached_prefix(seq)
                if self._awaits_shared_prefix(seq, len(shared), self._prefilling[:k]):
                    continue
                self._share_cached_prefix(seq, nodes, shared)
            n = min(seq.target - seq.computed, budget)
            if n <= 0 or not self._ensure_prefill_blocks(seq, seq.computed + n):
                break
            piece = PrefillPiece(seq, seq.tokens, seq.blocks, seq.computed, seq.computed + n)
            (done if piece.end == seq.target else partial).append(piece)
            budget -= n
        return done + partial

    def _awaits_shared_prefix(self, seq: _Seq, shared: int, earlier: list[_Seq]) -> bool:
        """Whether ``seq``, whose prompt's first ``shared`` blocks are cached, should wait
        a step: its prompt begins with at least ``SHARED_PREFIX_WAIT_TOKENS`` of an
        earlier newcomer's, which is still to compute the next block ``seq`` could
        share. Waiting, it shares that block instead of computing it a second time;
        prompts that share only a short header never wait."""
        if not self.config.prefix_caching or not earlier:
            return False
        size = self.config.block_size
        limit = self.pool.blocks.limit_for(len(seq.tokens)) * size
        if limit < SHARED_PREFIX_WAIT_TOKENS:
            return False
        want = max(seq.computed, shared * size) + size
        if want > limit:
            return False
        head = seq.tokens[: max(want, SHARED_PREFIX_WAIT_TOKENS)]
        return any(p.computed < want <= p.target and p.tokens[: len(head)] == head for p in earlier)

    def _ensure_prefill_blocks(self, seq: _Seq, tokens: int) -> bool:
        missing = self.pool.blocks_for(tokens) - len(seq.blocks)
        blocks = self._allocate(missing) if missing > 0 else []
        if blocks is None:
            return False  # the pool is full of running rows: wait for some to finish
        seq.blocks += blocks
        return True

    def _run_prefill(self, pieces: list[PrefillPiece]) -> list[_Seq]:
        complete = [p.seq for p in pieces if p.end == p.seq.target]
        draws = [RowSampling(s.request.params, s.seed, s.num_generated) for s in complete]
        logprobs = any(s.request.params.logprobs for s in complete)
        allowed = self.grammars.bitmask([s.constraint for s in complete])
        self.runner.prefill(pieces, draws, logprobs, allowed)
        for piece in pieces:
            piece.seq.computed = piece.end
            self.prefill_tokens += piece.end - piece.start
            self._register_full_blocks(piece.seq)
        for j, seq in enumerate(complete):
            self._prefilling.remove(seq)
            self._join_batch(seq, self.runner.max_rows + j)
        return complete

    def _join_batch(self, seq: _Seq, src: int) -> None:
        seq.pending += 1
        seq.row = self.rows.add(seq, seq.blocks, seq.computed, src, seq.seed)
        self._variant = None
        if seq.request.params.repetition_penalty != 1.0:
            self.runner.reset_seen(seq.row, seq.tokens, src)

    def _record(self, decode: list[_Seq | None], prefilled: list[_Seq], logprobs: bool) -> _Launch:
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
            if self._seqs.get(seq.id) is seq:  # not ended or aborted since the launch
                self._register_full_blocks(seq)
                seq.pending -= 1
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

    def _retain(self, seq: _Seq) -> int | None:
        key = seq.request.cache_key
        length = min(seq.computed, len(seq.tokens))
        self._register_full_blocks(seq)
        if key is None or length == 0:
            return None
        stored = self.store.put(key, seq.tokens[:length], seq.blocks)
        seq.blocks = []  # the store owns (or has released) them now
        return length if stored else None

    def _remove(self, seq: _Seq) -> None:
        self._seqs.pop(seq.id, None)
        self._leave_batch(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        if seq in self._waiting:
            self._waiting.remove(seq)

    def _leave_batch(self, seq: _Seq) -> None:
        if seq.row is not None:
            last = len(self.rows) - 1
            moved = self.rows.remove(seq.row)
            if moved is not None:
                moved.row = seq.row
                self.runner.move_seen(last, seq.row)
            seq.row = None
            self._variant = None
        elif seq in self._prefilling:
            self._prefilling.remove(seq)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        failed = list(self.rows.seqs) + list(self._prefilling)
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
