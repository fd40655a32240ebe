"""The model runner: device buffers, decode (as CUDA graphs) and chunked prefill.

vLLM's GPU model runner in small: every input of a decode step lives in a
persistent device buffer that the host refreshes with a few copies, so the
step itself (embedding, layers, paged attention, logits, sampling) can be
captured once per batch-size bucket and replayed. The tokens a step samples
stay on the device (``last_tokens``) and feed the next step directly: the host
needs them only to detokenize and publish, which it does while the GPU already
runs the next step.

Prefill runs eagerly, several newcomers' chunks in one forward.

``execute`` runs one ``scheduler.ScheduledStep`` (the decode rows, then the
prefill pieces) and starts copying its draws to the host: its ``Launch`` is
the step in flight, ``Launch.collect`` the draws once they are there (the
step's one host sync).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from wsinfer.sessions.schema import GenerationParams

from .attention import decode_attention, prefill_softcapped_attention
from .attention_cpu import InvariantAttention, TiledAttention
from .batch import DecodeRows, PrefillPiece
from .grammar import Grammars, apply_bitmask
from .kvpool import KVPool
from .llama import FastLlama
from .logprobs import HostLogprobs, LogprobBuffers, host_copy, model_logprobs
from .native import native_attends, paged_attention
from .sampler import sample_tokens
from .sampling import (
    RowSampling,
    SamplingTensors,
    Variant,
    generated_counts,
    tensors_for,
    to_device,
    triton_available,
    upload,
    variant_of,
)
from .scheduler import Sampled, ScheduledStep, StepResult

log = logging.getLogger("wsinfer.engine.runner")

# Rows of the per-step integer buffer.
_POS, _LEN, _SLOT, _SRC, _INDEX = range(5)


def use_invariant_attention(pool: KVPool, softcap: float | None) -> bool:
    """Attention through ``InvariantAttention``: on the CPU, but for soft-capped scores
    (Gemma 2), which keep the torch path's explicit softmax."""
    return pool.k.device.type == "cpu" and softcap is None


def use_native_attention(pool: KVPool, softcap: float | None) -> bool:
    """Attention through the C++ kernel (``engine/native.py``), where it is built: a
    float32 (or float16) CPU pool without soft-capped scores. Decode and prefill
    decide alike."""
    return use_invariant_attention(pool, softcap) and native_attends(pool.k)


class DecodeContext:
    """Attention of one new token per row over its blocks in the pool.

    On the CPU (but for soft-capped scores) through ``InvariantAttention``, planned at
    the first layer: a row's output does not depend on the rest of the batch, and is
    the very one a prefill over the same tokens computes.
    """

    def __init__(
        self,
        pool: KVPool,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        max_len: int | None,
        softcap: float | None = None,
    ) -> None:
        self.pool, self.slots, self.scale, self.softcap = pool, slots, scale, softcap
        self.block_tables, self.seq_lens, self.max_len = block_tables, seq_lens, max_len
        self.invariant = use_invariant_attention(pool, softcap)
        self._plan: InvariantAttention | None = None
        # The native kernel's view of the rows (block tables, each query's row, its
        # position): row r's query at its last position.
        self.kernel_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if use_native_attention(pool, softcap):
            rows = torch.arange(seq_lens.shape[0])
            self.kernel_rows = (block_tables.long(), rows, seq_lens.long() - 1)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self.slots, k, v)
        return self.attend(layer, q)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over the pool, this step's keys and values already in it."""
        if self.kernel_rows is not None:
            return paged_attention(
                q, self.pool.k[layer], self.pool.v[layer], *self.kernel_rows, self.scale
            )
        if self.invariant:
            if self._plan is None:
                self._plan = InvariantAttention(
                    self.block_tables,
                    (self.seq_lens.long() - 1)[:, None],
                    self.pool.block_size,
                    q.shape[1],
                    self.pool.k.shape[3],
                )
            out = self._plan(q[:, None], self.pool.k[layer], self.pool.v[layer], self.scale)
            return out[:, 0].to(q.dtype)
        return decode_attention(
            q,
            self.pool.k[layer],
            self.pool.v[layer],
            self.block_tables,
            self.seq_lens,
            self.scale,
            max_len=self.max_len,
            softcap=self.softcap,
        )


