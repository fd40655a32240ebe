"""The paged KV pool: allocated once, handed out in fixed-size blocks.

Per layer, keys and values live in ``[num_blocks, block_size, kv_heads,
head_dim]`` tensors. A sequence owns a list of blocks (its block table); token
``t`` sits in block ``table[t // block_size]`` at offset ``t % block_size``.
Nothing is allocated or copied per step: decode writes one slot per row.

Block 0 is never handed out: CUDA-graph padding rows write their (discarded)
KV there. Which blocks are free or held, and which hold a known prefix that any
later prompt may share, is ``blocks.BlockAllocator``'s business.

``RetainedKV`` keeps the cache of a paused or finished turn for the session's
next request: it holds its blocks in the pool (no copy), or, with offloading,
a host copy. ``KVHandles`` keeps them in the retained-KV LRU (``lru.py``)
within a byte budget; the pool also evicts from it when running sequences
need blocks. The two are the paged core's KV space (``kvspace``), which the
scheduler plans over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .blocks import BlockAllocator
from .kvspace import HoldsKV, reusable
from .lru import LRUBacked, RetainedLRU
from .sampling import to_device

SCRATCH_BLOCK = 0


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_idle_blocks: int | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks")
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        # On a GPU the pool is zeroed once (masked lanes of unwritten slots still flow
        # through probs @ V, and 0 * NaN = NaN). On CPU it stays untouched, so only the
        # pages of blocks in use become resident; the attention there masks such slots.
        alloc = torch.zeros if device.type == "cuda" else torch.empty
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.block_bytes = 2 * self.k[0, 0].numel() * self.k.element_size() * num_layers
        self.blocks = BlockAllocator(num_blocks, block_size, SCRATCH_BLOCK + 1, max_idle_blocks)

    @property
    def free_blocks(self) -> int:
        return self.blocks.free_blocks

    @property
    def cached_blocks(self) -> int:
        return self.blocks.cached_blocks

    def allocate(self, n: int) -> list[int] | None:
        return self.blocks.allocate(n)

    def release(self, blocks: list[int]) -> None:
        self.blocks.release(blocks)

    def copy_block(self, src: int, dst: int) -> None:
        """Every layer's keys and values of block ``src`` into block ``dst``."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` [N, kv_heads, head_dim] at flat slot indices ``slots`` [N]."""
        heads, dim = k.shape[1], k.shape[2]
        self.k[layer].view(-1, heads, dim).index_copy_(0, slots, k)
        self.v[layer].view(-1, heads, dim).index_copy_(0, slots, v)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def copy_out(self, blocks: list[int], tokens: int, device: torch.device) -> HostKV:
        """The first ``tokens`` slots of ``blocks``, copied to ``device`` (offloading)."""
        index = to_device(blocks, self.k.device)
        pin = device.type == "cpu" and self.k.device.type == "cuda"
        k, v = (_copy_to(t[:, index], device, pin) for t in (self.k, self.v))
        return HostKV(k, v)

    def copy_in(self, host: HostKV, blocks: list[int]) -> None:
        index = to_device(blocks, self.k.device)
        self.k[:, index] = host.k.to(self.k.device, non_blocking=True)
        self.v[:, index] = host.v.to(self.v.device, non_blocking=True)


def _copy_to(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    # Pinned host memory makes the device->host copy asynchronous (no sync in the step).
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    return out.copy_(tensor, non_blocking=True)


@dataclass
class HostKV:
    k: torch.Tensor  # [layers, blocks, block_size, kv_heads, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


@dataclass
class RetainedKV:
    token_ids: list[int]  # the tokens whose KV is held, in order
    blocks: list[int] = field(default_factory=list)  # in the pool...
    host: HostKV | None = None  # ...or offloaded
    nbytes: int = 0


class KVHandles(LRUBacked):
    """Retained per-session KV caches within a byte budget: an entry dropped or
    evicted gives its blocks back to the pool."""

    def __init__(self, pool: KVPool, budget_bytes: int, offload: torch.device | None) -> None:
        self.pool = pool
        self.offload = offload
        self.lru: RetainedLRU[RetainedKV] = RetainedLRU(
            budget_bytes, _entry_bytes, lambda entry: pool.release(entry.blocks)
        )

    def put(self, key: str, seq: HoldsKV, length: int) -> bool:
        """Retain ``seq``'s blocks (holding its first ``length`` tokens) under ``key``;
        False (blocks released) if they cannot fit the budget."""
        self.lru.drop(key)
        token_ids, blocks = seq.tokens[:length], seq.blocks
        needed = self.pool.blocks_for(len(token_ids))
        self.pool.release(blocks[needed:])
        blocks = blocks[:needed]
        nbytes = needed * self.pool.block_bytes
        if not token_ids or nbytes > self.budget_bytes:
            self.pool.release(blocks)
            return False
        entry = RetainedKV(list(token_ids), blocks, None, nbytes)
        if self.offload is not None:
            entry.host = self.pool.copy_out(blocks, len(token_ids), self.offload)
            self.pool.release(blocks)
            entry.blocks = []
        return self.lru.put(key, entry)

    def resume(self, key: str, seq: HoldsKV) -> tuple[list[int], int] | None:
        """Take ``key``'s entry for ``seq``: the blocks of it ``seq`` reuses (copied back
        into the pool where it was offloaded), and their tokens."""
        entry = self.take(key)
        if entry is None:
            return None
        reuse = reusable(entry.token_ids, seq.tokens)
        blocks = entry.blocks
        if entry.host is not None:
            blocks = self._allocate(entry.host.k.shape[1]) or []
            if blocks:
                self.pool.copy_in(entry.host, blocks)
            else:
                reuse = 0
        keep = self.pool.blocks_for(reuse) if reuse > 0 else 0
        self.pool.release(blocks[keep:])
        return blocks[:keep], max(0, reuse)

    def take(self, key: str) -> RetainedKV | None:
        """Remove and return ``key``'s entry: the resumed sequence now owns its blocks."""
        return self.lru.take(key)

    def _allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, evicting other retained caches (oldest first) as needed."""
        while self.pool.free_blocks < n and self.evict_oldest():
            pass
        return self.pool.allocate(n)

    def evict_oldest(self) -> bool:
        """Free the least recently used entry's blocks; False if there is none."""
        return self.lru.evict_oldest()

    def length(self, key: str) -> int:
        entry = self.lru.get(key)
        return len(entry.token_ids) if entry is not None else 0


def _entry_bytes(entry: RetainedKV) -> int:
    return entry.nbytes
