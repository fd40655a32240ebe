from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import torch

from tests.engine.conftest import run_all, text_of, tokens_of
from wsinfer.contract import ErrorCode
from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest, RequestOutput
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.prompts import render_chat
from wsinfer.sessions.schema import GenerationParams

GREEDY = GenerationParams(max_new_tokens=12, temperature=0.0)


def prompt(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def reference_greedy(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    """Plain transformers greedy decoding, one sequence at a time."""
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
        )
    return [int(t) for t in out[0, len(ids) :]]


def request(
    rid: str, ids: list[int], params: GenerationParams = GREEDY, **kw: Any
) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_ids=ids, params=params, **kw)


def paused_and_resumed(
    core: EngineCore, ids: list[int], params: GenerationParams, after: int = 5
) -> tuple[list[RequestOutput], list[RequestOutput]]:
    """Turn "a" paused (its KV kept under "k") once ``after`` outputs are out, then
    resumed from its tokens: the outputs before the pause and after it."""
    core.add(request("a", ids, params, cache_key="k"))
    first: list[RequestOutput] = []
    while len(first) < after:
        first += core.step()
    core.abort("a", pause=True)
    core.step()
    core.add(request("a", ids, params, generated_ids=tokens_of(first), cache_key="k"))
    return first, run_all(core)["a"]


PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog " * 3,
    "Once upon a time",
    "A long prompt that has to go through several prefill chunks. " * 12,
    "x",
]


def test_batched_greedy_matches_single_sequence_decoding(tiny: LoadedModel) -> None:
    config = EngineConfig(max_batch_size=4, prefill_chunk_tokens=16, compact_min_columns=4)
    core = EngineCore(tiny, config)
    ids = [prompt(tiny.tokenizer, p) for p in PROMPTS]
    lengths = [20, 9, 15, 12, 6]
    outputs: dict[str, list[RequestOutput]] = {}
    # Requests join at different steps, some while others' prefill is chunked.
    schedule = {0: [0], 3: [1, 2], 5: [3], 9: [4]}
    for step in range(400):
        for i in schedule.get(step, []):
            params = dataclasses.replace(GREEDY, max_new_tokens=lengths[i])
            core.add(request(f"r{i}", ids[i], params))
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        if step > 9 and not core.has_unfinished():
            break
    for i, n in enumerate(lengths):
        got = tokens_of(outputs[f"r{i}"])
        assert got == reference_greedy(tiny, ids[i], n), f"request {i}"
        last = outputs[f"r{i}"][-1]
        assert last.finished and last.finish_reason == "length" and last.num_generated == n


