"""OpenAI's presence and frequency penalties and typical_p, on every sampling path.

The penalties count the tokens this turn generated, rebuilt from the turn's token
ids wherever a row (re)joins a batch: so a seeded turn draws the same tokens alone or
in a batch, straight through or resumed after a pause or on another engine.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from transformers import TypicalLogitsWarper

from tests.engine.conftest import run_all, tokens_of
from wsinfer.engine.core import EngineConfig, EngineCore, EngineRequest, RequestOutput
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.model import LoadedModel
from wsinfer.engine.sampler import sample
from wsinfer.engine.sampling import (
    RowSampling,
    Variant,
    atypical,
    generated_counts,
    sample_tokens_torch,
    shape_logits,
    tensors_for,
)
from wsinfer.sessions.schema import GenerationParams, ParamsError

CORES: dict[str, Any] = {
    "paged": lambda m: EngineCore(m, EngineConfig(max_batch_size=4)),
    "paged-async": lambda m: EngineCore(m, EngineConfig(max_batch_size=4, async_steps=True)),
    "eager": lambda m: EagerEngineCore(m, EngineConfig(max_batch_size=4)),
}


def ids_of(tiny: LoadedModel, text: str) -> list[int]:
    return list(tiny.tokenizer.encode(text, add_special_tokens=False))


def generate(core: Any, ids: list[int], params: GenerationParams, **kw: Any) -> list[int]:
    core.add(EngineRequest(request_id="a", prompt_ids=ids, params=params, **kw))
    return tokens_of(run_all(core)["a"])


def most_repeated(tokens: list[int]) -> int:
    return max(Counter(tokens).values())


@pytest.mark.parametrize("kind", ["paged", "eager"])
def test_a_strong_frequency_or_presence_penalty_prevents_the_repeats_of_plain_greedy(
    tiny: LoadedModel, kind: str
) -> None:
    ids = ids_of(tiny, "Once upon a time")
    base = GenerationParams(max_new_tokens=150, temperature=0.0, ignore_eos=True)
    plain = generate(CORES[kind](tiny), ids, base)
    assert most_repeated(plain) > 1  # the random model repeats itself within 150 tokens
    for name in ("frequency_penalty", "presence_penalty"):
        penalized = generate(CORES[kind](tiny), ids, GenerationParams(**{**vars(base), name: 2.0}))
        assert most_repeated(penalized) == 1, name
        assert penalized[0] == plain[0]  # nothing generated yet: nothing to penalize
    # A negative penalty rewards the turn's own tokens: it loops.
    looping = generate(
        CORES[kind](tiny), ids, GenerationParams(**{**vars(base), "frequency_penalty": -2.0})
    )
    assert most_repeated(looping) > 20


SEEDED = GenerationParams(
    max_new_tokens=60,
    temperature=0.9,
    seed=11,
    ignore_eos=True,
    # Rewarding the turn's own tokens makes it loop: every draw depends on the counts.
    frequency_penalty=-2.0,
    presence_penalty=-2.0,
)
# Both kinds of penalty (the context's, the turn's) and the filters in one row.
MIXED = GenerationParams(
    max_new_tokens=30,
    temperature=1.3,
    seed=6,
    ignore_eos=True,
    repetition_penalty=1.3,
    frequency_penalty=0.7,
    presence_penalty=0.3,
    top_p=0.95,
)
TYPICAL = GenerationParams(
    max_new_tokens=20, temperature=1.2, seed=4, ignore_eos=True, typical_p=0.4, top_k=200
)
NEIGHBOURS = [
    GenerationParams(max_new_tokens=30, temperature=0.0, ignore_eos=True),
    GenerationParams(max_new_tokens=25, temperature=0.7, seed=2, top_p=0.9, ignore_eos=True),
    GenerationParams(max_new_tokens=35, temperature=1.0, seed=3, ignore_eos=True),
]


@pytest.mark.parametrize("kind", sorted(CORES))
@pytest.mark.parametrize("params", [SEEDED, MIXED, TYPICAL], ids=["penalties", "mixed", "typical"])
def test_a_seeded_turn_draws_the_same_alone_in_a_batch_and_after_a_takeover(
    tiny: LoadedModel, kind: str, params: GenerationParams
) -> None:
    ids = ids_of(tiny, "The quick brown fox")
    alone = generate(CORES[kind](tiny), ids, params)
    # In a batch with neighbours of other parameters, joining before and after it.
    core = CORES[kind](tiny)
    core.add(EngineRequest(request_id="n0", prompt_ids=ids_of(tiny, "Hello"), params=NEIGHBOURS[0]))
    early = core.step()
    core.add(EngineRequest(request_id="a", prompt_ids=ids, params=params))
    early += core.step()
    for i, other in enumerate(NEIGHBOURS[1:], 1):
        core.add(EngineRequest(request_id=f"n{i}", prompt_ids=ids_of(tiny, "x y"), params=other))
    batched = [o for o in early if o.request_id == "a"] + run_all(core)["a"]
    assert tokens_of(batched) == alone
    # Paused after 13 tokens, then taken over by a fresh core from the token log.
    core = CORES[kind](tiny)
    core.add(EngineRequest(request_id="a", prompt_ids=ids, params=params))
    first: list[RequestOutput] = []
    while len(tokens_of(first)) < 13:
        first += core.step()
    core.abort("a", pause=True)
    core.step()
    rest = generate(CORES[kind](tiny), ids, params, generated_ids=tokens_of(first))
    assert tokens_of(first) + rest == alone


def test_the_penalties_change_a_seeded_draw_and_typical_p_narrows_it(tiny: LoadedModel) -> None:
    ids = ids_of(tiny, "The quick brown fox")
    plain = GenerationParams(max_new_tokens=60, temperature=0.9, seed=11, ignore_eos=True)
    looping = generate(EngineCore(tiny), ids, SEEDED)
    assert (
        most_repeated(looping) > 10 and most_repeated(generate(EngineCore(tiny), ids, plain)) == 1
    )
    typical = GenerationParams(**{**vars(TYPICAL), "typical_p": 1.0})
    assert generate(EngineCore(tiny), ids, TYPICAL) != generate(EngineCore(tiny), ids, typical)


def test_typical_p_removes_what_transformers_typical_warper_removes() -> None:
    gen = torch.Generator().manual_seed(3)
    scaled = torch.randn(6, 500, generator=gen) * 3
    mass = torch.tensor([0.2, 0.5, 0.9, 0.95, 1.0, 0.05])
    kept = torch.ones_like(scaled, dtype=torch.bool)
    ours = atypical(scaled, kept, mass)
    for row, p in enumerate(mass.tolist()):
        if p == 1.0:
            assert not ours[row].any()
            continue
        theirs = TypicalLogitsWarper(p)(None, scaled[row : row + 1].clone())
        assert torch.equal(ours[row], torch.isinf(theirs[0])), row


def test_typical_p_applies_after_temperature_and_top_k_and_never_to_greedy_rows() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 300, generator=gen) * 2
    rows = [
        RowSampling(GenerationParams(temperature=0.5, top_k=50, typical_p=0.3), 1, 0),
        RowSampling(GenerationParams(temperature=0.0, typical_p=0.3), 1, 0),
        RowSampling(GenerationParams(temperature=1.5), 1, 0),
    ]
    shaped = shape_logits(logits, tensors_for(rows, logits.device), None, None)
    scaled = logits[0:1] / 0.5
    top_k = scaled.masked_fill(scaled < scaled.topk(50).values[:, -1:], float("-inf"))
    expected = TypicalLogitsWarper(0.3)(None, top_k)
    assert torch.equal(torch.isinf(shaped[0]), torch.isinf(expected[0]))
    assert torch.equal(shaped[1:], logits[1:])  # greedy: unfiltered; no typical_p: untouched


def test_the_penalties_are_openais_and_count_only_the_generated_tokens() -> None:
    logits = torch.zeros(2, 8)
    rows = [
        RowSampling(GenerationParams(presence_penalty=0.5, frequency_penalty=0.25), 1, 3),
        RowSampling(GenerationParams(), 1, 0),
    ]
    counts = generated_counts([[2, 2, 5], [1]], 8, logits.device)
    shaped = shape_logits(logits, tensors_for(rows, logits.device), None, counts)
    assert shaped[0].tolist() == [0, 0, -1.0, 0, 0, -0.75, 0, 0]
    assert shaped[1].tolist() == [0.0] * 8  # its counts, with no penalty, change nothing


def test_every_path_draws_the_same_shaped_tokens() -> None:
    """The C++ race (CPU, no filters), the candidates' race (CPU) and the torch race."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 2000, generator=gen) * 3
    rows = [
        RowSampling(GenerationParams(temperature=0.8, frequency_penalty=1.0), 7, 3),
        RowSampling(GenerationParams(temperature=1.1, presence_penalty=-1.0, typical_p=0.6), 8, 3),
        RowSampling(GenerationParams(temperature=0.0, frequency_penalty=2.0), 9, 3),
        RowSampling(GenerationParams(temperature=0.7, top_p=0.8, top_k=30), 10, 1),
        RowSampling(GenerationParams(temperature=0.9), 11, 0),
    ]
    generated = [[int(t) for t in logits[i].topk(3).indices] for i in range(3)] + [[5], []]
    tokens = sample(logits.clone(), rows, generated=generated)
    counts = generated_counts(generated, 2000, logits.device)
    params = tensors_for(rows, logits.device)
    shaped = shape_logits(logits, params, None, counts)
    assert torch.equal(tokens, sample_tokens_torch(shaped, params, Variant.SAMPLE))
    # A greedy row's argmax moved off its penalized top token.
    assert int(tokens[2]) not in generated[2]
    for i, one in enumerate(rows):
        alone = sample(logits[i : i + 1].clone(), [one], generated=[generated[i]])
        assert int(alone) == int(tokens[i]), i


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2.0, 2.0]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in [-2.0, 2.0]"),
        ({"frequency_penalty": "1"}, "frequency_penalty must be a number"),
        ({"typical_p": 0}, "typical_p must be in (0.0, 1.0]"),
        ({"typical_p": 1.5}, "typical_p must be in (0.0, 1.0]"),
    ],
)
def test_out_of_range_values_are_refused(raw: dict[str, Any], error: str) -> None:
    with pytest.raises(ParamsError, match=error.replace("[", r"\[").replace("(", r"\(")):
        GenerationParams.parse(raw)


