"""Cases for the Triton race (engine/sampling_triton.py) against the torch path.

``python -m tests.engine.sampling_cases`` with TRITON_INTERPRET=1 runs the kernels on
the CPU (tests/engine/test_sampling.py does) and prints ``ok: N cases`` when every
token matches; on a CUDA machine it runs them on the GPU against the torch path there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from wsinfer.engine.sampling import (
    SamplingTensors,
    Variant,
    sample_tokens_torch,
    sample_tokens_triton,
)
from wsinfer.engine.sampling_triton import race_triton


@dataclass
class Case:
    name: str
    logits: torch.Tensor
    params: SamplingTensors
    variant: Variant
    seen: torch.Tensor | None
    splits: int | None = None  # slices per row for the kernel (None: its own choice)


def random_params(batch: int, gen: torch.Generator, filtered: bool) -> SamplingTensors:
    """Every third row greedy; seeds over the whole int64 range (high bit set too)."""
    rows = torch.arange(batch)
    temperature = 0.3 + 1.5 * torch.rand(batch, generator=gen)
    temperature = torch.where(rows % 3 == 0, 0.0, temperature)
    top_k = torch.where(rows % 2 == 0, 40, 0) if filtered else torch.zeros(batch, dtype=torch.long)
    top_p = torch.where(rows % 4 == 1, 0.9, 1.0) if filtered else torch.ones(batch)
    penalty = torch.where(rows % 5 == 2, 1.0, 1.0 + 0.4 * torch.rand(batch, generator=gen))
    seed = torch.randint(-(2**63), 2**63 - 1, (batch,), generator=gen)
    index = torch.randint(0, 5000, (batch,), generator=gen)
    return SamplingTensors(temperature, top_k, top_p, penalty, seed, index)


def random_case(batch: int, vocab: int, variant: Variant, seed: int, dtype: torch.dtype) -> Case:
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(dtype)
    seen = torch.rand(batch, vocab, generator=gen) < 0.02
    params = random_params(batch, gen, variant is Variant.FILTERED)
    name = f"B={batch} V={vocab} {variant.name} {dtype}"
    return Case(name, logits, params, variant, seen)


def edge_cases() -> list[Case]:
    """Ties, -inf, a strided batch, and no penalty state."""
    gen = torch.Generator().manual_seed(7)
    vocab = 5000
    logits = torch.randn(6, vocab, generator=gen)
    logits[0] = float("-inf")  # nothing finite: token 0, like torch.argmax
    logits[1, 10] = logits[1, 4000] = 50.0  # a greedy tie across slices: the lower id
    logits[2] = float("-inf")
    logits[2, 3], logits[2, 4999] = 0.0, 1.0986  # two candidates (the distribution test)
    logits[3] = 0.0  # all equal: the noise alone decides
    logits[3, 885] = -30.0  # the largest hash (seed 21982, index 0): must not win
    params = random_params(6, gen, filtered=False)
    params.temperature[:] = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.05, 8.0])
    params.seed[3], params.index[3] = 21982, 0
    wide = torch.randn(6, vocab + 300, generator=gen)[:, :vocab]  # row stride != vocab
    cases = [Case("edges", logits, params, Variant.SAMPLE, None)]
    cases.append(Case("strided", wide, params, Variant.SAMPLE, None))
    filtered = random_params(6, gen, filtered=True)
    filtered.top_k[:] = torch.tensor([1, 0, 2, 5000, 40, 0])
    filtered.top_p[:] = torch.tensor([1.0, 1e-6, 1.0, 0.5, 0.99, 1.0])
    cases.append(Case("filtered edges", logits, filtered, Variant.FILTERED, None))
    return cases + [lane_ties(gen)]


def lane_ties(gen: torch.Generator) -> Case:
    """Greedy rows whose maximum repeats 1024 tokens later: the same lane of the same
    slice (one slice per row here), so the earlier token must stay."""
    batch, vocab = 16, 4096
    logits = torch.randn(batch, vocab, generator=gen)
    first = torch.randint(0, vocab - 1024, (batch,), generator=gen)
    logits[torch.arange(batch), first] = logits[torch.arange(batch), first + 1024] = 9.0
    params = random_params(batch, gen, filtered=False)
    params.temperature[: batch // 2] = 0.0
    return Case("lane ties", logits, params, Variant.SAMPLE, None, splits=1)


def all_cases(sizes: list[tuple[int, int]]) -> list[Case]:
    cases = []
    for i, (batch, vocab) in enumerate(sizes):
        for variant in (Variant.SAMPLE, Variant.FILTERED):
            cases.append(random_case(batch, vocab, variant, seed=i, dtype=torch.float32))
    cases.append(random_case(3, 1000, Variant.SAMPLE, seed=99, dtype=torch.bfloat16))
    cases.append(random_case(3, 1000, Variant.FILTERED, seed=98, dtype=torch.float16))
    return cases + edge_cases()


SIZES = [(1, 1000), (3, 1000), (64, 1000), (1, 49152), (3, 49152), (64, 49152)]


def check(cases: list[Case], device: str = "cpu") -> list[str]:
    """Each case's tokens from the Triton race and from the torch path, compared."""
    problems = []
    for case in cases:
        params = case.params.to(device)
        logits = case.logits.to(device)
        seen = None if case.seen is None else case.seen.to(device)
        want = sample_tokens_torch(logits, params, case.variant, seen).cpu()
        got = triton_tokens(case, logits, params, seen).cpu()
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten().tolist()
            drew, torch_drew = got[bad].tolist(), want[bad].tolist()
            problems.append(f"{case.name}: rows {bad} drew {drew}, torch {torch_drew}")
    return problems


def triton_tokens(
    case: Case, logits: torch.Tensor, params: SamplingTensors, seen: torch.Tensor | None
) -> torch.Tensor:
    if case.splits is None:
        return sample_tokens_triton(logits, params, case.variant, seen)
    assert case.variant is Variant.SAMPLE
    p = params
    return race_triton(logits, p.temperature, p.penalty, p.seed, p.index, seen, None,
                       num_splits=case.splits)  # fmt: skip


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = all_cases(SIZES)
    problems = check(cases, device)
    print("\n".join(problems) or f"ok: {len(cases)} cases")
    sys.exit(1 if problems else 0)
