"""What structured output costs per token: the engine with and without a response_format.

    python benchmarks/bench_structured.py [--model DIR|tiny] [--threads 2] [--rounds 3]
        [--tokens 64]

For 1 and 8 streams, the decode tokens/s of seeded sampled turns on the default
engine (the quantized CPU format for a GGUF), free text against turns held to a
JSON schema (an object holding a list of at least 200 strings, so no turn closes
its document within ``--tokens``), best of ``--rounds`` with the two interleaved
in one process; and the host time the grammar takes per constrained row and step
(llguidance computing the allowed tokens, measured around ``Grammars.bitmask``),
against the step time.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from wsinfer.engine.core import EngineConfig, EngineCore
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.response_format import canonical
from wsinfer.sessions.schema import GenerationParams

SCHEMA = {
    "type": "object",
    "properties": {"story": {"type": "array", "items": {"type": "string"}, "minItems": 200}},
    "required": ["story"],
}
FORMAT = canonical({"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}})


class MaskClock:
    """Wraps a core's ``grammars.bitmask``: seconds spent, constrained rows served."""

    def __init__(self, core: EngineCore) -> None:
        self.seconds, self.rows = 0.0, 0
        inner = core.grammars.bitmask

        def timed(constraints: Any) -> Any:
            started = time.perf_counter()
            out = inner(constraints)
            self.seconds += time.perf_counter() - started
            self.rows += sum(c is not None for c in constraints)
            return out

        core.grammars.bitmask = timed  # type: ignore[method-assign]


def decode_speed(
    core: EngineCore, loaded: LoadedModel, streams: int, tokens: int, fmt: str | None
) -> tuple[float, float]:
    """(decode tokens/s, seconds per step) of ``streams`` seeded turns after their prefill."""
    ids = list(loaded.tokenizer.encode("Tell me a story about a dragon, as JSON."))
    params = GenerationParams(
        max_new_tokens=tokens + 1, temperature=0.7, ignore_eos=True, response_format=fmt
    )
    for row in range(streams):
        core.add(EngineRequest(f"s{time.monotonic_ns()}-{row}", ids,
                               dataclasses.replace(params, seed=row)))  # fmt: skip
    core.step()  # the prefill
    started, steps, generated = time.perf_counter(), 0, 0
    while core.has_unfinished():
        generated += sum(len(out.new_token_ids) for out in core.step())
        steps += 1
    seconds = time.perf_counter() - started
    return generated / seconds, seconds / max(1, steps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a model dir, or 'tiny' (tests)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", default="1,8")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model
    if model == "tiny":
        from tests.models import tiny_model_dir

        model = str(tiny_model_dir())
    loaded = load_model(model)
    core = EngineCore(loaded, EngineConfig(max_batch_size=8))
    clock = MaskClock(core)
    print(f"model {loaded.name}, {args.threads} threads, {args.tokens} tokens a turn, "
          f"best of {args.rounds}")  # fmt: skip
    print("| streams | free tok/s | JSON schema tok/s | ratio | step (free) | mask per row |")
    print("|---|---|---|---|---|---|")
    for streams in (int(s) for s in args.streams.split(",")):
        best: dict[str | None, tuple[float, float]] = {None: (0.0, 0.0), FORMAT: (0.0, 0.0)}
        clock.seconds, clock.rows = 0.0, 0
        for _ in range(args.rounds):
            for fmt in (None, FORMAT):
                speed, step = decode_speed(core, loaded, streams, args.tokens, fmt)
                if speed > best[fmt][0]:
                    best[fmt] = (speed, step)
        free, held = best[None], best[FORMAT]
        mask_us = clock.seconds / max(1, clock.rows) * 1e6
        print(
            f"| {streams} | {free[0]:.1f} | {held[0]:.1f} | {held[0] / free[0]:.2f}x "
            f"| {free[1] * 1000:.1f} ms | {mask_us:.0f} µs |"
        )


if __name__ == "__main__":
    main()
