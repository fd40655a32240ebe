"""Scheduler: what an engine core computes each step, and where its KV goes.

The core's runner runs the model; this decides what it runs (vLLM v1's
scheduler / model-runner split, in small), for the paged ``core.EngineCore``
and the ``eager.EagerEngineCore`` alike. It holds the waiting queue, the
newcomers being prefilled, the decode rows (``batch.DecodeRows``) and the
blocks each sequence holds in the core's KV space (``kvspace``: the paged
pool, or the eager core's nominal blocks). ``schedule`` plans a step:

1. admits waiting sequences while the batch has room, each starting from its
   session's retained KV where it matches;
2. gives every running row a slot for its next token; a row crossing into a new
   block gets one, evicting retained caches (least recently used first) and, when
   the pool is still full, preempting the last row, which goes back to the front
   of the queue to be recomputed from its tokens;
3. picks up to ``prefill_chunk_tokens`` of newcomers' tokens, those that finish
   their prompt first, each newcomer starting from the longest prefix of whole
   blocks any earlier prompt left in the pool (automatic prefix caching,
   ``blocks.BlockAllocator``: shared read-only, whatever the session).

One object crosses each boundary of a step: ``schedule`` returns the plan
(``ScheduledStep``), the runner executes it, and the core hands back one
``StepResult`` to ``update``: what the runner launched (each scheduled row one
token further on the device; the prefill pieces' KV in, the newcomers they
complete joining the decode batch) and the draws that reached the host at that
step (its own, or with async steps the step before's). A sequence's end is the
lifecycle's: ``retain`` then ``remove``.

No model and no runner here: the runner's own per-row state (the paged
runner's repetition-penalty masks, the eager runner's rows of KV) is the core's
to keep in step. It learns which
sequences were admitted from the plan and which joined from the result;
a row leaving can happen deep inside scheduling (a preemption), so that it
hears through ``on_leave``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from .batch import DecodeRows, PrefillPiece
from .blocks import ROOT
from .kvspace import BlockSpace, RetainedCaches
from .lifecycle import EngineConfig, Sequence
from .logprobs import TokenLogprob
from .requests import SequenceStatus

log = structlog.get_logger("wsinfer.engine")

# A newcomer whose prompt begins with at least this many tokens of an earlier newcomer's
# waits for that one to compute them (and put them in the prefix cache) instead of
# computing them too: 32 sessions arriving with one long system prompt prefill it once.
# Prompts sharing less (a chat template's header) are not worth a step's wait.
SHARED_PREFIX_WAIT_TOKENS = 128


@dataclass(eq=False)
class PagedSequence(Sequence):
    """A request's state on the paged path: its blocks, its row, its progress."""

    blocks: list[int] = field(default_factory=list)
    row: int | None = None  # decode row
    target: int = 0  # prefill: context tokens to compute before the first draw
    pending: int = 0  # tokens sampled on the device, not yet seen by the host
    chain: list[int] = field(default_factory=list)  # prefix-cache nodes of its full blocks
    looked_up: bool = False  # the prefix cache was searched since its admission
    preempted: bool = False


# ``on_leave(row, moved_from)``: a sequence left decode row ``row``, and the last row,
# ``moved_from``, moved into its place (None: it was the last row).
RowLeft = Callable[[int, int | None], None]


def _nothing_to_tell(row: int, moved_from: int | None) -> None:
    """The default ``on_leave``: nothing else keeps per-row state."""


@dataclass
class ScheduledStep:
    """One step's work: a decode token for every row not None, and prefill pieces."""

    decode: list[PagedSequence | None]  # by row; empty when no row needs a token
    prefill: list[PrefillPiece]  # those that complete their sequence's prompt first
    admitted: list[PagedSequence]  # moved from waiting to prefilling by this step

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill

    @property
    def completing(self) -> list[PagedSequence]:
        """The newcomers whose prompt this step's prefill completes: they draw a token."""
        return completing(self.prefill)


@dataclass
class Sampled:
    """One draw that reached the host: ``seq``'s next token (and its log-probability,
    where the turn asked)."""

    seq: PagedSequence
    token: int
    logprob: TokenLogprob | None = None


