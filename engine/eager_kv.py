"""The eager core's KV: its buffers, and the KV space the scheduler plans over.

The eager runner's KV is in right-aligned ``kvbuffer.KVBuffer``s: one for the
decode batch (its row ``i`` is the scheduler's decode row ``i``) and one of a
single row for each sequence still prefilling (``EagerSequence.kv``), which
joins the batch once its prompt is in (``EagerKV``). The scheduler sees this
as a ``kvspace`` like the paged pool's:

- ``NominalBlocks``: blocks that only count. The eager core makes enough for
  every decode row's whole context, so a row is never preempted for want of
  them, as it never was before it had a scheduler; there is no prefix cache.
- ``EagerCaches``: the retained caches, copies of a sequence's KV tensors in
  the LRU (``lru.py``), within ``kv_cache_bytes``. They hold no blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blocks import BlockAllocator
from .kvbuffer import KVBuffer
from .kvspace import HoldsKV, reusable
from .lru import LRUBacked, RetainedLRU
from .scheduler import PagedSequence

Layers = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, T, D]


@dataclass(eq=False)
class EagerSequence(PagedSequence):
    kv: KVBuffer | None = None  # while it prefills: its own, one row, right-aligned


class NominalBlocks:
    """A ``kvspace.BlockSpace`` of ``num_blocks`` blocks that hold no tensors."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = BlockAllocator(num_blocks, block_size, reserved=0)

    @property
    def free_blocks(self) -> int:
        return self.blocks.free_blocks

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def allocate(self, n: int) -> list[int] | None:
        return self.blocks.allocate(n)

    def release(self, blocks: list[int]) -> None:
        self.blocks.release(blocks)

    def copy_block(self, src: int, dst: int) -> None:
        raise RuntimeError("no block is shared without a prefix cache: none is copied")


class EagerKV:
    """The eager runner's KV tensors: the decode batch and the prefilling buffers."""

    def __init__(self, devices: list[torch.device], dtype: torch.dtype) -> None:
        self.devices = devices  # per layer (device_map="auto" may split the model)
        self.dtype = dtype
        self.batch = KVBuffer(devices, dtype)

    def buffer(self) -> KVBuffer:
        return KVBuffer(self.devices, self.dtype)

    def layers_of(self, seq: EagerSequence, length: int) -> Layers:
        """Copies of the KV of ``seq``'s first ``length`` tokens, wherever it is now."""
        if seq.row is not None:
            return self.batch.row_layers(seq.row, length)
        assert seq.kv is not None, "a sequence with computed tokens has their KV"
        return seq.kv.row_layers(0, length)

    def resumed(self, layers: Layers, tokens: int) -> KVBuffer:
        """A prefill buffer holding the first ``tokens`` of a retained cache's ``layers``."""
        kv = self.buffer()
        kv.reserve(1, tokens)
        kv.rows = 1
        for layer, (keys, values) in enumerate(layers):
            device = self.devices[layer]
            kv.write(
                layer,
                keys[:, :, :tokens].to(device, non_blocking=True),
                values[:, :, :tokens].to(device, non_blocking=True),
            )
        kv.advance(tokens)
        return kv

    def row_left(self, row: int, moved_from: int | None) -> None:
        """The scheduler vacated decode ``row``, filling it from the last (as the batch
        does). A batch forgotten after a failed step has no rows left to move."""
        if row < self.batch.rows:
            self.batch.remove_row(row)

    def forget(self) -> None:
        """A step failed, the batch perhaps half-written: start an empty one."""
        self.batch = self.buffer()

    def trim(self, longest: int, min_columns: int) -> None:
        """Drop left padding that every row shares (left behind by a long row that
        ended), once it is ``min_columns`` wide and a quarter of the batch."""
        shared = self.batch.width - longest
        if shared >= min_columns and 4 * shared >= self.batch.width:
            self.batch.trim_left(shared)


@dataclass
class RetainedKV:
    token_ids: list[int]  # the tokens whose KV is held, in order
    layers: Layers

    @property
    def nbytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers
        )


class EagerCaches(LRUBacked):
    """Retained per-session KV caches (copies of their tensors) within a byte budget:
    the eager core's ``kvspace.RetainedCaches``."""

    def __init__(
        self,
        budget_bytes: int,
        blocks: NominalBlocks,
        kv: EagerKV,
        offload: torch.device | None = None,
    ) -> None:
        self.space, self.kv, self.offload = blocks, kv, offload
        self.lru: RetainedLRU[RetainedKV] = RetainedLRU(budget_bytes, _entry_bytes)

    def put(self, key: str, seq: HoldsKV, length: int) -> bool:
        assert isinstance(seq, EagerSequence)
        self.space.release(seq.blocks)  # a copy is kept, not the blocks
        self.lru.drop(key)
        token_ids = seq.tokens[:length]
        entry = RetainedKV(token_ids, self.kv.layers_of(seq, length))
        if entry.nbytes > self.budget_bytes or not token_ids:
            return False
        if self.offload is not None:
            entry = RetainedKV(token_ids, _moved(entry.layers, self.offload))
        return self.lru.put(key, entry)

    def resume(self, key: str, seq: HoldsKV) -> tuple[list[int], int] | None:
        """Take ``key``'s entry for ``seq``: the part it reuses goes into ``seq``'s
        prefill buffer, with blocks for its tokens."""
        assert isinstance(seq, EagerSequence)
        entry = self.lru.take(key)
        if entry is None:
            return None
        reuse = reusable(entry.token_ids, seq.tokens)
        blocks = self.space.allocate(self.space.blocks_for(reuse)) if reuse > 0 else None
        if blocks is None:
            return [], 0
        seq.kv = self.kv.resumed(entry.layers, reuse)
        return blocks, reuse

    def evict_oldest(self) -> bool:
        return False  # a retained cache holds no blocks: letting it go frees none

    def length(self, key: str) -> int:
        entry = self.lru.get(key)
        return len(entry.token_ids) if entry is not None else 0


def _entry_bytes(entry: RetainedKV) -> int:
    return entry.nbytes


def _moved(layers: Layers, device: torch.device) -> Layers:
    return [(_copy_to(k, device), _copy_to(v, device)) for k, v in layers]


def _copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if tensor.device == device:
        return tensor
    # Pinned host memory makes the device->host copy asynchronous (no sync in the step).
    pin = device.type == "cpu" and tensor.device.type == "cuda"
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=pin)
    return out.copy_(tensor, non_blocking=True)
