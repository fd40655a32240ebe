"""The paged fast path: async steps, graph buckets, the KV pool, preemption, fallback.

Everything here runs on CPU: the GPU path is the same code, with the decode
step replayed from CUDA graphs (``cuda_graphs=True`` on CPU runs the padded
bucket program eagerly, so what the graphs capture is tested here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.engine.conftest import run_all, text_of, tokens_of
from tests.engine.test_core import (
    GREEDY,
    PROMPTS,
    paused_and_resumed,
    prompt,
    reference_greedy,
    request,
)
from wsinfer.engine.core import EngineConfig, EngineCore, RequestOutput, build_core
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.lifecycle import UnsupportedConfig
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.prompts import render_chat
from wsinfer.sessions.schema import GenerationParams

SAMPLED = GenerationParams(
    max_new_tokens=14, temperature=0.9, top_k=30, top_p=0.9, repetition_penalty=1.2, seed=11
)


def staggered(core: EngineCore, tiny: LoadedModel, lengths: list[int]) -> dict[str, list[Any]]:
    """Requests joining at different steps, some while others' prefill is chunked."""
    ids = [prompt(tiny.tokenizer, p) for p in PROMPTS]
    schedule = {0: [0], 3: [1, 2], 5: [3], 9: [4]}
    outputs: dict[str, list[RequestOutput]] = {}
    for step in range(500):
        for i in schedule.get(step, []):
            params = dataclasses.replace(GREEDY, max_new_tokens=lengths[i])
            core.add(request(f"r{i}", ids[i], params))
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        if step > 9 and not core.has_unfinished():
            return outputs
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(max_batch_size=4, prefill_chunk_tokens=16, async_steps=True),
        EngineConfig(max_batch_size=4, prefill_chunk_tokens=16, cuda_graphs=True),
        EngineConfig(max_batch_size=4, prefill_chunk_tokens=16, cuda_graphs=True, async_steps=True),
    ],
    ids=["async", "graph-buckets", "graph-buckets-async"],
)
def test_async_steps_and_graph_buckets_match_the_reference(
    tiny: LoadedModel, config: EngineConfig
) -> None:
    core = EngineCore(tiny, config)
    lengths = [20, 9, 15, 12, 6]
    outputs = staggered(core, tiny, lengths)
    for i, n in enumerate(lengths):
        ids = prompt(tiny.tokenizer, PROMPTS[i])
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(tiny, ids, n), f"request {i}"
        assert [o.num_generated for o in outputs[f"r{i}"]] == list(range(1, n + 1))
    assert core.pool.free_blocks + _retained_blocks(core) == core.pool.num_blocks - 1


def _retained_blocks(core: EngineCore) -> int:
    return sum(len(e.blocks) for e in core.store.lru.values())


def test_async_steps_hand_out_a_step_later_and_stop_at_the_limit(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(async_steps=True))
    core.add(request("a", [5, 6, 7], dataclasses.replace(GREEDY, max_new_tokens=3)))
    assert core.step() == []  # the first token is still on its way
    outs = run_all(core)["a"]
    assert len(tokens_of(outs)) == 3 and outs[-1].finish_reason == "length"
    assert tokens_of(outs) == reference_greedy(tiny, [5, 6, 7], 3)


@pytest.mark.parametrize("async_steps", [False, True])
def test_seeded_sampling_survives_a_pause_with_a_token_in_flight(
    tiny: LoadedModel, async_steps: bool
) -> None:
    ids = prompt(tiny.tokenizer, "Once upon a time there was")
    straight = EngineCore(tiny)
    straight.add(request("a", ids, SAMPLED))
    expected = tokens_of(run_all(straight)["a"])
    core = EngineCore(tiny, EngineConfig(async_steps=async_steps, cuda_graphs=True))
    core.add(request("a", ids, SAMPLED, cache_key="k"))
    first: list[RequestOutput] = []
    while len(first) < 5:
        first += core.step()
    core.abort("a", pause=True)
    paused = core.step()
    assert [o.paused for o in paused] == [True]
    assert paused[0].num_generated == len(tokens_of(first))
    assert paused[0].kv_len == len(ids) + len(tokens_of(first)) - (0 if async_steps else 1)
    core.add(request("a", ids, SAMPLED, generated_ids=tokens_of(first), cache_key="k"))
    rest = run_all(core)["a"]
    assert rest[-1].usage is not None and rest[-1].usage.cached_tokens > len(ids)
    assert tokens_of(first) + tokens_of(rest) == expected


def test_sampling_does_not_depend_on_batch_neighbours_or_buckets(tiny: LoadedModel) -> None:
    ids = prompt(tiny.tokenizer, "The weather today")
    alone = EngineCore(tiny)
    alone.add(request("s", ids, SAMPLED))
    expected = tokens_of(run_all(alone)["s"])
    crowd = EngineCore(tiny, EngineConfig(max_batch_size=8, cuda_graphs=True, async_steps=True))
    for i in range(5):  # greedy and plain-temperature neighbours: other sampling programs
        params = GenerationParams(max_new_tokens=9 + i, temperature=0.5 * (i % 2), seed=i)
        crowd.add(request(f"n{i}", prompt(tiny.tokenizer, PROMPTS[i]), params))
    crowd.add(request("s", ids, SAMPLED))
    assert tokens_of(run_all(crowd)["s"]) == expected


