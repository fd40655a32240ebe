"""Which KV blocks are free, who holds each, and which full blocks hold a known prefix.

The paged pool's bookkeeping, without tensors (``kvpool.KVPool`` owns those):

- every block has a reference count: a running sequence and a retained turn
  each hold one reference to each of their blocks;
- a *full* block whose tokens are known can be registered under its content:
  the tokens it holds and the registered block before it (so a block stands for
  the whole prefix up to its end, as vLLM's chained block hashes do). A later
  prompt that starts with the same tokens shares those blocks, read-only,
  instead of computing them again, whatever session it comes from;
- a registered block nobody holds any more keeps its KV, least recently
  released first in line to be handed out again: it is free, but a prompt
  that matches it until then still finds it.

Keys compare the tokens themselves, not a hash of them, so two prompts can share
a block only when they truly begin alike (no hash collision can hand one
tenant's KV to another). A key's parent is a node id that is never reused: when
a block is handed out again its descendants become unreachable, not wrong.

The rule that keeps shared blocks read-only: a sequence only writes into a slot
past its shared blocks (``limit_for``), and a block it must write into again
(a retained turn continued from mid-block) goes through ``writable`` first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

ROOT = 0  # the parent node of every prompt's first block


class BlockAllocator:
    def __init__(
        self, num_blocks: int, block_size: int, reserved: int = 1, max_idle: int | None = None
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Idle cached blocks kept at most (None: all): on a CPU the pool's pages only become
        # resident once used, and a cache that kept every block would touch them all.
        self.max_idle = max_idle
        # pop() hands out the lowest free block first (reserved ones never).
        self._free = list(range(num_blocks - 1, reserved - 1, -1))
        self._refs = [0] * num_blocks
        self._index: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}  # key -> node, block
        self._key_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # registered block -> key
        self._idle: OrderedDict[int, None] = OrderedDict()  # registered, unreferenced: LRU
        self._next_node = ROOT + 1

    # --- allocation -----------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks that can be handed out now: never-used ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def cached_blocks(self) -> int:
        """Registered blocks, held or idle."""
        return len(self._key_of)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, each with one reference; None (nothing taken) if there are not
        enough. Idle cached blocks go last, least recently released first."""
        if n > self.free_blocks:
            return None
        blocks = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._idle.popitem(last=False)
                self._unregister(block)
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; a block nobody holds is free again (a
        registered one stays findable until it is handed out)."""
        for block in reversed(blocks):
            refs = self._refs[block] - 1
            if refs < 0:
                raise RuntimeError(f"KV block {block} released more often than held")
            self._refs[block] = refs
            if refs == 0:
                if block in self._key_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)
        while self.max_idle is not None and len(self._idle) > self.max_idle:
            block, _ = self._idle.popitem(last=False)
            self._unregister(block)
            self._free.append(block)

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each of ``blocks`` (found by ``match``)."""
        for block in blocks:
            if self._refs[block] == 0:
                self._idle.pop(block)
            self._refs[block] += 1

    def refs(self, block: int) -> int:
        return self._refs[block]

    # --- the prefix index ------------------------------------------------------------

    def limit_for(self, tokens: int) -> int:
        """The most leading blocks a prompt of ``tokens`` may share: at least its last
        token goes through the model (its logits pick the next token) and is written
        into a block of its own."""
        return max(0, tokens - 1) // self.block_size

    def match(self, tokens: Sequence[int], max_blocks: int) -> tuple[list[int], list[int]]:
        """The registered blocks holding ``tokens``' longest prefix of whole blocks, at
        most ``max_blocks``: (their node ids, the blocks). Takes no reference."""
        nodes: list[int] = []
        blocks: list[int] = []
        parent = ROOT
        size = self.block_size
        for i in range(min(max_blocks, len(tokens) // size)):
            found = self._index.get((parent, tuple(tokens[i * size : (i + 1) * size])))
            if found is None:
                break
            parent, block = found
            nodes.append(parent)
            blocks.append(block)
        return nodes, blocks

    def register(self, parent: int, tokens: Sequence[int], block: int) -> int:
        """Say that ``block`` (full, held) holds ``tokens`` after the prefix ``parent``
        stands for; the node id that now stands for the prefix through ``tokens``. Where
        another block already holds that prefix, it stays the one found and ``block``
        stays private."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only a full block ({self.block_size} tokens) is registered")
        if self._refs[block] <= 0:
            raise RuntimeError(f"KV block {block} registered while nobody holds it")
        key = (parent, tuple(tokens))
        found = self._index.get(key)
        if found is not None:
            return found[0]
        if block in self._key_of:
            # Registered before under a parent that has since been handed out again.
            self._unregister(block)
        node = self._next_node
        self._next_node += 1
        self._index[key] = (node, block)
        self._key_of[block] = key
        return node

    def writable(self, block: int) -> bool:
        """Make ``block`` safe to write into for its one holder: unregister it if it is
        registered. False where others share it (the caller must copy it instead)."""
        if self._refs[block] > 1:
            return False
        self._unregister(block)
        return True

    def _unregister(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None:
            del self._index[key]
