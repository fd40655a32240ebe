"""CPU attention whose result for a query is the same bits however it is batched.

A query's output here depends only on the query and the keys and values it may
see: not on which other rows share the step, how far they pad it, whether the
query came alone (decode) or among a prompt's (prefill), or how the prompt was
chunked. Decode and prefill (``TiledAttention``) both run through
``InvariantAttention``, so a turn rebuilt from its token log after a takeover
recomputes the very KV it had, and draws the very tokens it would have drawn.
SDPA gives no such promise: its reduction order follows the padded length and
the number of queries, and those last-bit differences, rounded to bfloat16 at the
next quantized layer's input, change a draw every few dozen tokens.

How, in torch ops whose order of arithmetic was measured not to move
(``tests/engine/test_attention_cpu.py`` checks each on the machine it runs on):

- scores: one batched matmul per kv head over the rows, queries ``[M, D]`` against
  the padded keys, read in place from the gathered slots. The CPU BLAS computes
  each element as one dot product of length D in a fixed order for any number of
  key columns and rows, and any M that is a multiple of 4: it multiplies 4 query
  rows at a time, and (on the AVX2 machines measured; not on some AVX-512 ones)
  a remainder of 1 to 3 rows (M of 1 to 3, or a thread's share of M = 6) another
  way. M is padded to ``QUERY_ROWS``'s next multiple.
- softmax over the padded row, masked slots -inf: torch's kernel accumulates
  lane by lane in index order, so padding adds exact zeros and changes nothing,
  once a row holds at least 16 slots (the key length is padded to whole chunks).
- probabilities times values: one matmul per chunk of ``CHUNK`` keys (a fixed
  inner length; the BLAS's order along a longer one depends on its length), then
  the chunks' partial outputs added left to right in float64 (``fold``), so
  trailing chunks a query cannot see add exact zeros.

``benchmarks/bench_cpu_attention.py`` measures the cost against SDPA.
"""

from __future__ import annotations

import functools
import math

import torch

# Keys per chunk of the probabilities-times-values product (a multiple of the
# KV block size, and at least 16 so that a softmax row is long enough).
CHUNK = 64
# Largest chunk output (elements) folded by one cumsum rather than chunk by chunk.
FOLD_BY_CUMSUM = 1 << 14
# Queries of a prefill row per ``TiledAttention`` tile.
QUERY_TILE = 64
# Query rows per matmul come in multiples of this: the BLAS multiplies a
# remainder of 1 to 3 rows another way (measured with 1 to 8 threads).
QUERY_ROWS = 4