def test_retained_kv_stays_in_the_pool_and_is_reused_without_copying(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    ids = [5] * 40
    core.add(request("a", ids, GREEDY, cache_key="s"))
    first = tokens_of(run_all(core)["a"])
    entry = core.store.lru.get("s")
    assert entry is not None and len(entry.token_ids) == 40 + 11 and entry.host is None
    assert len(entry.blocks) == core.pool.blocks_for(51)
    held = list(entry.blocks)
    follow = ids + first + [7, 8]
    core.add(request("b", follow, GREEDY, cache_key="s"))
    outs = core.step()
    seq = core._seqs["b"]
    assert seq.blocks[: len(held)] == held  # the same blocks, now the running row's
    outs += run_all(core)["b"]
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 51
    assert tokens_of(outs) == reference_greedy(tiny, follow, 12)


def test_a_full_pool_evicts_retained_caches_then_preempts_and_recomputes(
    tiny: LoadedModel,
) -> None:
    per_block = EngineCore(tiny, EngineConfig(max_batch_size=1)).pool.block_bytes
    # 12 usable blocks of 16 tokens: too few for four rows of ~60 tokens at once.
    config = EngineConfig(max_batch_size=4, kv_pool_bytes=13 * per_block, block_size=16)
    core = EngineCore(tiny, config)
    core.add(request("old", [9] * 30, dataclasses.replace(GREEDY, max_new_tokens=2), cache_key="x"))
    run_all(core)
    assert core.cached_length("x") > 0
    ids = [prompt(tiny.tokenizer, p) for p in PROMPTS[:4]]
    for i, row in enumerate(ids):
        core.add(request(f"r{i}", row[:20], dataclasses.replace(GREEDY, max_new_tokens=40)))
    outputs = run_all(core)
    assert core.cached_length("x") == 0  # evicted for running rows
    for i, row in enumerate(ids):
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(tiny, row[:20], 40), f"r{i}"


def test_offloaded_caches_come_back_into_the_pool(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(kv_offload_cpu=True))
    ids = prompt(tiny.tokenizer, PROMPTS[1])
    core.add(request("a", ids, GREEDY, cache_key="k"))
    first = tokens_of(run_all(core)["a"])
    follow = ids + first + [11]
    core.add(request("b", follow, GREEDY, cache_key="k"))
    outs = run_all(core)["b"]
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == len(ids) + 11
    assert tokens_of(outs) == reference_greedy(tiny, follow, 12)


def test_unwritten_pool_slots_never_reach_the_output(tiny: LoadedModel) -> None:
    """The CPU pool is not zeroed: whatever its unwritten slots hold (NaN here) must not
    leak into a prefill or decode that masks them."""
    core = EngineCore(tiny, EngineConfig(max_batch_size=4, prefill_chunk_tokens=16))
    core.pool.k.fill_(float("nan"))
    core.pool.v.fill_(float("nan"))
    ids = [prompt(tiny.tokenizer, p) for p in PROMPTS[:3]]
    for i, row in enumerate(ids):  # rows of different lengths, chunked: ragged tables
        core.add(request(f"r{i}", row))
    outputs = run_all(core)
    for i, row in enumerate(ids):
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(tiny, row, 12), f"r{i}"


def test_models_outside_the_llama_family_use_the_eager_core(tmp_path: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.models import tiny_model_dir
    from wsinfer.engine.model import load_model

    tokenizer = load_model(str(tiny_model_dir())).tokenizer
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    loaded = LoadedModel(model, tokenizer, "gpt2-tiny", torch.device("cpu"), set(), 256)
    core = build_core(loaded)
    assert isinstance(core, EagerEngineCore)
    core.add(request("a", [5, 6, 7]))
    assert tokens_of(run_all(core)["a"]) == reference_greedy(loaded, [5, 6, 7], 12)


def test_the_llama_family_gets_the_paged_core(tiny: LoadedModel) -> None:
    assert isinstance(build_core(tiny), EngineCore)


# --- the real model, against transformers ------------------------------------------------


def long_greedy(smol: LoadedModel, n: int) -> GenerationParams:
    return GenerationParams(max_new_tokens=n, temperature=0.0)


def test_real_model_matches_transformers_greedy_for_hundreds_of_tokens(smol: LoadedModel) -> None:
    """Batch 1, then rows of different lengths in one batch: token for token. The float32
    weights (transformers' own); the quantized format is checked in test_quant.py."""
    no_eos = dataclasses.replace(smol, eos_token_ids=set())
    float32 = EngineConfig(quantized_cpu_weights=False)
    questions = [
        "Write a long story about a dragon who learns to cook.",
        "Explain in detail how the internet works.",
        "List the planets of the solar system and describe each.",
    ]
    ids = [render_chat(smol.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    lengths = [256, 96, 160]
    expected = [reference_greedy(no_eos, row, n) for row, n in zip(ids, lengths, strict=True)]
    single = EngineCore(no_eos, float32)
    single.add(request("one", ids[0], long_greedy(smol, lengths[0])))
    assert tokens_of(run_all(single)["one"]) == expected[0]
    batch_config = dataclasses.replace(float32, max_batch_size=4, cuda_graphs=True)
    batch = EngineCore(no_eos, batch_config)
    for i, row in enumerate(ids):
        batch.add(request(f"r{i}", row, long_greedy(smol, lengths[i])))
    outputs = run_all(batch)
    for i in range(len(ids)):
        got = outputs[f"r{i}"]
        assert tokens_of(got) == expected[i], f"row {i}"
        assert text_of(got) == smol.tokenizer.decode(expected[i], skip_special_tokens=True)


def test_step_inputs_are_copied_from_contiguous_host_buffers(tiny: LoadedModel) -> None:
    """Below the largest bucket a column slice of a pinned [k, rows] staging buffer is
    not contiguous: on CUDA that copy goes through an unpinned temporary and may sync."""
    from torch.overrides import TorchFunctionMode

    sources: list[torch.Tensor] = []

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.Tensor.copy_:
                sources.append(args[1])
            return func(*args, **(kwargs or {}))

    core = EngineCore(tiny, EngineConfig(max_batch_size=8, cuda_graphs=True))
    stage = core.runner._stage

    def recorded(*args: Any) -> None:
        with Copies():
            stage(*args)

    core.runner._stage = recorded  # type: ignore[method-assign]
    for i in range(3):
        core.add(request(f"r{i}", prompt(tiny.tokenizer, PROMPTS[i]), SAMPLED))
    run_all(core)
    assert sources and all(src.is_contiguous() for src in sources)


@pytest.mark.parametrize(
    "kind",
    ["fast", "graph-buckets", "eager"],
)
@pytest.mark.parametrize("at", [0, 3], ids=["first-token", "decode"])
def test_min_tokens_holds_the_end_of_sequence_back_for_its_row_only(
    tiny: LoadedModel, kind: str, at: int
) -> None:
    """The end token is the greedy choice at token ``at``: a row with min_tokens draws
    something else until then (the prefill's draw for the first token, a decode step's
    for a later one); a row beside it without min_tokens still ends there."""
    ids = prompt(tiny.tokenizer, "Once upon a time")
    expected = reference_greedy(tiny, ids, 10)
    eos = expected[at]
    loaded = dataclasses.replace(tiny, eos_token_ids={eos})
    config = EngineConfig(max_batch_size=4, cuda_graphs=kind == "graph-buckets")
    core: Any = EagerEngineCore(loaded, config) if kind == "eager" else EngineCore(loaded, config)
    held = dataclasses.replace(GREEDY, max_new_tokens=10, min_tokens=at + 3)
    core.add(request("held", ids, held))
    core.add(request("free", ids, dataclasses.replace(GREEDY, max_new_tokens=10)))
    outs = run_all(core)
    free = tokens_of(outs["free"])
    assert free == expected[: expected.index(eos) + 1] and outs["free"][-1].finish_reason == "stop"
    tokens = tokens_of(outs["held"])
    assert tokens[:at] == expected[:at] and tokens[at] != eos
    assert eos not in tokens[: at + 3] and len(tokens) >= at + 3


def test_a_float16_kv_pool_keeps_sampling_batch_and_pause_invariant(tiny: LoadedModel) -> None:
    """Half the KV bytes; the promises of the float32 pool unchanged: a seeded turn
    draws the same tokens alone, in a crowd, and across a pause that keeps its KV."""
    half = EngineConfig(kv_dtype="float16")
    ids = prompt(tiny.tokenizer, "Once upon a time there was")
    alone = EngineCore(tiny, half)
    assert alone.pool.k.dtype == torch.float16
    assert alone.pool.block_bytes * 2 == EngineCore(tiny).pool.block_bytes
    alone.add(request("a", ids, SAMPLED))
    expected = tokens_of(run_all(alone)["a"])
    crowd = EngineCore(tiny, dataclasses.replace(half, max_batch_size=8))
    for i in range(5):
        params = GenerationParams(max_new_tokens=9 + i, temperature=0.5 * (i % 2), seed=i)
        crowd.add(request(f"n{i}", prompt(tiny.tokenizer, PROMPTS[i]), params))
    crowd.add(request("a", ids, SAMPLED))
    assert tokens_of(run_all(crowd)["a"]) == expected
    first, rest = paused_and_resumed(EngineCore(tiny, half), ids, SAMPLED)
    assert rest[-1].usage is not None and rest[-1].usage.cached_tokens > len(ids)
    assert tokens_of(first) + tokens_of(rest) == expected


def test_a_float16_kv_pool_without_the_native_attention_is_refused(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsinfer.engine import native

    monkeypatch.setattr(native, "kernels", lambda: None)
    with pytest.raises(UnsupportedConfig, match="--kv-dtype float16: only the CPU engine's"):
        EngineCore(tiny, EngineConfig(kv_dtype="float16"))
    assert EngineCore(tiny, EngineConfig(kv_dtype="float32")).pool.k.dtype == torch.float32
