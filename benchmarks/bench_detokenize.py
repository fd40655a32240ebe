"""Host time a generated token costs the engine to detokenize, by decoder.

    python benchmarks/bench_detokenize.py [--model PATH] [--tokens 4000] [--rounds 3]

Every token an engine step hands out is detokenized on the step loop's thread
(``engine/detokenizer.py``), so at a large batch this is host time per row
that the next step waits for. Feeds the tokens of this repository's docs
through each decoder, as one turn would get them, with and without stop
strings, and prints microseconds per token (best of ``--rounds``) and the
byte decoder's speed-up over the window decoder measured in the same run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from wsinfer.engine.detokenizer import ByteDetokenizer, IncrementalDetokenizer, TokenPieces
from wsinfer.engine.model import load_model

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir or .gguf (default: SmolLM2)")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
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


if __name__ == "__main__":
    main()
