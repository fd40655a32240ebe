from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from wsinfer.engine.sampler import sample
from wsinfer.engine.sampling import RowSampling, fresh_seed, mix_seed
from wsinfer.sessions.schema import GenerationParams

VOCAB = 1000
ROOT = Path(__file__).resolve().parents[2]


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=gen) * 3


def row(seed: int, index: int, **params: object) -> RowSampling:
    return RowSampling(GenerationParams(**params), seed, index)  # type: ignore[arg-type]


def test_greedy_is_argmax() -> None:
    x = logits(4)
    out = sample(x, [row(0, i, temperature=0.0) for i in range(4)])
    assert out.tolist() == x.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    x = logits(3)
    rows = [row(1, 0, temperature=0.0), row(2, 0, temperature=1.5), row(3, 0, temperature=0.0)]
    out = sample(x, rows).tolist()
    assert out[0] == x[0].argmax().item() and out[2] == x[2].argmax().item()


def test_seeded_draws_are_reproducible_per_token_index() -> None:
    x = logits(1, seed=5)
    a = [sample(x, [row(42, i, temperature=1.0)]).item() for i in range(20)]
    b = [sample(x, [row(42, i, temperature=1.0)]).item() for i in range(20)]
    assert a == b
    assert len(set(a)) > 5  # different indices draw differently


def test_draw_does_not_depend_on_batch_neighbours() -> None:
    # What a rebuild after a pause relies on: token i of a seeded request is the
    # same whether it is drawn alone, in a batch, or after a restart.
    x = logits(4, seed=9)
    rows = [row(7, 3, temperature=0.9, top_p=0.9), row(8, 0), row(9, 1, top_k=5), row(7, 3)]
    together = sample(x, rows).tolist()
    alone = [sample(x[i : i + 1], [rows[i]]).item() for i in range(4)]
    assert together == alone


def test_rebuild_mid_turn_continues_the_same_sequence() -> None:
    x = logits(30, seed=3)
    params = dict(temperature=1.2, top_k=50, top_p=0.95)
    straight = [sample(x[i : i + 1], [row(11, i, **params)]).item() for i in range(30)]
    first = [sample(x[i : i + 1], [row(11, i, **params)]).item() for i in range(12)]
    rebuilt = [sample(x[i : i + 1], [row(11, i, **params)]).item() for i in range(12, 30)]
    assert first + rebuilt == straight


def test_unseeded_requests_get_fresh_randomness() -> None:
    x = torch.zeros(1, VOCAB)
    draws = {sample(x, [row(fresh_seed(), 0, temperature=1.0)]).item() for _ in range(20)}
    assert len(draws) > 10


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    x = logits(6, seed=2)
    rows = [row(i, 0, temperature=2.0, top_k=1) for i in range(3)]
    rows += [row(i, 0, temperature=2.0, top_p=1e-6) for i in range(3)]
    assert sample(x, rows).tolist() == x.argmax(-1).tolist()


def test_top_k_limits_the_support() -> None:
    x = logits(1, seed=4)
    allowed = set(x[0].topk(5).indices.tolist())
    drawn = {sample(x, [row(1, i, temperature=3.0, top_k=5)]).item() for i in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_temperature_sampling_follows_the_distribution() -> None:
    x = torch.full((1, VOCAB), -math.inf)
    x[0, 0], x[0, 1] = 0.0, math.log(3.0)
    hits = sum(sample(x, [row(123, i, temperature=1.0)]).item() == 1 for i in range(2000))
    assert 0.70 < hits / 2000 < 0.80


def test_repetition_penalty_discourages_seen_tokens() -> None:
    x = torch.zeros(1, VOCAB)
    x[0, 10], x[0, 20] = 2.0, 1.9
    seen = torch.zeros(1, VOCAB, dtype=torch.bool)
    seen[0, 10] = True
    assert sample(x, [row(0, 0, temperature=0.0)], seen).item() == 10
    penalized = [row(0, 0, temperature=0.0, repetition_penalty=1.3)]
    assert sample(x, penalized, seen).item() == 20


def test_mix_seed_spreads_neighbours() -> None:
    values = {mix_seed(s, i) for s in range(10) for i in range(10)}
    assert len(values) == 100
    assert all(0 <= v < 2**63 for v in values)


def test_device_keys_are_the_host_hash() -> None:
    from wsinfer.engine.sampling import row_keys

    seeds = [42, 2**62 + 7, 5, fresh_seed()]
    index = [0, 3, 1000, 7]
    got = row_keys(torch.tensor(seeds), torch.tensor(index)).tolist()
    assert got == [mix_seed(s, i) for s, i in zip(seeds, index, strict=True)]


def test_a_draw_survives_last_bit_changes_of_the_logits() -> None:
    # A rebuilt turn recomputes its context in a prefill: its logits differ from the
    # decode's in the last bits. The exponential race must not care (inverse-CDF did).
    # (Inverse-CDF sampling flips 3 of these 512 draws: the float32 cumulative sum moves.)
    x = torch.randn(512, 49152, generator=torch.Generator().manual_seed(1)) * 3
    nudged = x * (1 + 1e-6 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2)))
    rows = [row(99, i, temperature=0.8) for i in range(512)]
    assert sample(x, rows).tolist() == sample(nudged, rows).tolist()


