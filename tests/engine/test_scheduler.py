"""The paged core's scheduler without a model: admission, prefill chunks, KV blocks,
preemption, eviction and prefix sharing, on a tiny CPU pool (blocks of 4 tokens).

The helpers play the core's part: ``launch`` is the ``StepResult`` of a step whose
plan the runner ran, ``hand_out`` that of a step at which its sampled tokens reached
the host (each token here is ``TOKEN``), then what the lifecycle does with them.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, cast

import torch

from wsinfer.engine import scheduler as scheduler_module
from wsinfer.engine.kvpool import KVHandles, KVPool
from wsinfer.engine.lifecycle import EngineConfig, EngineRequest
from wsinfer.engine.scheduler import (
    SHARED_PREFIX_WAIT_TOKENS,
    PagedSequence,
    Sampled,
    ScheduledStep,
    Scheduler,
    StepResult,
)
from wsinfer.sessions.schema import GenerationParams

BLOCK = 4  # tokens per block
TOKEN = 1  # what every draw "samples"


def make(
    blocks: int = 32,
    *,
    max_batch_size: int = 4,
    chunk: int = 64,
    cache_blocks: int = 0,
    max_context: int = 256,
    left: list[tuple[int, int | None]] | None = None,
) -> Scheduler:
    """A scheduler over a pool of ``blocks`` blocks (block 0 is never handed out)
    whose retained caches may hold ``cache_blocks`` blocks; ``left`` collects
    ``on_leave``'s calls."""
    pool = KVPool(2, blocks, BLOCK, 1, 4, torch.float32, torch.device("cpu"))
    store = KVHandles(pool, cache_blocks * pool.block_bytes, None)
    config = EngineConfig(
        max_batch_size=max_batch_size, prefill_chunk_tokens=chunk, block_size=BLOCK
    )
    record = left if left is not None else []
    return Scheduler(config, max_context, pool, store, lambda row, src: record.append((row, src)))


def seq(
    rid: str, tokens: list[int], max_new_tokens: int = 100, key: str | None = None
) -> PagedSequence:
    params = GenerationParams(max_new_tokens=max_new_tokens, temperature=0.0)
    request = EngineRequest(rid, list(tokens), params, cache_key=key)
    detok = cast(Any, None)  # the scheduler never detokenizes
    return PagedSequence(request, list(tokens), detok, seed=0, num_generated=0)


def launch(s: Scheduler) -> ScheduledStep:
    step = s.schedule()
    s.update(StepResult(step.decode, step.prefill, first_token_at=s.rows.max_rows))
    return step


def hand_out(s: Scheduler, step: ScheduledStep) -> None:
    arrived = [q for q in step.decode if q is not None] + step.completing
    s.update(StepResult(sampled=[Sampled(q, TOKEN) for q in arrived]))
    for q in arrived:
        q.tokens.append(TOKEN)
        q.num_generated += 1


def run_step(s: Scheduler) -> ScheduledStep:
    """One step of a core without async steps: tokens handed out before the next."""
    step = launch(s)
    hand_out(s, step)
    return step


def finish(s: Scheduler, q: PagedSequence) -> int | None:
    """What the core does at a sequence's end: retain its KV, then remove it."""
    kept = s.retain(q)
    s.remove(q)
    return kept


def spans(step: ScheduledStep) -> list[tuple[str, int, int]]:
    return [(p.seq.id, p.start, p.end) for p in step.prefill]


def used_blocks(s: Scheduler) -> int:
    return s.pool.num_blocks - 1 - s.pool.free_blocks


# --- admission and prefill -----------------------------------------------------------------


def test_admission_stops_at_the_batch_limit_and_resumes_when_a_row_leaves() -> None:
    s = make(max_batch_size=2)
    a, b, c = seq("a", [5] * 3), seq("b", [6] * 3), seq("c", [7] * 3)
    for q in (a, b, c):
        s.add(q)
    step = run_step(s)
    assert step.admitted == [a, b] and spans(step) == [("a", 0, 3), ("b", 0, 3)]
    assert (s.num_running, s.num_waiting) == (2, 1)
    assert s.running_and_prefilling() == [a, b]
    assert run_step(s).admitted == []  # still full
    finish(s, a)
    step = run_step(s)
    assert step.admitted == [c] and s.rows.seqs == [b, c] and s.num_waiting == 0


def test_prefill_is_chunked_within_the_budget_and_finished_pieces_come_first() -> None:
    s = make(chunk=10)
    short, long = seq("short", [5] * 3), seq("long", [6] * 20)
    s.add(short)
    s.add(long)
    first = run_step(s)
    assert spans(first) == [("short", 0, 3), ("long", 0, 7)]  # the one that draws first
    assert first.completing == [short] and s.rows.seqs == [short]
    assert s.rows.src[0] == s.rows.max_rows  # its token: where the runner put the draws
    second = run_step(s)
    assert second.decode == [short]
    assert spans(second) == [("long", 7, 17)]
    assert spans(run_step(s)) == [("long", 17, 20)]
    assert s.rows.seqs == [short, long] and s.prefill_tokens == 23
    assert long.computed == 20 and len(long.tokens) == 21  # its first draw handed out


