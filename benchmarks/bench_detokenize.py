"""Host time a generated token costs the engine to detokenize, by decoder.

    python benchmarks/bench_detokenize.py [--model PATH] [--tokens 4000] [--rounds 3]
        [--rows 16,64,256]

Every token an engine step hands out is detokenized on the step loop's thread
(``engine/detokenizer.py``), so at a large batch this is host time per row
that the next step waits for. Two tables, each decoder measured in the same run:

- the tokens of this repository's docs through each decoder, as one turn would
  get them, with and without stop strings: microseconds per token (best of
  ``--rounds``) and the byte decoder's speed-up over the window decoder;
- the engine (the tiny test model, so that the forward stays small; 32 tokens a
  row, a stop string each): host time of handing out a step's tokens (the
  core's ``_collect`` and ``_after_forward``: reading the draws, accepting,
  detokenizing, building the outputs) per step and per row, at each ``--rows``
  batch size.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

from wsinfer.engine.core import EngineConfig, EngineCore, build_core
from wsinfer.engine.detokenizer import ByteDetokenizer, IncrementalDetokenizer, TokenPieces
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.sessions.schema import GenerationParams

ROOT = Path(__file__).resolve().parent.parent
STOPS: dict[str, tuple[str, ...]] = {"none": (), "2 stop strings": ("</answer>", "\n\n\n")}


def per_token(make: Any, ids: list[int], rounds: int) -> float:
    """Best microseconds per token over ``rounds`` passes of a fresh detokenizer."""
    best = float("inf")
    for _ in range(rounds):
        detok = make()
        started = time.perf_counter()
        for token in ids:
            detok.add(token)
        detok.flush()
        best = min(best, time.perf_counter() - started)
    return best / len(ids) * 1e6


def hand_out_cost(loaded: LoadedModel, rows: int, byte_level: bool) -> tuple[float, float]:
    """(ms per step, us per row) the engine spends handing out a step's tokens."""
    core = build_core(loaded, EngineConfig(max_batch_size=rows))
    assert isinstance(core, EngineCore)
    if not byte_level:
        core.output.detokenizers.pieces = None  # every turn gets the window decoder
    spent = [0.0]

    def timed(method: Any) -> Any:
        def run(*args: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args)
            finally:
                spent[0] += time.perf_counter() - started

        return run

    core._collect = timed(core._collect)  # type: ignore[method-assign]
    core._after_forward = timed(core._after_forward)  # type: ignore[method-assign]
    ids = list(loaded.tokenizer.encode("Tell me a story about a dragon."))
    for row in range(rows):
        params = GenerationParams(
            max_new_tokens=32, temperature=0.7, seed=row, ignore_eos=True, stop=["</answer>"]
        )
        core.add(EngineRequest(f"r{row}", ids, params))
    steps = 0
    gc.collect()  # the cores measured before this one: their collection is not its cost
    while core.has_unfinished():
        core.step()
        steps += 1
    del core._collect, core._after_forward  # no cycle keeps this core (and its pool) alive
    return spent[0] / steps * 1e3, spent[0] / steps / rows * 1e6


def engine_table(rows: list[int]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.conftest import tiny_model_dir  # the tiny model, built once per machine

    loaded = load_model(str(tiny_model_dir()))
    print("\n| rows | window ms/step | us/row | bytes ms/step | us/row | speed-up |")
    print("|---|---|---|---|---|---|")
    for n in rows:
        window, window_row = hand_out_cost(loaded, n, byte_level=False)
        byte, byte_row = hand_out_cost(loaded, n, byte_level=True)
        print(
            f"| {n} | {window:.2f} | {window_row:.1f} | {byte:.2f} | {byte_row:.1f} "
            f"| {window / byte:.1f}x |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="16,64,256", help="engine batch sizes")
    args = parser.parse_args(argv)
    tokenizer = load_model(args.model).tokenizer
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = list(tokenizer.encode(text, add_special_tokens=False))[: args.tokens]
    pieces = TokenPieces(tokenizer)
    print(f"{len(ids)} tokens, best of {args.rounds}\n")
    print("| stop strings | window decoder us/token | byte decoder us/token | speed-up |")
    print("|---|---|---|---|")
    for name, stop in STOPS.items():
        window = per_token(
            lambda s=stop: IncrementalDetokenizer(tokenizer, ids[:5], s), ids, args.rounds
        )
        byte = per_token(lambda s=stop: ByteDetokenizer(pieces, s), ids, args.rounds)
        print(f"| {name} | {window:.1f} | {byte:.2f} | {window / byte:.1f}x |")
    engine_table([int(n) for n in args.rows.split(",")])


if __name__ == "__main__":
    main()
