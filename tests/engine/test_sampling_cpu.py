"""The CPU race over the tokens that can win (engine/sampling_cpu.py) draws exactly the
tokens of the full race (``sampling.sample_tokens_torch``)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.sampling_cases import SIZES, all_cases, random_params
from wsinfer.engine import native
from wsinfer.engine.sampler import sample_tokens
from wsinfer.engine.sampling import (
    SamplingTensors,
    Variant,
    race_noise,
    row_keys,
    sample_tokens_torch,
)
from wsinfer.engine.sampling_cpu import noise_low, sample_tokens_cpu


def assert_same_draws(
    logits: torch.Tensor,
    params: SamplingTensors,
    variant: Variant,
    seen: torch.Tensor | None = None,
) -> None:
    want = sample_tokens_torch(logits, params, variant, seen)
    assert torch.equal(sample_tokens_cpu(logits, params, variant, seen), want)


def test_every_sampling_case_draws_the_full_races_tokens() -> None:
    for case in all_cases(SIZES):
        assert_same_draws(case.logits, case.params, case.variant, case.seen)


def llm_like_logits(batch: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """A few likely tokens over a long, heavy tail, as a language model's logits are."""
    tail = torch.randn(batch, vocab, generator=gen) * 2.5
    head = torch.randint(0, vocab, (batch, 8), generator=gen)
    boost = 10 + 6 * torch.rand(batch, 8, generator=gen)
    return tail.scatter_add(1, head, boost)


def test_thousands_of_seeded_draws_match_at_every_temperature() -> None:
    gen = torch.Generator().manual_seed(3)
    for step in range(40):
        logits = llm_like_logits(32, 49152, gen)
        params = random_params(32, gen, filtered=step % 4 == 3)
        params.temperature[:] = torch.tensor([0.1, 0.5, 0.8, 1.0, 1.5, 2.0, 4.0, 0.0] * 4)
        seen = torch.rand(32, 49152, generator=gen) < 0.01
        variant = Variant.FILTERED if step % 4 == 3 else Variant.SAMPLE
        assert_same_draws(logits, params, variant, seen if step % 2 else None)


def far_outsider_row(vocab: int = 5000) -> tuple[torch.Tensor, SamplingTensors, int]:
    """A leader at 0, the rest at -40, and one token 16 below the leader whose hash is
    the largest there is (seed 21982, index 0, token 885: the least noise a draw can
    get). It wins the race: only a line at the noise's true bound keeps it in."""
    logits = torch.full((1, vocab), -40.0)
    logits[0, 7] = 0.0
    logits[0, 885] = -16.0
    one = torch.ones(1)
    params = SamplingTensors(one, torch.zeros(1, dtype=torch.long), one, one,
                             torch.tensor([21982]), torch.tensor([0]))  # fmt: skip
    return logits, params, 885


def test_a_token_far_below_the_leader_still_wins_when_its_noise_says_so() -> None:
    logits, params, outsider = far_outsider_row()
    noise = race_noise(row_keys(params.seed, params.index), logits.shape[1])
    assert float(noise[0, outsider]) < noise_low() + 0.02  # the least noise there is
    assert sample_tokens_torch(logits, params, Variant.SAMPLE).item() == outsider
    assert sample_tokens_cpu(logits, params, Variant.SAMPLE).item() == outsider


def test_cpu_logits_take_the_candidate_race() -> None:
    logits, params, outsider = far_outsider_row()
    logits[0, outsider] = -40.0  # now hopeless: the leader wins
    assert sample_tokens(logits, params, Variant.SAMPLE).item() == 7
    assert_same_draws(logits, params, Variant.SAMPLE)


def test_rows_without_a_finite_maximum_fall_back_to_the_full_race() -> None:
    logits = torch.randn(3, 1000)
    logits[1] = float("-inf")
    logits[2, 5] = float("inf")
    params = random_params(3, torch.Generator().manual_seed(1), filtered=False)
    params.temperature[:] = 1.0
    assert_same_draws(logits, params, Variant.SAMPLE)
    assert sample_tokens_cpu(logits, params, Variant.SAMPLE)[2].item() == 5


def test_a_penalty_of_one_everywhere_skips_its_pass_and_draws_the_same() -> None:
    """The CPU race skips the penalty pass when no row has one (x * 1 and x / 1 are
    x): the same tokens as the full race that applies it, negative logits included."""
    gen = torch.Generator().manual_seed(5)
    for step in range(8):
        logits = llm_like_logits(8, 4096, gen) - 5
        params = random_params(8, gen, filtered=step % 2 == 1)
        params.temperature[:] = torch.tensor([0.3, 0.7, 1.0, 1.3, 2.0, 0.9, 0.5, 0.0])
        params.penalty[:] = 1.0
        seen = torch.rand(8, 4096, generator=gen) < 0.2
        assert_same_draws(logits, params, Variant.FILTERED if step % 2 else Variant.SAMPLE, seen)


native_kernels = native.kernels()
needs_native = pytest.mark.skipif(native_kernels is None, reason="the native kernels did not build")


@needs_native
def test_the_native_race_draws_the_full_races_tokens_in_thousands_of_rows() -> None:
    """engine/native_sampling.cpp, which sample_tokens_cpu takes for rows without filters
    or penalties: greedy rows, temperatures from 0.05 to 8, banned (-inf) tokens."""
    gen = torch.Generator().manual_seed(11)
    assert native_kernels is not None
    for _ in range(4):
        logits = llm_like_logits(1024, 3000, gen)
        logits[::7, ::5] = float("-inf")
        params = random_params(1024, gen, filtered=False)
        params.temperature[1::3] = torch.tensor([0.05, 0.5, 1.0, 2.0, 8.0]).repeat(69)[:341]
        want = sample_tokens_torch(logits, params, Variant.SAMPLE)
        got = native_kernels.seeded_race(
            logits, params.temperature, params.seed, params.index, noise_low()
        )
        assert torch.equal(got, want)
        assert torch.equal(sample_tokens_cpu(logits, params, Variant.SAMPLE), want)


@needs_native
def test_the_native_race_hands_a_row_without_a_finite_maximum_back() -> None:
    assert native_kernels is not None
    params = random_params(2, torch.Generator().manual_seed(1), filtered=False)
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(2, 100)
        logits[1, 3] = bad
        args = (params.temperature, params.seed, params.index, noise_low())
        assert native_kernels.seeded_race(logits, *args) is None


@needs_native
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logits": torch.zeros(2, 10, dtype=torch.float64)}, "logits must be"),
        ({"logits": torch.zeros(2, 0)}, "empty vocabulary"),
        ({"temperature": torch.ones(3)}, "one float32 temperature a row"),
        ({"seed": torch.zeros(2)}, "one int64 seed and token index a row"),
    ],
)
def test_the_native_race_refuses_bad_input_with_a_clear_error(change, message) -> None:
    assert native_kernels is not None
    ids = torch.zeros(2, dtype=torch.long)
    args = {"logits": torch.zeros(2, 10), "temperature": torch.ones(2), "seed": ids, "index": ids}
    args |= change
    with pytest.raises(RuntimeError, match=message):
        native_kernels.seeded_race(*args.values(), noise_low())