def test_top_k_races_every_token_tied_at_the_edge_of_the_set() -> None:
    # The set is "scaled logit >= the k-th largest", so it does not depend on how a
    # sort orders ties: with top_k=1 and two tied maxima, both win sometimes.
    x = torch.full((1, VOCAB), -5.0)
    x[0, 7] = x[0, 700] = 4.0
    drawn = {sample(x, [row(5, i, temperature=1.0, top_k=1)]).item() for i in range(100)}
    assert drawn == {7, 700}


def test_filtered_rows_race_only_their_set() -> None:
    x = logits(2, seed=6)
    scaled = x / 0.7
    top_p_set = set(scaled[1].argsort(descending=True)[:3].tolist())
    probs = scaled[1].softmax(-1).sort(descending=True).values
    top_p = (probs[:2].sum().item() + probs[:3].sum().item()) / 2  # covered by the top 3
    rows = [[row(3, i, temperature=0.7, top_k=4), row(4, i, temperature=0.7, top_p=top_p)]
            for i in range(300)]  # fmt: skip
    draws = [sample(x, r).tolist() for r in rows]
    assert {d[0] for d in draws} == set(x[0].topk(4).indices.tolist())
    assert {d[1] for d in draws} == top_p_set


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (the test extra installs it on linux x86_64 only)",
)
@pytest.mark.slow  # the Triton interpreter: ~25 s
def test_triton_race_draws_the_torch_tokens_under_the_interpreter() -> None:
    """engine/sampling_triton.py run by Triton's CPU interpreter against the torch path:
    B 1, 3, 64 x V 1000, 49152, SAMPLE and FILTERED, greedy rows, penalties, ties,
    -inf rows, strided and bf16 / fp16 logits (tests/engine/sampling_cases.py)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.engine.sampling_cases"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("ok:")


def test_the_largest_hash_is_not_a_certain_win() -> None:
    # Seed 21982's token 885 hashes to the top 24-bit value: a float32 (h + 0.5) / 2**24
    # rounds that to u = 1, noise -log u = 0, and log-space score +inf: a token with
    # almost no probability would win. u must stay below 1 for every hash.
    x = torch.zeros(1, VOCAB)
    x[0, 885] = -30.0
    assert sample(x, [row(21982, 0, temperature=1.0)]).item() != 885


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_warm_up_builds_every_form_of_the_race_a_prefill_can_use() -> None:
    """Every batch of 1..256 finishing prefill rows runs a race form (slices, slice
    length) that the start-up warm-up has run, in far fewer than 256 runs."""
    from wsinfer.engine.sampling_triton import choose_splits, warm_up_batches

    for vocab, sms in ((49152, 132), (128256, 132), (49152, 16)):
        sizes = warm_up_batches(256, vocab, sms)
        warmed = {choose_splits(rows, vocab, sms) for rows in sizes}
        assert {choose_splits(rows, vocab, sms) for rows in range(1, 257)} == warmed
        assert sizes[0] == 1 and len(sizes) < 64


def test_the_sampling_warm_up_is_a_no_op_off_cuda() -> None:
    from tests.models import tiny_model_dir
    from wsinfer.engine.core import EngineCore
    from wsinfer.engine.model import load_model

    core = EngineCore(load_model(str(tiny_model_dir())))
    assert core.runner.warm_sampling() == 0


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}],
    ids=["greedy", "sample", "filtered"],
)
def test_min_tokens_bans_the_end_tokens_and_leaves_every_other_draw_alone(
    params: dict[str, object],
) -> None:
    """Rows still under their min_tokens never draw an end token, however it leads;
    rows past it, and every row's draw among the other tokens, are as without it."""
    ends = torch.tensor([3, 7])
    scores = logits(6, seed=5)
    scores[:, 3] += 50.0  # the end token leads every row by far
    rows = [row(100 + r, r, min_tokens=4, **params) for r in range(6)]  # index r: 0..5
    got = sample(scores.clone(), rows, ends=ends)
    free = sample(scores.clone(), rows)  # the same rows, nothing banned
    without_ends = scores.clone()
    without_ends[:, [3, 7]] = float("-inf")
    alone = sample(without_ends, rows)
    for r in range(6):
        if r < 4:  # still under min_tokens
            assert int(got[r]) not in (3, 7) and int(got[r]) == int(alone[r])
        else:
            assert int(got[r]) == int(free[r]) == 3