class PrefillContext:
    """Causal attention of several rows' chunks, each over its own cached prefix.

    The chunks arrive flattened; attention runs on a padded ``[rows, chunk]``
    layout against each row's KV gathered from the pool (prefill is compute-bound,
    one gather per layer is cheap next to it). On the CPU (but for soft-capped
    scores) through ``InvariantAttention``: a query's output is the one a decode
    step computes for it, so a turn rebuilt from its tokens has the very KV it had.
    """

    def __init__(
        self, pool: KVPool, pieces: list[PrefillPiece], scale: float, softcap: float | None = None
    ) -> None:
        device = pool.k.device
        bs = pool.block_size
        self.pool, self.scale, self.softcap = pool, scale, softcap
        self.rows = len(pieces)
        self.width = max(p.end - p.start for p in pieces)
        blocks = pool.blocks_for(max(p.end for p in pieces))
        table = np.zeros((self.rows, blocks), dtype=np.int64)
        pad_index, slots, positions = [], [], []
        for r, piece in enumerate(pieces):
            table[r, : pool.blocks_for(piece.end)] = piece.blocks[: pool.blocks_for(piece.end)]
            span = np.arange(piece.start, piece.end)
            positions.append(span)
            slots.append(table[r, span // bs] * bs + span % bs)
            pad_index.append(r * self.width + np.arange(piece.end - piece.start))
        self.positions = upload(np.concatenate(positions), device)
        self.slots = upload(np.concatenate(slots), device)
        self.pad_index = upload(np.concatenate(pad_index), device)
        self.table = upload(table, device)
        query_pos = torch.from_numpy(_query_positions(pieces, self.width))
        self.plan: TiledAttention | None = None
        self.query_pos: torch.Tensor | None = None
        # The native kernel's view of the tokens (as DecodeContext's).
        self.kernel_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        if use_native_attention(pool, softcap):
            token_rows = np.concatenate([np.full(p.end - p.start, r) for r, p in enumerate(pieces)])
            self.kernel_rows = (self.table, upload(token_rows, device), self.positions)
        elif use_invariant_attention(pool, softcap):
            self.query_pos = query_pos
        else:
            self.mask = _prefill_mask(query_pos, blocks * bs, device)
            self.hidden_keys = ~self.mask.any(dim=2)[:, 0, :, None, None]  # [R, L, 1, 1]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        self.pool.write(layer, self.slots, k, v)
        return self.attend(layer, q)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` over the pool, these chunks' keys and values already in it."""
        if self.kernel_rows is not None:
            return paged_attention(
                q, self.pool.k[layer], self.pool.v[layer], *self.kernel_rows, self.scale
            )
        heads, dim = q.shape[1], q.shape[2]
        padded = q.new_zeros(self.rows * self.width, heads, dim)
        padded[self.pad_index] = q
        if self.query_pos is not None:
            if self.plan is None:
                bs, kv_heads = self.pool.block_size, self.pool.k.shape[3]
                self.plan = TiledAttention(self.table, self.query_pos, bs, heads, kv_heads)
            out = self.plan(
                padded.view(self.rows, self.width, heads, dim),
                self.pool.k[layer],
                self.pool.v[layer],
                self.scale,
            )
            return out.reshape(-1, heads, dim)[self.pad_index].to(q.dtype)
        # Slots no query may see (never written, or another row's padding) can hold
        # anything, NaN included (the CPU pool is not zeroed), and a masked NaN key
        # still poisons its row's softmax: zero them on both sides.
        hidden = self.hidden_keys
        keys = self.pool.k[layer][self.table].flatten(1, 2).masked_fill(hidden, 0.0)
        values = self.pool.v[layer][self.table].flatten(1, 2).masked_fill(hidden, 0.0)
        groups = heads // keys.shape[2]
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=2)
            values = values.repeat_interleave(groups, dim=2)
        padded = padded.view(self.rows, self.width, heads, dim).transpose(1, 2)
        # Never-written slots may hold anything: keep them out of softmax(.) @ V too.
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(
                padded, keys, values, attn_mask=self.mask, scale=self.scale
            )
        else:
            out = prefill_softcapped_attention(
                padded, keys, values, self.mask, self.scale, self.softcap
            )
        return out.transpose(1, 2).reshape(-1, heads, dim)[self.pad_index]


def _query_positions(pieces: list[PrefillPiece], width: int) -> np.ndarray:
    """[rows, width] int64: each query's position; a padding query (past its row's
    chunk) repeats the chunk's first, so it sees nothing its row's queries do not."""
    positions = np.zeros((len(pieces), width), dtype=np.int64)
    for r, piece in enumerate(pieces):
        positions[r] = piece.start
        positions[r, : piece.end - piece.start] = np.arange(piece.start, piece.end)
    return positions


def _prefill_mask(query_pos: torch.Tensor, columns: int, device: torch.device) -> torch.Tensor:
    """[rows, 1, width, columns] bool: key j is visible to the query at position p if
    j <= p (``query_pos`` [rows, width] from ``_query_positions``)."""
    keys = torch.arange(columns)
    mask = keys.view(1, 1, -1) <= query_pos.unsqueeze(2)
    return upload(mask.unsqueeze(1), device)


@dataclass
class Launch:
    """One launched step: which sequence each sampled token belongs to, and the host
    copy of the tokens (and of their log-probabilities, when a row asked) on its way."""

    decode: list[Any]  # by row; None: the row computed nothing useful
    pieces: list[PrefillPiece]  # the prefill pieces computed
    prefilled: list[Any]  # the newcomers that drew a token, at ``first_token_at + j``
    first_token_at: int
    host: torch.Tensor
    event: torch.cuda.Event | None  # the step's end on the GPU (CUDA only)
    start: torch.cuda.Event | None = None  # its start on the GPU
    previous_end: torch.cuda.Event | None = None  # the end of the step launched before
    logprobs: tuple[torch.Tensor, ...] | None = None  # host copies, when a row asked

    def result(self) -> StepResult:
        """What it launched, for ``Scheduler.update`` (the draws: ``collect``'s)."""
        return StepResult(self.decode, self.pieces, self.first_token_at)

    def collect(self) -> list[Sampled]:
        """The draws, once on the host, of the sequences not ended since the launch."""
        if self.event is not None:
            self.event.synchronize()
        tokens = self.host.tolist()
        base = self.first_token_at
        rows = [(s, i) for i, s in enumerate(self.decode) if s is not None]
        rows += [(s, base + j) for j, s in enumerate(self.prefilled)]
        logprobs = HostLogprobs(self.logprobs) if self.logprobs is not None else None
        sampled = []
        for seq, i in rows:
            if seq.status.ended:  # ended or aborted since the launch
                continue
            params, lp = seq.request.params, None
            if logprobs is not None and params.logprobs:
                lp = logprobs.at(i, tokens[i], params.top_logprobs)
            sampled.append(Sampled(seq, tokens[i], lp))
        return sampled

    def idle_before(self) -> float:
        """Seconds the GPU waited for the host between the step before and this one."""
        if self.start is None or self.previous_end is None:
            return 0.0
        return max(0.0, self.previous_end.elapsed_time(self.start) / 1000)


class ModelRunner:
    def __init__(
        self,
        model: FastLlama,
        pool: KVPool,
        max_rows: int,
        max_blocks: int,
        max_prefill_rows: int,
        batch_sizes: tuple[int, ...],
        ends: list[int] | None = None,
    ) -> None:
        self.model, self.pool = model, pool
        self.device = model.device
        self.max_rows = max_rows
        self.buckets = sorted({b for b in batch_sizes if b < max_rows} | {max_rows})
        device = self.device
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.step_ints = torch.zeros(5, max_rows, dtype=torch.long, device=device)
        # temperature, top_p, penalty, presence, frequency, typical_p (DecodeRows.floats)
        self.floats = torch.zeros(6, max_rows, dtype=torch.float32, device=device)
        self.ints = torch.zeros(3, max_rows, dtype=torch.long, device=device)
        # The end-of-sequence ids, which a row's min_tokens keeps from being drawn.
        self.ends = torch.tensor(sorted(ends or []), dtype=torch.long, device=device)
        # Sampled tokens: decode rows first, then prefill completions.
        self.last_tokens = torch.zeros(max_rows + max_prefill_rows, dtype=torch.long, device=device)
        # Their log-probabilities, rows as last_tokens, for batches with a logprobs turn.
        self.logprobs = LogprobBuffers(max_rows + max_prefill_rows, device)
        self.seen = torch.zeros(max_rows, model.vocab_size, dtype=torch.bool, device=device)
        # Each row's counts of its turn's generated tokens, for presence_penalty and
        # frequency_penalty: made when a row first needs them ([max_rows, V] float32).
        self.counts: torch.Tensor | None = None
        self._staging = [_Staging(max_rows, max_blocks, device) for _ in range(2)]
        self._flip = 0
        self.graphs: dict[tuple[int, Variant], torch.cuda.CUDAGraph] = {}
        self.padded = False  # decode in graph buckets (with or without captured graphs)
        # Where a step's draws are copied to, two in turn (async steps: the last step's
        # copy may still be read while this one's is written); pinned on CUDA.
        pin = device.type == "cuda"
        size = len(self.last_tokens)
        self._hosts = [torch.zeros(size, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_flip = 0
        self._last_end: torch.cuda.Event | None = None

    # --- a step ----------------------------------------------------------------

    def execute(
        self, plan: ScheduledStep, rows: DecodeRows, variant: Variant | None, grammars: Grammars
    ) -> Launch:
        """Run ``plan``: one decode step over ``rows`` (``variant``: their sampling's,
        given when the plan decodes), then one prefill forward over its pieces; each
        draw held to its sequence's grammar. The draws stay on the device, their copy
        to the host started."""
        start = _timing_event() if self.device.type == "cuda" else None
        decode, complete = plan.decode, plan.completing
        logprobs = False
        if decode:
            assert variant is not None
            logprobs = any(s is not None and s.request.params.logprobs for s in decode)
            allowed = grammars.bitmask([s.constraint if s else None for s in decode])
            self.decode(rows, variant, logprobs, allowed)
        if plan.prefill:
            draws = [RowSampling(s.request.params, s.seed, s.num_generated) for s in complete]
            asked = any(s.request.params.logprobs for s in complete)
            allowed = grammars.bitmask([s.constraint for s in complete])
            self.prefill(plan.prefill, draws, asked, allowed)
            logprobs = logprobs or asked
        launch = self._record(decode, plan.prefill, complete, logprobs)
        launch.start, launch.previous_end = start, self._last_end
        self._last_end = launch.event
        return launch

    def _record(
        self, decode: list[Any], pieces: list[PrefillPiece], prefilled: list[Any], logprobs: bool
    ) -> Launch:
        """Start copying the step's tokens (and log-probabilities, if a row asked) to the
        host; the step's only sync waits for it."""
        host = self._hosts[self._host_flip]
        self._host_flip ^= 1
        last = self.last_tokens
        n = len(last) if prefilled else len(decode)
        host[:n].copy_(last[:n], non_blocking=True)
        copies = host_copy(self.logprobs, n) if logprobs else None
        event = _timing_event() if self.device.type == "cuda" else None
        return Launch(decode, pieces, prefilled, self.max_rows, host, event, logprobs=copies)

    # --- decode ----------------------------------------------------------------

    def decode(
        self,
        rows: DecodeRows,
        variant: Variant,
        logprobs: bool = False,
        allowed: torch.Tensor | None = None,
    ) -> int:
        """Run one decode step for every row; tokens land in ``last_tokens[:len(rows)]``
        (and with ``logprobs``, their log-probabilities in ``self.logprobs``). With
        ``allowed`` (a packed bitmask per leading row, ``grammar.Grammars.bitmask``),
        those rows draw only the tokens whose bit is set.

        Returns the number of rows computed (the graph bucket, padding included).
        A step with log-probabilities or a bitmask runs the graphs' program eagerly:
        the graphs are captured without them.
        """
        n = len(rows)
        bucket = self._bucket(n) if self.padded else n
        self._stage(rows, n, bucket)
        shaping = _Shaping.of([s.request.params for s in rows.seqs[:n]])
        eager = logprobs or allowed is not None or shaping.any
        graph = None if eager else self.graphs.get((bucket, variant))
        if graph is not None:
            graph.replay()
        elif self.padded:  # the captured program, run eagerly (CPU tests of the graph path)
            self._decode(bucket, variant, logprobs=logprobs, allowed=allowed, shaping=shaping)
        else:
            max_len = int(rows.positions[:n].max()) + 1
            self._decode(n, variant, max_len, logprobs=logprobs, allowed=allowed, shaping=shaping)
        return bucket

    def _bucket(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    def _stage(self, rows: DecodeRows, n: int, bucket: int) -> None:
        """Copy the step's inputs to the device buffers (padding rows: length 0, scratch slot)."""
        staging = self._staging[self._flip]
        self._flip ^= 1
        ints = staging.step_ints
        ints[:, n:bucket] = 0
        active = rows.active[:n]
        # Inactive rows compute like padding: length 0, writing to the scratch slot.
        ints[_POS, :n] = rows.positions[:n] * active
        ints[_LEN, :n] = (rows.positions[:n] + 1) * active
        ints[_SLOT, :n] = rows.slots(n) * active
        ints[_SRC, :n] = rows.src[:n]
        ints[_INDEX, :n] = rows.draw_index(n)
        # Whole buffers (a few KB): a column slice of a pinned [k, max_rows] tensor is not
        # contiguous, and such a copy goes through an unpinned temporary and may sync.
        # Columns past the step's rows are never read.
        self.step_ints.copy_(staging.step_ints_t, non_blocking=True)
        if rows.tables_dirty:
            staging.tables[:n] = rows.block_table[:n]
            self.block_tables[:n].copy_(staging.tables_t[:n], non_blocking=True)  # rows: contiguous
            rows.tables_dirty = False
        if rows.params_dirty:
            staging.floats[:, :n] = rows.floats[:, :n]
            staging.ints[:, :n] = rows.ints[:, :n]
            self.floats.copy_(staging.floats_t, non_blocking=True)
            self.ints.copy_(staging.ints_t, non_blocking=True)
            rows.params_dirty = False

    def _decode(
        self,
        b: int,
        variant: Variant,
        max_len: int | None = None,
        logprobs: bool = False,
        allowed: torch.Tensor | None = None,
        shaping: _Shaping | None = None,
    ) -> None:
        """The decode step over rows ``:b`` (what a graph captures); no host sync.
        ``shaping``: some row has OpenAI's penalties or typical_p (run eagerly: the
        graphs are captured without them)."""
        ints = self.step_ints[:, :b]
        tables = self.block_tables[:b]
        if max_len is not None:  # eager: read only the blocks in use
            tables = tables[:, : self.pool.blocks_for(max_len)]
        context = DecodeContext(
            self.pool,
            ints[_SLOT],
            tables,
            ints[_LEN].int(),
            self.model.scale,
            max_len,
            self.model.attn_softcap,
        )
        ids = self.last_tokens[ints[_SRC]]
        hidden = self.model.forward(ids, ints[_POS], context)
        shaping = shaping or _Shaping()
        counts = self.counts[:b] if shaping.counts and self.counts is not None else None
        params = SamplingTensors(
            self.floats[0, :b], self.ints[0, :b], self.floats[1, :b], self.floats[2, :b],
            self.ints[1, :b], ints[_INDEX], self.ints[2, :b],
            presence=self.floats[3, :b] if counts is not None else None,
            frequency=self.floats[4, :b] if counts is not None else None,
            typical=self.floats[5, :b] if shaping.typical else None,
        )  # fmt: skip
        seen = None if variant is Variant.GREEDY else self.seen[:b]
        logits = self.model.logits(hidden)
        model_lp = model_logprobs(logits) if logprobs else None
        if allowed is not None:
            logits = apply_bitmask(logits, allowed)
        tokens = sample_tokens(logits, params, variant, seen, self.ends, counts)
        if model_lp is not None:
            self.logprobs.record(0, model_lp, tokens)
        if seen is not None:
            seen.scatter_(1, tokens.unsqueeze(1), True)
        if counts is not None:
            counts.scatter_add_(1, tokens.unsqueeze(1), torch.ones_like(counts[:, :1]))
        self.last_tokens[:b].copy_(tokens)

    # --- rows' repetition-penalty state -------------------------------------------

    def reset_seen(self, row: int, tokens: list[int], pending_src: int | None) -> None:
        """Mark ``row``'s context tokens (and its not yet known sampled token) as seen."""
        self.seen[row].zero_()
        self.seen[row, to_device(tokens, self.device)] = True
        if pending_src is not None:
            self.seen[row, self.last_tokens[pending_src]] = True

    def move_seen(self, src: int, dst: int) -> None:
        self.seen[dst].copy_(self.seen[src])
        if self.counts is not None:
            self.counts[dst].copy_(self.counts[src])

    def reset_counts(self, row: int, generated: list[int], pending_src: int | None) -> None:
        """Count ``row``'s generated tokens (and its not yet known sampled token), rebuilt
        from the turn's token ids: a resumed or taken-over turn counts as it would have."""
        if self.counts is None:
            vocab = self.model.vocab_size
            self.counts = torch.zeros(self.max_rows, vocab, dtype=torch.float32, device=self.device)
        self.counts[row].copy_(generated_counts([generated], self.model.vocab_size, self.device)[0])
        if pending_src is not None:
            pending = self.last_tokens[pending_src : pending_src + 1]
            self.counts[row].index_add_(0, pending, torch.ones_like(pending, dtype=torch.float32))

    # --- prefill -----------------------------------------------------------------

    def prefill(
        self,
        pieces: list[PrefillPiece],
        complete: list[RowSampling],
        logprobs: bool = False,
        allowed: torch.Tensor | None = None,
    ) -> None:
        """One forward over every piece; the pieces that finish their context (the
        first ``len(complete)``) sample their next token into ``last_tokens[max_rows:]``
        (and with ``logprobs``, its log-probability into ``self.logprobs``, same rows),
        within ``allowed`` (a packed bitmask per complete piece) where given."""
        context = PrefillContext(self.pool, pieces, self.model.scale, self.model.attn_softcap)
        ids = to_device([t for p in pieces for t in p.tokens[p.start : p.end]], self.device)
        hidden = self.model.forward(ids, context.positions, context)
        if not complete:
            return
        ends = np.cumsum([p.end - p.start for p in pieces])[: len(complete)] - 1
        logits = self.model.logits(hidden[upload(ends, self.device)])
        seen = counts = None
        params = [r.params for r in complete]
        if any(p.repetition_penalty != 1.0 for p in params):
            seen = torch.zeros(len(complete), self.model.vocab_size, dtype=torch.bool)
            for i, piece in enumerate(pieces[: len(complete)]):
                seen[i, torch.tensor(piece.tokens)] = True
            seen = upload(seen, self.device)
        tensors = tensors_for(complete, self.device)
        if tensors.presence is not None:  # the last ``index`` tokens are the turn's own
            ends_of = zip(pieces, complete, strict=False)
            turns = [p.tokens[len(p.tokens) - r.index :] for p, r in ends_of]
            counts = generated_counts(turns, self.model.vocab_size, self.device)
        model_lp = model_logprobs(logits) if logprobs else None
        if allowed is not None:
            logits = apply_bitmask(logits, allowed)
        tokens = sample_tokens(logits, tensors, variant_of(params), seen, self.ends, counts)
        if model_lp is not None:
            self.logprobs.record(self.max_rows, model_lp, tokens)
        self.last_tokens[self.max_rows : self.max_rows + len(complete)].copy_(tokens)

    # --- CUDA graphs ----------------------------------------------------------------

    def capture_graphs(self, progress: Callable[[str], None] | None = None) -> float:
        """Capture the decode step for every bucket and sampling variant; seconds taken.

        Off CUDA nothing is captured, but decode still runs padded to the buckets: the
        same program, so CPU tests cover what the graphs replay.
        """
        self.padded = True
        if self.device.type != "cuda":
            return 0.0
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            self._capture_all(pool, progress)
            self.warm_sampling()
        return time.monotonic() - started

    def warm_sampling(self) -> int:
        """Run every form of the sampling race that a live prefill can use (any number of
        finishing rows, with or without penalty state, each variant), so that Triton
        compiles them at start-up rather than in a user's first request (the graphs only
        build the decode forms). Returns the number of races run; 0 off CUDA/Triton."""
        if self.device.type != "cuda" or not triton_available():
            return 0
        from .sampling_triton import sm_count, warm_up_batches

        vocab, runs = self.model.vocab_size, 0
        for rows in warm_up_batches(self.max_rows, vocab, sm_count(self.device)):
            logits = torch.zeros(rows, vocab, dtype=self.model.dtype, device=self.device)
            params = tensors_for([RowSampling(GenerationParams(), 0, 0)] * rows, self.device)
            seen = torch.zeros(rows, vocab, dtype=torch.bool, device=self.device)
            for variant in Variant:
                for penalty in (None, seen):
                    sample_tokens(logits, params, variant, penalty)
                    runs += 1
            # Shaped logits (the penalties, typical_p) race as float32 without ``seen``.
            sample_tokens(logits.float(), params, Variant.SAMPLE)
            runs += 1
        return runs

    def _capture_all(self, pool: Any, progress: Callable[[str], None] | None) -> None:
        self.step_ints.zero_()  # every row: length 0, scratch slot
        for bucket in reversed(self.buckets):  # largest first: the rest reuse its memory
            for variant in Variant:
                self.graphs[(bucket, variant)] = self._capture(bucket, variant, pool)
            if progress is not None:
                progress(f"captured decode graphs for batch {bucket}")
        self.seen.zero_()

    def _capture(self, bucket: int, variant: Variant, pool: Any) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks its kernels
                self._decode(bucket, variant)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._decode(bucket, variant)
        return graph


@dataclass(frozen=True)
class _Shaping:
    """What a decode step's rows shape their logits with, besides the captured program."""

    counts: bool = False  # some row has presence_penalty or frequency_penalty
    typical: bool = False  # some sampled row has typical_p below 1

    @property
    def any(self) -> bool:
        return self.counts or self.typical

    @classmethod
    def of(cls, params: list[GenerationParams]) -> _Shaping:
        typical = any(p.typical_p < 1.0 and not p.greedy for p in params)
        return cls(any(p.counts_tokens for p in params), typical)


class _Staging:
    """Host copies of the step buffers (pinned on CUDA so the copies are asynchronous).

    There are two, used in turn: a copy enqueued for step N may still be pending while
    the host fills in step N+1.
    """

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        self.step_ints_t = host((5, max_rows), torch.long)
        self.tables_t = host((max_rows, max_blocks), torch.int32)
        self.floats_t = host((6, max_rows), torch.float32)
        self.ints_t = host((3, max_rows), torch.long)
        self.step_ints = self.step_ints_t.numpy()
        self.tables = self.tables_t.numpy()
        self.floats = self.floats_t.numpy()
        self.ints = self.ints_t.numpy()


def _timing_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