# --- KV blocks, preemption and eviction ----------------------------------------------------


def test_a_row_crossing_into_a_new_block_gets_one() -> None:
    s = make()
    q = seq("a", [5] * 4)
    s.add(q)
    run_step(s)  # prefill: one block, full
    assert len(q.blocks) == 1 and q.computed == 4
    s.rows.tables_dirty = False
    step = run_step(s)  # its 5th token goes into a second block
    assert step.decode == [q] and len(q.blocks) == 2
    assert s.rows.block_table[0, :2].tolist() == q.blocks and s.rows.tables_dirty
    s.rows.tables_dirty = False
    run_step(s)  # the 6th fits that block
    assert len(q.blocks) == 2 and not s.rows.tables_dirty


def test_a_full_pool_preempts_the_last_row_back_to_the_front_of_the_queue() -> None:
    left: list[tuple[int, int | None]] = []
    s = make(blocks=5, max_batch_size=2, left=left)  # 4 usable blocks
    a, b, c = seq("a", [5] * 8), seq("b", [6] * 8), seq("c", [7] * 3)
    for q in (a, b, c):
        s.add(q)
    run_step(s)  # a and b prefilled: 2 blocks each, the pool is full
    assert s.rows.seqs == [a, b] and s.pool.free_blocks == 0
    step = run_step(s)  # a's 9th token needs a block: b, the last row, gives its back
    assert step.decode == [a] and len(a.blocks) == 3
    assert s.preemptions == 1 and left == [(1, None)]
    assert b.row is None and b.blocks == [] and b.computed == 0 and b.preempted
    assert list(s._waiting) == [b, c]
    assert s.rows.seqs == [a] and s.num_waiting == 2
    assert s.pool.free_blocks == 1  # one of b's two blocks went to a


def test_retained_caches_are_evicted_oldest_first_before_a_row_is_preempted() -> None:
    s = make(blocks=6, cache_blocks=2)  # 5 usable blocks
    for rid, token in (("old", 3), ("new", 4)):
        q = seq(rid, [token] * 4, key=rid)
        s.add(q)
        run_step(s)
        assert finish(s, q) == 4
    row = seq("row", [5] * 12)
    s.add(row)
    run_step(s)  # 3 blocks: with the 2 retained ones, the pool is full
    assert s.pool.free_blocks == 0
    step = run_step(s)  # its 13th token needs a 4th block: the oldest cache gives its own
    assert step.decode == [row] and len(row.blocks) == 4
    assert "old" not in s.store and "new" in s.store
    assert s.preemptions == 0


# --- saturation ----------------------------------------------------------------------------


def test_a_row_whose_pending_token_ends_it_is_not_scheduled() -> None:
    s = make()
    done, going = seq("done", [5] * 3, max_new_tokens=1), seq("going", [6] * 3, max_new_tokens=2)
    s.add(done)
    s.add(going)
    launch(s)  # both drew their first token, still on the device (async steps)
    step = launch(s)
    assert step.decode == [None, going] and s.rows.active[:2].tolist() == [False, True]
    assert done.computed == 3 and going.computed == 4


def test_one_result_applies_its_launch_then_the_draws_that_came_with_it() -> None:
    """Async steps: step 2's result carries what step 2 ran and step 1's draws."""
    s = make()
    q = seq("a", [5] * 3)
    s.add(q)
    first = s.schedule()
    s.update(StepResult(first.decode, first.prefill, first_token_at=s.rows.max_rows))
    assert (q.computed, q.pending, q.row) == (3, 1, 0)  # its first draw is on the device
    second = s.schedule()
    assert second.decode == [q]
    s.update(StepResult(second.decode, sampled=[Sampled(q, TOKEN)]))
    assert (q.computed, q.pending) == (4, 1)  # one more on the device, the first on the host
    assert s.rows.positions[0] == 4 and s.rows.src[0] == 0


def test_a_row_at_the_context_limit_is_not_scheduled() -> None:
    s = make(max_context=8)
    q = seq("a", [5] * 7)
    s.add(q)
    launch(s)  # its pending token is the 8th: the context is full
    assert launch(s).empty


# --- the prefix cache ----------------------------------------------------------------------

SYSTEM = [(7 * i) % 251 + 3 for i in range(SHARED_PREFIX_WAIT_TOKENS + 8)]  # 34 blocks