class InvariantAttention:
    """Attention of one forward's queries over the KV pool, planned once per forward.

    ``query_pos`` ``[R, W]`` (host, int64): query ``w`` of row ``r`` sees the row's keys
    ``0..query_pos[r, w]``, their KV already written; a negative position marks a row
    with nothing to attend to (decode padding), whose output is zeros. Padding queries
    of a prefill row should repeat a position the row holds (their output is
    discarded). ``block_tables`` ``[R, n]``: entries past what a row's queries see may be
    anything. The mask, the gather index and the shapes serve every layer.
    """

    def __init__(
        self,
        block_tables: torch.Tensor,
        query_pos: torch.Tensor,
        block_size: int,
        q_heads: int,
        kv_heads: int,
    ) -> None:
        if CHUNK % block_size:
            raise ValueError(f"KV block size {block_size} does not divide the chunk {CHUNK}")
        rows, width = query_pos.shape
        self.rows, self.width, self.kv_heads = rows, width, kv_heads
        self.group = q_heads // kv_heads
        self.empty = query_pos.amax(1) < 0 if rows and width else torch.zeros(0, dtype=torch.bool)
        self.any_empty = bool(self.empty.any())
        length = int(query_pos.max()) + 1 if rows and width else 1
        self.chunks = max(1, -(-length // CHUNK))
        self.padded = self.chunks * CHUNK
        self.index = _gather_index(block_tables, query_pos, block_size, self.padded)
        # M: the query rows of one (row, kv head): its queries x the heads of its group.
        self.m = max(QUERY_ROWS, -(-width * self.group // QUERY_ROWS) * QUERY_ROWS)
        queries = -(-self.m // self.group)  # padding M may take part of a query
        self.seen = _seen(query_pos.clamp(min=0), self.empty, queries, self.padded)
        self.bias = _bias(self.seen, self.group, self.m)
        self._query: torch.Tensor | None = None

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q ``[R, W, Hq, D]`` -> ``[R, W, Hq, D]`` float32; caches ``[blocks, block_size,
        Hkv, D]``."""
        rows, width, kv_heads, group = self.rows, self.width, self.kv_heads, self.group
        dim = q.shape[-1]
        query = self._queries(q)
        # [R, padded, Hkv, D]: head h's keys of row r are keys[r, :, h], rows Hkv * D
        # apart, the same layout for any batch (no copy, so no layout of our choosing).
        keys = k_cache.index_select(0, self.index).float().view(rows, self.padded, kv_heads, dim)
        values = v_cache.index_select(0, self.index).float().view(keys.shape)
        scores = keys.new_empty(kv_heads, rows, self.m, self.padded)
        keys_by_head = keys.permute(2, 0, 3, 1).unbind()
        heads = zip(query.unbind(), keys_by_head, scores.unbind(), strict=True)
        for query_h, keys_t, scores_h in heads:  # keys_t [R, D, padded]
            torch.baddbmm(self.bias, query_h, keys_t, alpha=scale, out=scores_h)
        probs = torch.softmax(scores, dim=-1)
        out = self._weighted(probs, values)
        if bool(out.isnan().any()):
            # A slot no query may see can hold NaN (the CPU pool is not zeroed): NaN
            # scores become -inf and such values 0, which is what they were weighted by.
            probs = torch.softmax(scores.nan_to_num_(nan=-math.inf), dim=-1)
            hidden = ~self.seen.any(1)[:, :, None, None]  # [R, padded, 1, 1]
            out = self._weighted(probs, values.masked_fill(hidden, 0.0))
        out = out[:, :, : width * group].view(kv_heads, rows, width, group, dim)
        out = out.permute(1, 2, 0, 3, 4).reshape(rows, width, kv_heads * group, dim)
        if self.any_empty:
            out[self.empty] = 0.0
        return out

    def _queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[Hkv, R, M, D]``: row r's queries for kv head h, each with the group's heads
        in turn; the rows that pad M stay zero."""
        rows, width, kv_heads, group = self.rows, self.width, self.kv_heads, self.group
        dim = q.shape[-1]
        if self._query is None or self._query.shape[-1] != dim:
            self._query = torch.zeros(kv_heads, rows, self.m, dim)
        self._query[:, :, : width * group].view(kv_heads, rows, width, group, dim).copy_(
            q.view(rows, width, kv_heads, group, dim).permute(2, 0, 1, 3, 4)
        )
        return self._query

    def _weighted(self, probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``[Hkv, R, M, D]``: each chunk's ``[M, CHUNK] @ [CHUNK, D]``, then the chunks
        added in order. ``probs`` ``[Hkv, R, M, padded]``; ``values`` as gathered."""
        kv_heads, rows, m, dim = self.kv_heads, self.rows, self.m, values.shape[-1]
        chunks = self.chunks
        if chunks > 1:  # [Hkv, R * chunks, M, CHUNK]: each chunk's probabilities in a row
            probs = probs.view(kv_heads, rows, m, chunks, CHUNK).transpose(2, 3).contiguous()
        probs = probs.view(kv_heads, rows * chunks, m, CHUNK)
        partial = values.new_empty(kv_heads, rows * chunks, m, dim)
        by_head = values.permute(2, 0, 1, 3).unbind()  # [R, padded, D] each
        heads = zip(probs.unbind(), by_head, partial.unbind(), strict=True)
        for probs_h, values_h, partial_h in heads:
            torch.bmm(probs_h, values_h.view(rows * chunks, CHUNK, dim), out=partial_h)
        if chunks == 1:
            return partial
        return fold(partial.view(kv_heads, rows, chunks, m, dim))


def fold(partial: torch.Tensor) -> torch.Tensor:
    """``partial`` ``[..., chunks, M, D]`` summed over its chunks left to right in
    float64, then rounded once: chunks a query cannot see add exact zeros. Few rows
    (decode) in one ``cumsum``, which does exactly that; many (prefill) chunk by chunk,
    which cumsum would read a chunk apart for every element."""
    if partial[..., 0, :, :].numel() <= FOLD_BY_CUMSUM:
        return partial.cumsum(-3)[..., -1, :, :]
    total = partial[..., 0, :, :].double()
    for chunk in range(1, partial.shape[-3]):
        total += partial[..., chunk, :, :]
    return total.float()


class TiledAttention:
    """A prefill's queries in tiles of at most ``QUERY_TILE`` a row, each tile its own
    ``InvariantAttention``: a tile's scores and probabilities stay in cache, and each
    reads only the chunks its queries reach (the first chunk of a prompt is causal).
    Tiling changes no bits: a query's output does not depend on its company.

    Rows of ``QUERY_TILE`` queries or fewer (short prompts prefilled together) stay
    one plan. Same arguments and call as ``InvariantAttention``.
    """

    def __init__(
        self,
        block_tables: torch.Tensor,
        query_pos: torch.Tensor,
        block_size: int,
        q_heads: int,
        kv_heads: int,
    ) -> None:
        rows, width = query_pos.shape
        self.shape = (rows, width, q_heads)
        self.tiles: list[tuple[slice, slice, InvariantAttention]] = []
        if width <= QUERY_TILE:
            tiles = [(slice(0, rows), slice(0, width))]
        else:
            tiles = [
                (slice(r, r + 1), slice(start, min(start + QUERY_TILE, width)))
                for r in range(rows)
                for start in range(0, width, QUERY_TILE)
            ]
        for row, queries in tiles:
            plan = InvariantAttention(
                block_tables[row], query_pos[row, queries], block_size, q_heads, kv_heads
            )
            self.tiles.append((row, queries, plan))

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if len(self.tiles) == 1:
            return self.tiles[0][2](q, k_cache, v_cache, scale)
        out = q.new_empty(*self.shape, q.shape[-1], dtype=torch.float32)
        for row, queries, plan in self.tiles:
            out[row, queries] = plan(q[row, queries], k_cache, v_cache, scale)
        return out


def _gather_index(
    block_tables: torch.Tensor, query_pos: torch.Tensor, block_size: int, padded: int
) -> torch.Tensor:
    """Flat block index reading each row's first ``padded`` slots; blocks past what a
    row's queries see read the scratch block 0 instead of whatever the table holds."""
    rows = block_tables.shape[0]
    num_blocks = padded // block_size
    table = block_tables[:, :num_blocks].long()
    if table.shape[1] < num_blocks:
        table = torch.cat([table, table.new_zeros(rows, num_blocks - table.shape[1])], 1)
    last = query_pos.amax(1, keepdim=True) // block_size
    return torch.where(torch.arange(num_blocks)[None, :] <= last, table, 0).flatten()


def _seen(query_pos: torch.Tensor, empty: torch.Tensor, queries: int, padded: int) -> torch.Tensor:
    """``[R, queries, padded]`` bool: the keys each query sees. The queries that pad M
    up to a multiple of ``QUERY_ROWS``, and empty rows' queries, see key 0 (and are discarded)."""
    rows, width = query_pos.shape
    keys = torch.arange(padded)
    seen = torch.zeros(rows, queries, padded, dtype=torch.bool)
    seen[:, :, 0] = True
    seen[:, :width] = (keys[None, None, :] <= query_pos[:, :, None]) & ~empty[:, None, None]
    seen[empty, :, 0] = True
    return seen


def _bias(seen: torch.Tensor, group: int, m: int) -> torch.Tensor:
    """``[R, M, padded]``: 0 where a query row may see a key, -inf elsewhere; the same
    for every kv head."""
    rows, queries, padded = seen.shape
    rows_seen = seen[:, :, None, :].expand(rows, queries, group, padded).reshape(rows, -1, padded)
    bias = torch.zeros(rows, m, padded)
    return bias.masked_fill_(~rows_seen[:, :m], -math.inf)


@functools.cache
def batch_invariant_here(q_heads: int, kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether this machine's kernels keep the promise, for this shape of model: a
    few queries computed alone, in a ragged decode batch and inside prefill tiles
    must agree bit for bit. The properties the design stands on were measured on
    one CPU and BLAS; an engine checks them at start (a fraction of a second, once
    per process and shape)."""
    gen = torch.Generator().manual_seed(0)
    blocks = 8 * 160 // block_size + 1
    k = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.arange(1, blocks).view(8, -1)
    q = torch.randn(8, 160, q_heads, head_dim, generator=gen)
    lengths = [1, 160, 17, 64, 65, 130, 3, 100]

    def alone(row: int, position: int) -> torch.Tensor:
        plan = InvariantAttention(
            tables[row : row + 1], torch.tensor([[position]]), block_size, q_heads, kv_heads
        )
        return plan(q[row, position].view(1, 1, q_heads, head_dim), k, v, 0.125)[0, 0]

    pos = torch.tensor(lengths)[:, None] - 1
    decode = InvariantAttention(tables, pos, block_size, q_heads, kv_heads)
    batched = decode(q[torch.arange(8), pos[:, 0]][:, None], k, v, 0.125)[:, 0]
    if not all(torch.equal(batched[r], alone(r, n - 1)) for r, n in enumerate(lengths)):
        return False
    positions = torch.arange(20, 150)[None]  # tiles of 64, 64 and 2 queries
    prefill = TiledAttention(tables[1:2], positions, block_size, q_heads, kv_heads)
    out = prefill(q[1, 20:150][None], k, v, 0.125)[0]
    return all(torch.equal(out[p - 20], alone(1, p)) for p in (20, 63, 64, 100, 148, 149))
