"""``wsinfer prepare``: at install time, what a first start would otherwise do.

It builds the C++ CPU kernels (``engine/native_build.py``: by default every
variant this CPU runs, best first; ``--best`` only the one a start here loads;
``--all`` every variant of this architecture, for an image that runs on other
machines) and converts the model's GGUF file to transformers weights (the bundled
default unless ``--model`` names another). Both land in the wsinfer cache
(``WSINFER_CACHE_DIR``, else ``~/.cache/wsinfer``), where a start finds them;
running it again does nothing that is done. Nothing heavy is imported to parse
its flags.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import structlog

log = structlog.get_logger("wsinfer.prepare")

HELP = "build the CPU kernels and convert the model at install time"
DESCRIPTION = (
    "Do at install time what a first start would: build the C++ CPU kernels (by default "
    "every variant this CPU runs, best first) and convert the model's GGUF file, into the "
    "wsinfer cache (WSINFER_CACHE_DIR, else ~/.cache/wsinfer). deploy/setup.sh and the "
    "CPU image run it; running it again does only what is missing."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--all",
        dest="kernels",
        action="store_const",
        const="all",
        help="every kernel variant of this architecture (for an image other machines run)",
    )
    which.add_argument(
        "--best",
        dest="kernels",
        action="store_const",
        const="best",
        help="only the variant a start on this CPU loads",
    )
    which.add_argument(
        "--no-kernels", dest="kernels", action="store_const", const="none", help="build none"
    )
    parser.add_argument(
        "--model",
        default=os.environ.get("WSINFER_MODEL"),
        help="the engine's --model, converted if it is a .gguf file (default: the bundled "
        "SmolLM2-135M-Instruct); other kinds of model need no conversion",
    )
    parser.add_argument("--no-model", action="store_true", help="convert no model")


def run(args: argparse.Namespace) -> int:
    """Each step, even after another failed; the exit status says whether all did."""
    from wsinfer.engine.model import ModelLoadError, default_cache_dir
    from wsinfer.engine.native_build import BuildError

    cache = default_cache_dir()
    status = 0
    if args.kernels != "none":  # None: no switch given, every variant this CPU runs
        try:
            build_kernels(cache, args.kernels or "cpu")
        except BuildError as exc:  # one line to act on, no traceback
            log.error(f"the native CPU kernels did not build: {exc}")
            status = 1
    if not args.no_model:
        try:
            convert_model(cache, args.model)
        except ModelLoadError as exc:
            log.error(str(exc))
            status = 1
    return status


def build_kernels(cache: Path, which: str) -> None:
    """Each variant ``which`` names, built unless it is (a failure is the exit status:
    an install that cannot build should say so, not leave it to the first start)."""
    from wsinfer.engine import native_build

    for variant in native_build.to_build(which):
        started = time.monotonic()
        path = native_build.build(cache, variant)
        log.info(
            f"native CPU kernels ready: {variant.name}",
            library=str(path),
            seconds=round(time.monotonic() - started, 1),
        )


def convert_model(cache: Path, spec: str | None) -> None:
    from wsinfer.engine.model import converted_gguf_dir
    from wsinfer.engine.resolve import resolve_spec
    from wsinfer.logs import route_library_logs

    route_library_logs()
    if spec is not None and spec.startswith("fake:"):
        log.info("nothing to convert: a fake model", model=spec)
        return
    source = resolve_spec(spec)
    if not source.gguf:
        log.info("nothing to convert: the model is not a GGUF file", model=source.name)
        return
    directory = converted_gguf_dir(source.path, cache)
    log.info(f"model ready: {source.name}", directory=str(directory))