@dataclass
class StepResult:
    """What a step gives back to ``Scheduler.update``: the work the runner launched for
    its plan, and the draws that reached the host at it (this step's own; with async
    steps, the step before's, while this one runs)."""

    decode: list[PagedSequence | None] = field(default_factory=list)  # the plan's rows
    prefill: list[PrefillPiece] = field(default_factory=list)  # the plan's pieces
    first_token_at: int = 0  # where the complete pieces' draws are on the device
    sampled: list[Sampled] = field(default_factory=list)  # of sequences not ended
    joined: list[PagedSequence] = field(default_factory=list)  # set by ``update``


def completing(pieces: list[PrefillPiece]) -> list[PagedSequence]:
    """The sequences whose prompt ``pieces`` complete, in order (their pieces lead)."""
    return [p.seq for p in pieces if p.end == p.seq.target]


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        max_context: int,
        pool: BlockSpace,
        store: RetainedCaches,
        on_leave: RowLeft = _nothing_to_tell,
    ) -> None:
        self.config = config
        self.max_context = max_context
        self.pool = pool
        self.store = store
        self.rows = DecodeRows(
            config.max_batch_size, pool.blocks_for(max_context), config.block_size
        )
        self._on_leave = on_leave
        self._waiting: deque[PagedSequence] = deque()
        self._prefilling: list[PagedSequence] = []
        self.preemptions = 0
        self.prefill_tokens = 0  # prompt tokens that went through the model
        # Prompt tokens of admitted requests, and those their prefill was spared by a kept
        # or shared KV cache (vllm:prefix_cache_queries / _hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # --- public API ---------------------------------------------------------------

    def add(self, seq: PagedSequence) -> None:
        self._waiting.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._prefilling)

    def schedule(self) -> ScheduledStep:
        """The next step's work: admission, then decode rows, then prefill pieces."""
        admitted = self._admit()
        decode = self._schedule_decode()
        prefill = self._schedule_prefill()
        return ScheduledStep(decode, prefill, admitted)

    def update(self, result: StepResult) -> None:
        """Apply a step's result: each decode row has one more token computed (and
        sampled on the device); the prefill pieces' KV is in, and those that complete
        their prompt (the first ones) drew their first token into the runner's
        ``first_token_at + j`` and join the decode batch (``result.joined``, in that
        order); then the draws that reached the host."""
        self._advance_rows(result.decode)
        result.joined = self._prefilled(result.prefill, result.first_token_at)
        for sampled in result.sampled:  # before they are accepted
            self._register_full_blocks(sampled.seq)
            sampled.seq.pending -= 1

    def running_and_prefilling(self) -> list[PagedSequence]:
        """The sequences a failed forward may have half-computed: the decode rows, then
        the newcomers being prefilled (those still waiting are untouched)."""
        return list(self.rows.seqs) + list(self._prefilling)

    # --- admission -----------------------------------------------------------------

    def _admit(self) -> list[PagedSequence]:
        admitted = []
        room = self.config.max_batch_size - len(self.rows) - len(self._prefilling)
        # A preempted row whose last draws are still on their way to the host waits
        # for them: it is recomputed from its tokens.
        while self._waiting and room > 0 and not self._waiting[0].pending:
            seq = self._waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._resume_from_cache(seq)
            seq.target = len(seq.tokens)
            self._prefilling.append(seq)
            admitted.append(seq)
            room -= 1
        return admitted

    def _resume_from_cache(self, seq: PagedSequence) -> None:
        """Start from the retained KV of the session's last turn, where it matches."""
        key = seq.request.cache_key
        resumed = self.store.resume(key, seq) if key else None
        if resumed is not None:
            seq.blocks, seq.computed = resumed
            seq.cached_tokens = seq.computed

    # --- the prefix cache ------------------------------------------------------------

    def _cached_prefix(self, seq: PagedSequence) -> tuple[list[int], list[int]]:
        """The registered blocks holding ``seq``'s prompt's longest shareable beginning:
        (their prefix-cache nodes, the blocks); none without prefix caching."""
        if not self.config.prefix_caching:
            return [], []
        allocator = self.pool.blocks
        return allocator.match(seq.tokens, allocator.limit_for(len(seq.tokens)))

    def _share_cached_prefix(self, seq: PagedSequence, nodes: list[int], blocks: list[int]) -> None:
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

    def _own_partial_block(self, seq: PagedSequence) -> None:
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

    def _register_full_blocks(self, seq: PagedSequence) -> None:
        """Make ``seq``'s newly completed blocks findable by later prompts."""
        if not self.config.prefix_caching or not seq.looked_up:
            return
        size = self.config.block_size
        full = min(seq.computed, len(seq.tokens)) // size
        chain, register = seq.chain, self.pool.blocks.register
        for i in range(len(chain), full):
            tokens = seq.tokens[i * size : (i + 1) * size]
            chain.append(register(chain[-1] if chain else ROOT, tokens, seq.blocks[i]))

    def _awaits_shared_prefix(
        self, seq: PagedSequence, shared: int, earlier: list[PagedSequence]
    ) -> bool:
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

    # --- the KV block budget -----------------------------------------------------------

    def _allocate(self, n: int) -> list[int] | None:
        """``n`` blocks, evicting retained caches (least recently used first) as needed."""
        while self.pool.free_blocks < n and self.store.evict_oldest():
            pass
        return self.pool.allocate(n)

    def _ensure_blocks(self, seq: PagedSequence, tokens: int) -> bool:
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

    def _ensure_prefill_blocks(self, seq: PagedSequence, tokens: int) -> bool:
        missing = self.pool.blocks_for(tokens) - len(seq.blocks)
        blocks = self._allocate(missing) if missing > 0 else []
        if blocks is None:
            return False  # the pool is full of running rows: wait for some to finish
        seq.blocks += blocks
        return True

    def _preempt(self, seq: PagedSequence) -> None:
        """Out of KV blocks: send ``seq`` back to the queue, to be recomputed from its tokens."""
        log.warning("kv pool full; preempting", request=seq.id, tokens=len(seq.tokens))
        self.preemptions += 1
        self._leave_batch(seq)
        self.pool.release(seq.blocks)  # its full blocks stay findable: recomputing is cheap
        seq.blocks, seq.computed, seq.chain = [], 0, []
        seq.looked_up, seq.preempted = False, True
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)

    # --- decode -------------------------------------------------------------------------

    def _schedule_decode(self) -> list[PagedSequence | None]:
        """Give every running row a slot for its next token; None for rows that need none."""
        rows = self.rows
        active: list[PagedSequence | None] = []
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

    def _saturated(self, seq: PagedSequence) -> bool:
        """Its pending token already ends it by length: computing more would be wasted."""
        if not seq.pending:
            return False
        reached = seq.num_generated + seq.pending >= seq.request.params.max_new_tokens
        return reached or len(seq.tokens) + seq.pending >= self.max_context

    def _advance_rows(self, decode: list[PagedSequence | None]) -> None:
        rows = self.rows
        for row, seq in enumerate(decode):
            if seq is not None:
                seq.computed += 1
                seq.pending += 1
                rows.positions[row] += 1
                rows.src[row] = row

    # --- prefill ------------------------------------------------------------------------

    def _prefilled(self, pieces: list[PrefillPiece], first_token_at: int) -> list[PagedSequence]:
        complete = completing(pieces)
        for piece in pieces:
            piece.seq.computed = piece.end
            self.prefill_tokens += piece.end - piece.start
            self._register_full_blocks(piece.seq)
        for j, seq in enumerate(complete):
            self._prefilling.remove(seq)
            self._join_batch(seq, first_token_at + j)
        return complete

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

    def _join_batch(self, seq: PagedSequence, src: int) -> None:
        seq.pending += 1
        seq.row = self.rows.add(seq, seq.blocks, seq.computed, src, seq.seed)

    # --- leaving ------------------------------------------------------------------------

    def retain(self, seq: PagedSequence) -> int | None:
        """Keep ``seq``'s KV under its cache key; the retained length, or None."""
        key = seq.request.cache_key
        length = min(seq.computed, len(seq.tokens))
        self._register_full_blocks(seq)
        if key is None or length == 0:
            return None
        stored = self.store.put(key, seq, length)
        seq.blocks = []  # the store owns (or has released) them now
        return length if stored else None

    def remove(self, seq: PagedSequence) -> None:
        """``seq`` has ended: out of its row or the queue, its blocks released."""
        self._leave_batch(seq)
        self.pool.release(seq.blocks)
        seq.blocks = []
        if seq.status is SequenceStatus.WAITING:
            self._waiting.remove(seq)

    def _leave_batch(self, seq: PagedSequence) -> None:
        if seq.row is not None:
            row, last = seq.row, len(self.rows) - 1
            moved = self.rows.remove(row)
            if moved is not None:
                moved.row = row
            seq.row = None
            self._on_leave(row, last if moved is not None else None)
        elif seq in self._prefilling:
            self._prefilling.remove(seq)