def test_cpu_float32_weights_are_packed_by_default_with_the_same_output(
    tiny: LoadedModel,
) -> None:
    from tests.models import tiny_model_dir
    from wsinfer.engine.model import load_model

    fresh = load_model(str(tiny_model_dir()))  # a copy of our own: packing changes it in place
    unpacked = load_model(str(tiny_model_dir()))
    cores = [EngineCore(fresh), EngineCore(unpacked, EngineConfig(pack_cpu_weights=False))]
    assert all(layer.qkv.transposed for layer in cores[0].model.layers)
    assert not any(layer.qkv.transposed for layer in cores[1].model.layers)
    ids = prompt(tiny.tokenizer, PROMPTS[1])
    runs = []
    for core in cores:
        core.add(request("r", ids, dataclasses.replace(GREEDY, max_new_tokens=24)))
        runs.append(tokens_of(run_all(core)["r"]))
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_outputs_carry_seq_and_text(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    ids = prompt(tiny.tokenizer, "Hello there")
    core.add(request("a", ids))
    outs = run_all(core)["a"]
    assert [o.num_generated for o in outs] == list(range(1, 13))
    assert all(len(o.new_token_ids) == 1 for o in outs)
    assert text_of(outs) == tiny.tokenizer.decode(tokens_of(outs), skip_special_tokens=True)
    assert outs[-1].usage is not None
    assert outs[-1].usage.prompt_tokens == len(ids) and outs[-1].usage.completion_tokens == 12


def test_length_limit(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(
        request("a", prompt(tiny.tokenizer, "Hi"), dataclasses.replace(GREEDY, max_new_tokens=3))
    )
    outs = run_all(core)["a"]
    assert len(tokens_of(outs)) == 3
    assert outs[-1].finish_reason == "length"
    assert not core.has_unfinished()


def test_eos_stops_and_is_not_emitted(tiny: LoadedModel) -> None:
    ids = prompt(tiny.tokenizer, "Once upon a time")
    expected = reference_greedy(tiny, ids, 8)
    eos = expected[4]
    loaded = dataclasses.replace(tiny, eos_token_ids={eos})
    core = EngineCore(loaded)
    core.add(request("a", ids))
    outs = run_all(core)["a"]
    cut = expected.index(eos)
    assert tokens_of(outs) == expected[: cut + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_generated == cut + 1
    assert text_of(outs) == tiny.tokenizer.decode(expected[:cut], skip_special_tokens=True)


def test_ignore_eos_runs_past_the_end_of_sequence_to_the_length_limit(
    tiny: LoadedModel,
) -> None:
    ids = prompt(tiny.tokenizer, "Once upon a time")
    expected = reference_greedy(tiny, ids, 8)
    loaded = dataclasses.replace(tiny, eos_token_ids={expected[4]})
    params = dataclasses.replace(GREEDY, max_new_tokens=8, ignore_eos=True)
    core = EngineCore(loaded)
    core.add(request("a", ids, params))
    outs = run_all(core)["a"]
    assert tokens_of(outs) == expected and outs[-1].finish_reason == "length"
    assert text_of(outs) == tiny.tokenizer.decode(expected, skip_special_tokens=True)
    # A takeover from the token log (the end-of-sequence token in it) goes on the same.
    taken = EngineCore(loaded)
    taken.add(request("b", ids, params, generated_ids=expected[:6]))
    rest = run_all(taken)["b"]
    assert tokens_of(rest) == expected[6:] and rest[-1].finish_reason == "length"


def test_stop_string(tiny: LoadedModel) -> None:
    ids = prompt(tiny.tokenizer, "Once upon a time")
    free = EngineCore(tiny)
    free.add(request("a", ids, dataclasses.replace(GREEDY, max_new_tokens=20)))
    full_text = text_of(run_all(free)["a"])
    middle = len(full_text) // 2
    stop = full_text[middle : middle + 3]
    assert stop and full_text.find(stop) >= 0
    core = EngineCore(tiny)
    params = dataclasses.replace(GREEDY, max_new_tokens=20, stop=(stop,))
    core.add(request("a", ids, params))
    outs = run_all(core)["a"]
    assert outs[-1].finish_reason == "stop"
    assert text_of(outs) == full_text[: full_text.find(stop)]


def test_prompt_too_long_is_an_error(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("long", [5] * tiny.max_context))
    core.add(request("ok", [5, 6, 7]))
    outs = run_all(core)
    assert len(outs["long"]) == 1
    err = outs["long"][0]
    assert err.finished and err.finish_reason == "error" and err.error
    assert err.error.code is ErrorCode.TOO_LARGE  # chosen here, by type, not by its words
    assert outs["ok"][-1].finish_reason == "length"


def test_duplicate_request_id_is_refused(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("a", [5, 6]))
    with pytest.raises(ValueError):
        core.add(request("a", [5, 6]))


def test_abort_cancels(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(
        request(
            "a", prompt(tiny.tokenizer, "Hello"), dataclasses.replace(GREEDY, max_new_tokens=50)
        )
    )
    core.add(
        request("b", prompt(tiny.tokenizer, "World"), dataclasses.replace(GREEDY, max_new_tokens=6))
    )
    for _ in range(4):
        core.step()
    core.abort("a")
    core.abort("nobody")  # unknown ids are ignored
    outs = run_all(core)
    final = outs["a"][-1]
    assert len(outs["a"]) == 1
    assert final.finished and final.finish_reason == "cancelled" and final.new_token_ids == []
    assert final.usage is not None and final.usage.completion_tokens == final.num_generated
    assert outs["b"][-1].finish_reason == "length"


def test_a_stop_while_text_is_held_back_ends_the_turn_before_it(tiny: LoadedModel) -> None:
    """Stopped while a token's text is held back (it may begin a stop string), the turn
    ends with no text of its own: a delta for it would carry no token and so repeat the
    last delta's seq, which every follower drops as already seen (its text lost to all
    of them, though the next turn's prompt would hold it)."""
    ids = prompt(tiny.tokenizer, "Once upon a time")
    free = EngineCore(tiny)
    free.add(request("a", ids, dataclasses.replace(GREEDY, max_new_tokens=20)))
    texts = [out.text for out in run_all(free)["a"]]
    target = next(i for i, text in enumerate(texts) if i >= 2 and text.strip())
    # A stop string that begins with the target token's last character, and never matches.
    held = texts[target][-1]
    params = dataclasses.replace(GREEDY, max_new_tokens=20, stop=(held + "\x00",))
    core = EngineCore(tiny)
    core.add(request("a", ids, params))
    outs: list[RequestOutput] = []
    while not outs or outs[-1].num_generated < target + 1:
        outs += core.step()
    assert "".join(texts[: target + 1]).startswith(text_of(outs) + held)
    core.abort("a")
    final = run_all(core)["a"]
    assert len(final) == 1 and final[0].finish_reason == "cancelled"
    assert final[0].text == "" and final[0].num_generated == target + 1


def test_abort_while_waiting(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("a", [5, 6, 7]))
    core.abort("a")
    outs = run_all(core)
    assert outs["a"][-1].finish_reason == "cancelled" and outs["a"][-1].num_generated == 0


@pytest.mark.parametrize("cache_key", [None, "session-1"])
@pytest.mark.parametrize("seed", [None, 77])
def test_pause_then_resume_continues_identically(
    tiny: LoadedModel, cache_key: str | None, seed: int | None
) -> None:
    ids = prompt(tiny.tokenizer, "The quick brown fox")
    params = GenerationParams(
        max_new_tokens=16, temperature=0.0 if seed is None else 0.9, seed=seed
    )
    straight_core = EngineCore(tiny)
    straight_core.add(request("a", ids, params))
    straight = run_all(straight_core)["a"]

    core = EngineCore(tiny)
    core.add(request("t1", ids, params, cache_key=cache_key))
    first: list[RequestOutput] = []
    while len(first) < 6:
        first += core.step()
    core.abort("t1", pause=True)
    paused = core.step()
    assert len(paused) == 1 and paused[0].paused and not paused[0].finished
    assert paused[0].num_generated == 6 and paused[0].new_token_ids == []
    assert not core.has_unfinished()
    if cache_key is not None:
        assert paused[0].kv_len == len(ids) + 5
        assert core.cached_length(cache_key) == len(ids) + 5

    core.add(request("t1", ids, params, generated_ids=tokens_of(first), cache_key=cache_key))
    rest = run_all(core)["t1"]
    assert tokens_of(first + rest) == tokens_of(straight)
    assert text_of(first + rest) == text_of(straight)
    assert rest[0].num_generated == 7
    usage = rest[-1].usage
    assert usage is not None
    assert usage.cached_tokens == (len(ids) + 5 if cache_key else 0)


def test_multi_turn_reuses_retained_cache(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    turn1 = prompt(tok, "User: hello there. Assistant:")
    params = dataclasses.replace(GREEDY, max_new_tokens=10)
    core = EngineCore(tiny)
    core.add(request("s:1", turn1, params, cache_key="s"))
    out1 = run_all(core)["s:1"]
    assert out1[-1].kv_len == len(turn1) + 9
    turn2 = turn1 + tokens_of(out1) + prompt(tok, " User: and more? Assistant:")
    core.add(request("s:2", turn2, params, cache_key="s"))
    out2 = run_all(core)["s:2"]
    assert out2[-1].usage is not None and out2[-1].usage.cached_tokens == len(turn1) + 9
    assert tokens_of(out2) == reference_greedy(tiny, turn2, 10)


def test_cache_reuse_with_diverging_history(tiny: LoadedModel) -> None:
    tok = tiny.tokenizer
    base = prompt(tok, "Shared beginning of a conversation that")
    core = EngineCore(tiny)
    core.add(request("s:1", base + prompt(tok, " goes one way"), GREEDY, cache_key="s"))
    run_all(core)
    other = base + prompt(tok, " goes another way entirely")
    core.add(request("s:2", other, GREEDY, cache_key="s"))
    out = run_all(core)["s:2"]
    assert out[-1].usage is not None and out[-1].usage.cached_tokens >= len(base)
    assert tokens_of(out) == reference_greedy(tiny, other, 12)


def test_drop_cache_and_lru_budget(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("a", [5] * 40, GREEDY, cache_key="a"))
    run_all(core)
    assert core.cached_length("a") == 40 + 11
    core.drop_cache("a")
    assert core.cached_length("a") == 0
    one = core.store  # measure one entry, then allow only about one
    core.add(request("b", [5] * 40, GREEDY, cache_key="b"))
    run_all(core)
    size = one.used_bytes
    small = EngineCore(tiny, EngineConfig(kv_cache_bytes=int(size * 1.5)))
    for key in ("x", "y"):
        small.add(request(key, [5] * 40, GREEDY, cache_key=key))
        run_all(small)
    assert small.cached_length("x") == 0 and small.cached_length("y") == 51


def test_real_model_knows_the_capital_of_france(smol: LoadedModel) -> None:
    ids = render_chat(
        smol.tokenizer, [{"role": "user", "content": "What is the capital of France?"}]
    )
    core = EngineCore(smol)
    core.add(request("q", ids, GenerationParams(max_new_tokens=40, temperature=0.0)))
    outs = run_all(core)["q"]
    assert "Paris" in text_of(outs)
    assert outs[-1].finish_reason == "stop"  # <|im_end|> ends the answer


def test_burst_of_newcomers_is_prefilled_together_and_matches_reference(
    tiny: LoadedModel,
) -> None:
    core = EngineCore(tiny, EngineConfig(max_batch_size=8, prefill_chunk_tokens=256))
    ids = [
        prompt(tiny.tokenizer, p) for p in PROMPTS[:3] + ["One", "Two words", "Three more words"]
    ]
    for i, row in enumerate(ids):
        core.add(request(f"r{i}", row))
    first = core.step()
    # Every short prompt went through a single prefill forward in the first step.
    assert sorted(out.request_id for out in first) == [f"r{i}" for i in range(len(ids))]
    outputs = run_all(core)
    for i, row in enumerate(ids):
        got = first[[o.request_id for o in first].index(f"r{i}")].new_token_ids
        got += tokens_of(outputs[f"r{i}"])
        assert got == reference_greedy(tiny, row, 12), f"request {i}"


def test_repetition_penalty_and_filters_are_reproducible_across_pause(tiny: LoadedModel) -> None:
    ids = prompt(tiny.tokenizer, "Once upon a time there was")
    params = GenerationParams(
        max_new_tokens=14, temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=5
    )
    straight = EngineCore(tiny)
    straight.add(request("a", ids, params))
    expected = tokens_of(run_all(straight)["a"])
    core = EngineCore(tiny, EngineConfig(kv_offload_cpu=True))
    first, rest = paused_and_resumed(core, ids, params)
    assert tokens_of(first) + tokens_of(rest) == expected


def test_pause_during_chunked_prefill_keeps_the_partial_cache(tiny: LoadedModel) -> None:
    ids = prompt(tiny.tokenizer, "A long prompt for chunked prefill. " * 10)
    core = EngineCore(tiny, EngineConfig(prefill_chunk_tokens=16))
    core.add(request("a", ids, cache_key="k"))
    assert core.step() == []  # first chunk only
    core.abort("a", pause=True)
    paused = core.step()
    assert paused[0].paused and paused[0].num_generated == 0 and paused[0].kv_len == 16
    core.add(request("a", ids, cache_key="k"))
    outs = run_all(core)["a"]
    assert outs[-1].usage is not None and outs[-1].usage.cached_tokens == 16
    assert tokens_of(outs) == reference_greedy(tiny, ids, 12)


def test_more_requests_than_slots_queue_up(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(max_batch_size=2))
    ids = [prompt(tiny.tokenizer, f"Request number {i} says") for i in range(5)]
    for i, row in enumerate(ids):
        core.add(request(f"r{i}", row, dataclasses.replace(GREEDY, max_new_tokens=4 + i)))
    seen_running = 0
    outputs: dict[str, list[RequestOutput]] = {}
    while core.has_unfinished():
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        seen_running = max(seen_running, core.num_running)
    assert seen_running == 2
    for i, row in enumerate(ids):
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(tiny, row, 4 + i)


@pytest.mark.parametrize("kind", ["paged", "paged-async", "eager"])
def test_a_failing_forward_ends_its_requests_and_the_engine_recovers(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # Both cores share the step (CoreBase.step); the paged one, with async steps, also
    # holds the last step's tokens, which a failure must drop with its requests.
    config = EngineConfig(async_steps=kind == "paged-async")
    core: Any = EagerEngineCore(tiny, config) if kind == "eager" else EngineCore(tiny, config)
    core.add(request("a", [5, 6, 7]))
    core.step()
    original = core.model.forward

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(core.model, "forward", broken)
    outs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert outs[0].error and "out of memory" in outs[0].error.message
    assert outs[0].error.code is ErrorCode.INTERNAL
    monkeypatch.setattr(core.model, "forward", original)
    core.add(request("b", [5, 6, 7]))
    assert tokens_of(run_all(core)["b"]) == reference_greedy(tiny, [5, 6, 7], 12)


def test_every_output_with_text_is_at_a_seq_of_its_own_whatever_the_schedule(
    tiny: LoadedModel,
) -> None:
    """What followers rely on: a delta's seq grows with every delta (a repeated seq is
    dropped as already seen). Over random schedules of turns with stop strings taken
    from their own text (so text is often held back), stopped, paused and resumed
    from their token log at random steps, every output that carries text has new
    tokens or a seq past the turn's last, and the text of a turn's outputs, resumes
    included, is its uninterrupted text up to where it ended."""
    rng = random.Random(28)
    ids = prompt(tiny.tokenizer, "Once upon a time")
    free = EngineCore(tiny)
    free.add(request("free", ids, dataclasses.replace(GREEDY, max_new_tokens=24)))
    full_outs = run_all(free)["free"]
    full = text_of(full_outs)
    for _ in range(100):
        core = EngineCore(tiny, EngineConfig(max_batch_size=3))
        turns: dict[str, dict[str, Any]] = {}
        for n in range(3):
            start = rng.randrange(len(full))
            stop = full[start : start + rng.randint(1, 4)] + rng.choice(["", "\x00"])
            params = dataclasses.replace(GREEDY, max_new_tokens=24, stop=(stop,))
            turns[f"t{n}"] = {"params": params, "tokens": [], "text": "", "seq": 0, "over": False}
            core.add(request(f"t{n}", ids, params))
        for _step in range(200):
            if all(t["over"] for t in turns.values()):
                break
            for rid, turn in turns.items():
                if not turn["over"] and rng.random() < 0.08:
                    core.abort(rid, pause=rng.random() < 0.6)
            for out in core.step():
                turn = turns[out.request_id]
                if out.text:
                    assert out.new_token_ids or out.num_generated > turn["seq"], out
                turn["seq"] = max(turn["seq"], out.num_generated)
                turn["tokens"] += out.new_token_ids
                turn["text"] += out.text
                if out.paused:  # resumed at once, from its token log, as the engine does
                    again = request(
                        out.request_id, ids, turn["params"], generated_ids=turn["tokens"]
                    )
                    core.add(again)
                elif out.finished:
                    turn["over"] = True
                    stop = turn["params"].stop[0]
                    whole = full[: full.find(stop)] if stop in full else full
                    assert whole.startswith(turn["text"]), (stop, turn["text"])
