"""The CPU weight formats side by side: speed, agreement with float32, and whether
the seeded draws stay the same across batch sizes and a takeover.

    python benchmarks/bench_weight_formats.py [--model PATH] [--tokens 48] [--threads 1]

One row per format the engine offers on the CPU: ``float32`` (the GGUF
de-quantized at load, the default) and ``quantized`` (``--quantized-cpu-weights``:
the Q4_1 layers as int4, the output layer as int8). Columns:

- tok/s at 1 and 8 streams (sampled decode steps, the same prompt in every row);
- mean KL divergence of the next-token distribution from float32's, and how often
  the most likely token is the same, over every position of a few texts;
- "batch-invariant": of 8 seeded turns run together, how many drew exactly the
  tokens each drew alone;
- "takeover-invariant": of those turns rebuilt from their token log after 8 and
  after 24 tokens (as an engine taking over a dead one's turn does), how many went
  on with exactly the tokens of the uninterrupted turn. The design promises "same
  tokens out either way"; this counts where a format keeps it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch
import torch.nn.functional as F

from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.llama import FastLlama
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.engine.prompts import render_chat
from wsinfer.engine.sampling import GenerationParams

FORMATS = {"float32": False, "quantized": True}
QUESTIONS = [
    "What is the capital of France?",
    "Write a poem about the sea.",
    "Explain recursion.",
    "List three fruits.",
    "Tell me a joke.",
    "How do airplanes fly?",
    "What is 17 times 3?",
    "Describe a cat.",
]
TEXTS = [
    "The history of the Roman Empire spans more than a thousand years. It began when "
    "Augustus became the first emperor in 27 BC, and the western half fell in 476 AD. "
    "Roman law, roads and the Latin language spread across Europe and North Africa.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nfor i in range(10):\n    print(fibonacci(i))\n",
    "Photosynthesis is the process by which green plants use sunlight to make food from "
    "carbon dioxide and water. It takes place mainly in the leaves and gives off oxygen.",
]
CUTS = (8, 24)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    """Every request's new tokens, stepping ``core`` until it is idle."""
    for request in requests:
        core.add(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def speed(core: EngineCore, loaded: LoadedModel, streams: int, tokens: int) -> float:
    """Decode tokens/s of ``streams`` sampled turns (after their prefill)."""
    ids = list(loaded.tokenizer.encode("Tell me a story about a dragon."))
    params = GenerationParams(max_new_tokens=tokens + 1, temperature=0.7, ignore_eos=True)
    for row in range(streams):
        seeded = dataclasses.replace(params, seed=row)
        core.add(EngineRequest(request_id=f"s{time.monotonic_ns()}-{row}", prompt_ids=ids,
                               params=seeded))  # fmt: skip
    core.step()  # the prefill
    started, steps = time.perf_counter(), 0
    while core.has_unfinished():
        core.step()
        steps += 1
    return streams * steps / (time.perf_counter() - started)


def causal_logits(model: FastLlama, ids: list[int]) -> torch.Tensor:
    """Logits at every position of ``ids``, one forward with plain causal attention."""

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = model.num_heads // model.num_kv_heads
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=model.scale)
        return out[0].transpose(0, 1)

    tokens = torch.tensor(ids)
    with torch.inference_mode():
        return model.logits(model.forward(tokens, torch.arange(len(ids)), attention)).float()


def agreement(model: FastLlama, reference: FastLlama, loaded: LoadedModel) -> tuple[float, float]:
    """(mean KL(reference || model) in nats, share of positions with the same top token)."""
    kl, same, positions = 0.0, 0, 0
    for text in TEXTS:
        ids = list(loaded.tokenizer.encode(text))
        ref = F.log_softmax(causal_logits(reference, ids), -1)
        got = F.log_softmax(causal_logits(model, ids), -1)
        kl += float((ref.exp() * (ref - got)).sum())
        same += int((ref.argmax(-1) == got.argmax(-1)).sum())
        positions += len(ids)
    return kl / positions, same / positions


def invariance(loaded: LoadedModel, config: EngineConfig, tokens: int) -> tuple[int, int, int]:
    """(turns batch-invariant, takeovers that went on unchanged, takeovers tried)."""
    no_eos = dataclasses.replace(loaded, eos_token_ids=set())
    params = GenerationParams(max_new_tokens=tokens, temperature=0.8, seed=1)
    prompts = [render_chat(loaded.tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    requests = [EngineRequest(request_id=f"r{i}", prompt_ids=p, params=params)
                for i, p in enumerate(prompts)]  # fmt: skip
    together = run(EngineCore(no_eos, config), requests)
    same_alone = same_after = tried = 0
    for request in requests:
        expected = together[request.request_id]
        alone = run(EngineCore(no_eos, config), [request])[request.request_id]
        same_alone += alone == expected
        for cut in CUTS:
            rebuilt = dataclasses.replace(request, generated_ids=expected[:cut])
            after = run(EngineCore(no_eos, config), [rebuilt])[request.request_id]
            same_after += after == expected[cut:]
            tried += 1
    return same_alone, same_after, tried


def weight_formats_table(loaded: LoadedModel, tokens: int, formats: dict[str, bool]) -> str:
    lines = [
        "| weights | tok/s, 1 stream | tok/s, 8 streams | x float32 (1 / 8) | mean KL vs "
        "float32 | same top token | batch-invariant | takeover-invariant |",
        "|---|---|---|---|---|---|---|---|",
    ]
    float32 = EngineConfig(max_batch_size=8, quantized_cpu_weights=False)
    reference = EngineCore(loaded, float32).model
    base: tuple[float, float] | None = None
    for name, quantized in formats.items():
        config = EngineConfig(max_batch_size=8, quantized_cpu_weights=quantized)
        core = EngineCore(loaded, config)
        speed(core, loaded, 1, 4)  # warm-up
        one, eight = speed(core, loaded, 1, tokens), speed(core, loaded, 8, tokens)
        base = base or (one, eight)
        kl, top = agreement(core.model, reference, loaded)
        alone, after, tried = invariance(loaded, config, tokens)
        lines.append(
            f"| {name} | {one:.1f} | {eight:.1f} | {one / base[0]:.2f}x / "
            f"{eight / base[1]:.2f}x | {kl:.5f} | {top:.1%} | {alone}/{len(QUESTIONS)} | "
            f"{after}/{tried} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=48, help="new tokens per turn")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    loaded: Any = load_model(args.model)
    print(f"{loaded.name}, {torch.get_num_threads()} threads, {args.tokens} tokens per turn\n")
    print(weight_formats_table(loaded, args.tokens, FORMATS))


if __name__ == "__main__":
    main()