def test_a_newcomer_sharing_a_long_prefix_waits_a_step_then_shares_its_blocks() -> None:
    s = make(blocks=80, chunk=512)
    first, second = seq("first", SYSTEM + [1, 2]), seq("second", SYSTEM + [3, 4])
    s.add(first)
    s.add(second)
    step = run_step(s)
    assert step.admitted == [first, second] and spans(step) == [("first", 0, 138)]
    step = run_step(s)  # first's blocks are registered now
    shared = len(SYSTEM)
    assert spans(step) == [("second", shared, 138)]
    assert second.blocks[: shared // BLOCK] == first.blocks[: shared // BLOCK]
    assert all(s.pool.blocks.refs(b) == 2 for b in first.blocks[: shared // BLOCK])
    assert second.cached_tokens == shared
    assert s.prefix_cache_hits == shared and s.prefix_cache_queries == 138 + 138
    assert s.prefill_tokens == 138 + 2


def test_a_newcomer_sharing_only_a_short_header_does_not_wait() -> None:
    s = make(blocks=100, chunk=512)
    header = SYSTEM[: SHARED_PREFIX_WAIT_TOKENS - BLOCK]
    first, second = seq("first", header + [1] * 40), seq("second", header + [2] * 40)
    s.add(first)
    s.add(second)
    assert [p.seq for p in run_step(s).prefill] == [first, second]
    assert s.prefix_cache_hits == 0


def continued_inside_a_shared_block(blocks: int) -> tuple[Scheduler, PagedSequence, PagedSequence]:
    """Session ``a`` ran 8 tokens (2 full blocks, kept); ``b`` runs from those same
    blocks; then ``a`` comes back from its 6th token, inside ``b``'s second block."""
    s = make(blocks=blocks, cache_blocks=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    a1 = seq("a1", prompt, key="a")
    s.add(a1)
    run_step(s)
    assert finish(s, a1) == 8
    b = seq("b", prompt + [50, 51], key="b")
    s.add(b)
    run_step(s)
    assert b.cached_tokens == 8  # a's two blocks, shared
    s.pool.k.zero_()
    s.pool.k[:, b.blocks[1]] = 7.0  # the KV a copy must carry over
    a2 = seq("a2", prompt[:6] + [99, 98], key="a")
    s.add(a2)
    return s, a2, b


def test_a_turn_continued_inside_a_shared_block_writes_into_a_copy() -> None:
    s, a2, b = continued_inside_a_shared_block(blocks=16)
    step = launch(s)
    assert step.decode == [b] and spans(step) == [("a2", 6, 8)]
    assert a2.blocks[0] == b.blocks[0] and a2.blocks[1] != b.blocks[1]
    assert s.pool.blocks.refs(b.blocks[1]) == 1
    assert torch.equal(s.pool.k[:, a2.blocks[1]], s.pool.k[:, b.blocks[1]])
    assert a2.cached_tokens == 6


def test_a_turn_continued_inside_a_shared_block_recomputes_it_without_a_free_block() -> None:
    s, a2, b = continued_inside_a_shared_block(blocks=4)  # 3 usable: b holds them all
    step = launch(s)
    assert step.decode == [b] and step.prefill == []  # a2 waits for a block
    assert a2.blocks == b.blocks[:1] and a2.computed == a2.cached_tokens == 4
    assert s.pool.blocks.refs(b.blocks[1]) == 1


def test_a_cache_offloaded_to_the_host_comes_back_into_free_blocks_on_resume() -> None:
    s = make(blocks=8, cache_blocks=4)
    s.store.offload = torch.device("cpu")  # as a CUDA pool's with kv_offload_cpu
    a = seq("a", [3] * 6, key="k")
    s.add(a)
    run_step(s)
    s.pool.k[:, a.blocks[0]], s.pool.k[:, a.blocks[1]] = 5.0, 6.0
    assert finish(s, a) == 6
    assert used_blocks(s) == 0  # the host holds it
    s.pool.k.zero_()
    b = seq("b", [3] * 6 + [TOKEN, 9], key="k")
    s.add(b)
    assert spans(run_step(s)) == [("b", 6, 8)] and b.cached_tokens == 6
    assert bool((s.pool.k[:, b.blocks[0]] == 5.0).all() and (s.pool.k[:, b.blocks[1]] == 6.0).all())


# --- leaving -------------------------------------------------------------------------------


def test_a_row_leaving_is_filled_by_the_last_and_the_core_is_told() -> None:
    left: list[tuple[int, int | None]] = []
    s = make(left=left)
    a, b, c = seq("a", [5] * 3), seq("b", [6] * 3), seq("c", [7] * 3)
    for q in (a, b, c):
        s.add(q)
    run_step(s)
    held = used_blocks(s)
    s.remove(a)
    assert s.rows.seqs == [c, b] and (c.row, b.row, a.row) == (0, 1, None)
    assert left == [(0, 2)]
    assert s.rows.block_table[0, 0] == c.blocks[0]
    assert used_blocks(s) == held - 1
    s.remove(b)
    assert left == [(0, 2), (1, None)]


def test_the_scheduler_imports_no_model_code() -> None:
    tree = ast.parse(Path(scheduler_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    model_code = {"torch", "runner", "llama", "model", "attention", "attention_cpu", "quant"}
    assert not imported & model_code