def test_the_new_params_are_left_out_of_a_turn_record_at_their_defaults() -> None:
    """An engine from before them reads every turn that does not use them."""
    assert not {"presence_penalty", "frequency_penalty", "typical_p"} & set(
        GenerationParams().to_dict()
    )
    params = GenerationParams.parse(
        {"presence_penalty": -1, "frequency_penalty": 2, "typical_p": 0.5}
    )
    assert GenerationParams.from_dict(params.to_dict()) == params


@pytest.mark.parametrize("params", [SEEDED, TYPICAL], ids=["penalties", "typical"])
def test_a_turn_resumed_on_its_kept_cache_draws_the_same(
    tiny: LoadedModel, params: GenerationParams
) -> None:
    """The resume skips most of the prefill (the session's kept KV cache): the counts
    are still the turn's, rebuilt from its token ids."""
    ids = ids_of(tiny, "The quick brown fox")
    alone = generate(EngineCore(tiny), ids, params)
    core = EngineCore(tiny)
    core.add(EngineRequest(request_id="a", prompt_ids=ids, params=params, cache_key="k"))
    first: list[RequestOutput] = []
    while len(tokens_of(first)) < 11:
        first += core.step()
    core.abort("a", pause=True)
    core.step()
    assert core.cached_length("k") > len(ids)
    again = EngineRequest(
        request_id="a", prompt_ids=ids, params=params, generated_ids=tokens_of(first), cache_key="k"
    )
    core.add(again)
    rest = run_all(core)["a"]
    assert tokens_of(first) + tokens_of(rest) == alone
    assert rest[-1].usage is not None and rest[-1].usage.cached_tokens > len(ids)
