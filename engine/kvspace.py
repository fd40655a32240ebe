"""What the scheduler asks of the place its sequences' KV lives.

The ``scheduler.Scheduler`` hands KV out in blocks and keeps a session's KV
between its turns; where that KV really is belongs to the runner behind it.
Two spaces implement this:

- the paged core's pool (``kvpool.KVPool``, ``kvpool.KVHandles``): blocks of
  real tensors, shared by prefix, retained in place;
- the eager core's (``eager_kv``): blocks that only count (its KV is the
  runner's right-aligned buffers), its retained caches tensors of their own.

No torch here: the scheduler imports no model code.
"""

from __future__ import annotations

from typing import Protocol

from .blocks import BlockAllocator


class HoldsKV(Protocol):
    """What a KV space reads of a sequence (``scheduler.PagedSequence``): its context,
    and the blocks it holds of the space."""

    tokens: list[int]
    blocks: list[int]


class BlockSpace(Protocol):
    """The blocks running sequences hold: a sequence holds one per ``block_size``
    tokens of its context (``blocks_for``) before the model writes them."""

    blocks: BlockAllocator  # who holds each block; the prefix index

    @property
    def free_blocks(self) -> int: ...

    def blocks_for(self, tokens: int) -> int: ...

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, or None (nothing taken) if there are not that many free."""

    def release(self, blocks: list[int]) -> None: ...

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``src``'s KV into ``dst`` (only for a shared block: prefix caching)."""


class RetainedCaches(Protocol):
    """Sessions' KV kept between their turns, by cache key, within a byte budget
    (least recently kept evicted first: ``lru.RetainedLRU``)."""

    def resume(self, key: str, seq: HoldsKV) -> tuple[list[int], int] | None:
        """Take ``key``'s entry for ``seq`` to continue from: the blocks that hold the
        part of it ``seq`` reuses (``reusable``) and how many tokens that is (0: none,
        the entry is let go); None where ``key`` has no entry."""

    def put(self, key: str, seq: HoldsKV, length: int) -> bool:
        """Keep the KV of ``seq``'s first ``length`` tokens under ``key``; its blocks are
        the store's now (kept, or released). False where it cannot fit the budget."""

    def evict_oldest(self) -> bool:
        """Let the least recently kept entry go, freeing blocks for running sequences;
        False where that frees none."""


def reusable(cached: list[int], tokens: list[int]) -> int:
    """How many of ``tokens`` a retained cache of ``cached`` saves computing. At least
    one token must go through the model: its logits pick the next token."""
    return min(common_prefix(cached, tokens), len(tokens) - 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
