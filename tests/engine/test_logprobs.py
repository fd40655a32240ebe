"""Log-probabilities of drawn tokens (params.logprobs): the model's own, on every core."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from tests.engine.conftest import run_all, tokens_of
from tests.engine.test_core import prompt, request
from wsinfer.engine.core import EngineConfig, EngineCore, RequestOutput
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.logprobs import TokenLogprob
from wsinfer.engine.model import LoadedModel
from wsinfer.sessions.schema import GenerationParams, ParamsError

CORES = ["paged", "padded", "eager"]


def core_of(kind: str, loaded: LoadedModel) -> Any:
    config = EngineConfig(max_batch_size=4, prefill_chunk_tokens=16)
    if kind == "eager":
        return EagerEngineCore(loaded, config)
    core = EngineCore(loaded, config)
    core.runner.padded = kind == "padded"  # the CUDA graphs' program, run eagerly
    return core


def reference_logprobs(loaded: LoadedModel, ids: list[int], drawn: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each drawn token's place, [len(drawn), V]."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids + drawn])).logits[0].float()
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(drawn)], dim=-1)


def entries(outputs: list[RequestOutput]) -> list[TokenLogprob]:
    return [lp for out in outputs for lp in out.logprobs]


@pytest.mark.parametrize("kind", CORES)
@pytest.mark.parametrize("temperature", [0.0, 1.3])
def test_logprobs_are_the_models_own_whatever_the_draw(
    tiny: LoadedModel, kind: str, temperature: float
) -> None:
    """Each drawn token's log-probability and the top five are transformers' log-softmax
    of the raw logits: the temperature changes the draws, never the numbers."""
    loaded = dataclasses.replace(tiny, eos_token_ids=set())
    ids = prompt(tiny.tokenizer, "The quick brown fox jumps over the lazy dog")
    params = GenerationParams(
        max_new_tokens=10, temperature=temperature, seed=7, logprobs=True, top_logprobs=5
    )
    core = core_of(kind, loaded)
    out = run_all_with(core, [request("a", ids, params)])["a"]
    drawn, got = tokens_of(out), entries(out)
    assert [e.token for e in got] == drawn and len(drawn) == 10
    expected = reference_logprobs(tiny, ids, drawn)
    for i, entry in enumerate(got):
        assert entry.logprob == pytest.approx(float(expected[i, drawn[i]]), abs=1e-4)
        top = expected[i].topk(5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
        if temperature == 0.0:  # greedy draws the most likely token
            assert entry.top[0] == (entry.token, entry.logprob)


def run_all_with(core: Any, requests: list[Any]) -> dict[str, list[RequestOutput]]:
    for r in requests:
        core.add(r)
    return run_all(core)


@pytest.mark.parametrize("kind", CORES)
def test_only_the_rows_that_ask_get_logprobs_and_asking_changes_no_token(
    tiny: LoadedModel, kind: str
) -> None:
    loaded = dataclasses.replace(tiny, eos_token_ids=set())
    sampled = GenerationParams(max_new_tokens=8, temperature=0.9, seed=3)
    asking = dataclasses.replace(sampled, logprobs=True)
    texts = ["Hello there", "Once upon a time in a land", "x"]
    ids = [prompt(tiny.tokenizer, t) for t in texts]
    plain_requests = [request(f"r{i}", p, sampled) for i, p in enumerate(ids)]
    plain = run_all_with(core_of(kind, loaded), plain_requests)
    mixed = run_all_with(
        core_of(kind, loaded),
        [request(f"r{i}", p, asking if i == 1 else sampled) for i, p in enumerate(ids)],
    )
    for i in range(3):
        assert tokens_of(mixed[f"r{i}"]) == tokens_of(plain[f"r{i}"])
    assert not entries(mixed["r0"]) and not entries(mixed["r2"])
    got = entries(mixed["r1"])
    assert [e.token for e in got] == tokens_of(mixed["r1"])
    assert all(e.top == () and e.logprob <= 0.0 for e in got)  # top_logprobs 0: none


def test_an_end_of_sequence_token_gets_no_entry(tiny: LoadedModel) -> None:
    ids = prompt(tiny.tokenizer, "Hello")
    greedy = GenerationParams(max_new_tokens=6, temperature=0.0, logprobs=True)
    first = tokens_of(run_all_with(EngineCore(tiny), [request("a", ids, greedy)])["a"])
    ends_on_third = dataclasses.replace(tiny, eos_token_ids={first[2]})
    out = run_all_with(EngineCore(ends_on_third), [request("b", ids, greedy)])["b"]
    assert tokens_of(out) == first[:3]
    assert [e.token for e in entries(out)] == first[:2]
    assert out[-1].finish_reason == "stop"


def test_logprobs_survive_a_takeover_from_the_token_log(tiny: LoadedModel) -> None:
    """A rebuilt turn's next entries are those the uninterrupted turn had."""
    loaded = dataclasses.replace(tiny, eos_token_ids=set())
    ids = prompt(tiny.tokenizer, "Once upon a time")
    params = GenerationParams(max_new_tokens=9, temperature=0.0, logprobs=True, top_logprobs=3)
    whole = run_all_with(EngineCore(loaded), [request("a", ids, params)])["a"]
    drawn = tokens_of(whole)
    rebuilt = run_all_with(
        EngineCore(loaded), [request("t", ids, params, generated_ids=drawn[:4])]
    )["t"]
    assert [e.token for e in entries(rebuilt)] == drawn[4:]
    for got, want in zip(entries(rebuilt), entries(whole)[4:], strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in"),
        ({"logprobs": 1}, "logprobs must be true or false"),
    ],
)
def test_bad_logprobs_params_are_refused(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ParamsError, match=message):
        GenerationParams.parse(raw)


def test_logprobs_params_round_trip_and_are_left_out_at_their_defaults() -> None:
    params = GenerationParams.parse({"logprobs": True, "top_logprobs": 4})
    assert GenerationParams.from_dict(params.to_dict()) == params
    assert "logprobs" not in GenerationParams().to_dict()
    assert "top_logprobs" not in GenerationParams().to_dict()
