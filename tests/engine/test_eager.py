"""The eager core as a runner behind the paged core's scheduler.

``EagerRunner.execute`` runs a ``ScheduledStep`` (decode rows, prefill pieces of
one or more sequences) over its right-aligned KV buffers; the ``Scheduler``
plans over the eager KV space (nominal blocks, tensor copies for retained
caches). The tiny Llama runs eagerly here, so plain transformers greedy decoding
is the reference for every schedule: chunked, batched, preempted, resumed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.engine.conftest import run_all, tokens_of
from tests.engine.test_core import GREEDY, reference_greedy, request
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.eager_kv import NominalBlocks
from wsinfer.engine.lifecycle import EngineConfig
from wsinfer.engine.model import LoadedModel

BLOCK = 4
# Every turn makes its tokens in full, as the reference does (which ignores ends).
ALL = dataclasses.replace(GREEDY, ignore_eos=True)

SHORT = [[5, 6, 7], [9, 10, 11, 12, 13], [17]]
LONG = list(range(20, 50))  # 30 tokens


def eager(tiny: LoadedModel, **config: Any) -> EagerEngineCore:
    return EagerEngineCore(tiny, EngineConfig(block_size=BLOCK, **config))


def squeeze(core: EagerEngineCore, blocks: int) -> NominalBlocks:
    """Give ``core``'s scheduler only ``blocks`` nominal blocks (of ``BLOCK`` tokens)."""
    small = NominalBlocks(blocks, BLOCK)
    core.scheduler.pool = core.store.space = small
    return small


def counting_forwards(core: EagerEngineCore, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of tokens of each model forward ``core`` runs from now on."""
    calls: list[int] = []
    forward = core.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(int(kwargs["input_ids"].numel()))
        return forward(*args, **kwargs)

    monkeypatch.setattr(core.model, "forward", counted)
    return calls


def test_the_runner_executes_a_planned_step_and_its_rows_follow_the_schedule(
    tiny: LoadedModel,
) -> None:
    """One plan: three short prompts that complete and a long one's first chunk. The
    launch's draws are each completing prompt's first token; those sequences hold the
    batch's rows in the scheduler's order, and the long one keeps its chunk's KV."""
    core = eager(tiny, prefill_chunk_tokens=20)
    for i, ids in enumerate([*SHORT, LONG]):
        core.add(request(f"r{i}", ids, ALL))
    plan = core.scheduler.schedule()
    assert [(p.seq.id, p.start, p.end) for p in plan.prefill] == [
        ("r0", 0, 3), ("r1", 0, 5), ("r2", 0, 1), ("r3", 0, 11),
    ]  # fmt: skip
    with torch.inference_mode():  # as the core's step runs it
        launch = core.runner.execute(plan)
        result = launch.result()
        result.sampled = launch.collect()
    assert [(s.seq.id, s.token) for s in result.sampled] == [
        (f"r{i}", reference_greedy(tiny, ids, 1)[0]) for i, ids in enumerate(SHORT)
    ]
    core.scheduler.update(result)
    assert [s.id for s in core.scheduler.rows.seqs] == ["r0", "r1", "r2"]
    assert core.kv.batch.rows == 3 and core.kv.batch.width == 5  # right-aligned: the longest
    long = plan.prefill[3].seq
    assert long.row is None and long.kv is not None and long.kv.width == 11 == long.computed


def test_every_schedule_of_chunks_and_batches_draws_what_one_sequence_alone_does(
    tiny: LoadedModel,
) -> None:
    prompts = [*SHORT, LONG, LONG[:13]]
    for chunk in (4, 7, 64):
        core = eager(tiny, prefill_chunk_tokens=chunk, max_batch_size=3)
        for i, ids in enumerate(prompts):
            core.add(request(f"r{i}", ids, dataclasses.replace(ALL, max_new_tokens=6 + i)))
        outs = run_all(core)
        for i, ids in enumerate(prompts):
            assert tokens_of(outs[f"r{i}"]) == reference_greedy(tiny, ids, 6 + i), (chunk, i)


def test_fresh_short_prompts_share_one_forward_and_a_long_one_goes_alone(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = eager(tiny, prefill_chunk_tokens=16)
    for i, ids in enumerate(SHORT):
        core.add(request(f"r{i}", ids, ALL))
    calls = counting_forwards(core, monkeypatch)
    core.step()
    assert calls == [3 * 5]  # one forward, padded to the longest of them
    core.add(request("long", LONG, ALL))
    calls.clear()
    core.step()
    assert calls == [3, 16]  # the decode rows, then the newcomer's chunk alone


def test_a_row_preempted_for_want_of_blocks_is_recomputed_and_draws_the_same(
    tiny: LoadedModel,
) -> None:
    core = eager(tiny)
    squeeze(core, 6)  # 24 tokens: two rows of 9 prompt tokens fit, not their growth
    prompts = [list(range(5, 14)), list(range(30, 39))]
    for i, ids in enumerate(prompts):
        core.add(request(f"r{i}", ids, dataclasses.replace(ALL, max_new_tokens=10)))
    outs = run_all(core)
    assert core.scheduler.preemptions > 0
    for i, ids in enumerate(prompts):
        assert tokens_of(outs[f"r{i}"]) == reference_greedy(tiny, ids, 10)
    assert core.kv.batch.rows == 0 and core.scheduler.pool.free_blocks == 6


def test_a_full_space_preempts_and_keeps_the_retained_caches_which_hold_no_blocks(
    tiny: LoadedModel,
) -> None:
    core = eager(tiny)
    space = squeeze(core, 3)
    core.add(request("kept", [5, 6, 7], dataclasses.replace(ALL, max_new_tokens=2), cache_key="k"))
    run_all(core)
    assert core.cached_length("k") == 4 and space.free_blocks == 3
    # Its 12 tokens fill the space: its third block comes from the row beside it.
    core.add(request("row", list(range(20, 28)), dataclasses.replace(ALL, max_new_tokens=4)))
    core.add(request("other", [9, 10], dataclasses.replace(ALL, max_new_tokens=6)))
    outs = run_all(core)
    assert core.scheduler.preemptions > 0 and core.cached_length("k") == 4
    assert tokens_of(outs["row"]) == reference_greedy(tiny, list(range(20, 28)), 4)
    assert tokens_of(outs["other"]) == reference_greedy(tiny, [9, 10], 6)


def test_a_turn_paused_mid_prefill_keeps_its_chunks_and_resumes_from_them(
    tiny: LoadedModel,
) -> None:
    core = eager(tiny, prefill_chunk_tokens=8)
    core.add(request("a", LONG, ALL, cache_key="s"))
    core.step()
    core.step()  # two chunks in
    core.abort("a", pause=True)
    (paused,) = core.step()
    assert paused.paused and paused.kv_len == 16 == core.cached_length("s")
    core.add(request("a2", LONG, ALL, cache_key="s"))
    outs = run_all(core)["a2"]
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 16
    assert tokens_of(outs) == reference_greedy(tiny, LONG, 12)
    follow = LONG + tokens_of(outs)[:-1] + [7]  # the next turn: its last draw has no KV
    core.add(request("a3", follow, ALL, cache_key="s"))
    outs = run_all(core)["a3"]
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == len(follow) - 1
    assert tokens_of(outs) == reference_greedy(tiny, follow, 12)
