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
import threading
import time
from collections.abc import Callable
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
    """Both steps at once: the kernels' compilers keep the cores busy while the model
    converts (mostly one core of Python), ~10 s less than one after the other on two
    cores. Each step runs even if the other fails; the exit status says whether both
    did."""
    from wsinfer.engine.model import default_cache_dir

    cache = default_cache_dir()
    kernels = None
    if args.kernels != "none":  # None: no switch given, every variant this CPU runs
        kernels = Background(lambda: build_kernels(cache, args.kernels or "cpu"))
    status = 0 if args.no_model else convert_model(cache, args.model)
    return max(status, kernels.wait() if kernels else 0)


class Background:
    """A step on a thread of its own (a daemon: Ctrl-C does not wait for it; its
    compilers, in the same process group, get the same SIGINT)."""

    def __init__(self, step: Callable[[], int]) -> None:
        self.status = 1  # until the step returns
        self._thread = threading.Thread(target=self._run, args=(step,), daemon=True)
        self._thread.start()

    def _run(self, step: Callable[[], int]) -> None:
        self.status = step()

    def wait(self) -> int:
        self._thread.join()
        return self.status


def build_kernels(cache: Path, which: str) -> int:
    """Each variant ``which`` names, built unless it is (a failure is the exit status:
    an install that cannot build should say so, not leave it to the first start)."""
    from wsinfer.engine import native_build

    try:
        for variant in native_build.to_build(which):
            started = time.monotonic()
            path = native_build.build(cache, variant)
            log.info(
                f"native CPU kernels ready: {variant.name}",
                library=str(path),
                seconds=round(time.monotonic() - started, 1),
            )
    except native_build.BuildError as exc:  # one line to act on, no traceback
        log.error(f"the native CPU kernels did not build: {exc}")
        return 1
    return 0


def convert_model(cache: Path, spec: str | None) -> int:
    from wsinfer.engine.model import ModelLoadError, converted_gguf_dir
    from wsinfer.engine.resolve import resolve_spec
    from wsinfer.logs import route_library_logs

    route_library_logs()
    if spec is not None and spec.startswith("fake:"):
        log.info("nothing to convert: a fake model", model=spec)
        return 0
    try:
        source = resolve_spec(spec)
        if not source.gguf:
            log.info("nothing to convert: the model is not a GGUF file", model=source.name)
            return 0
        directory = converted_gguf_dir(source.path, cache)
    except ModelLoadError as exc:
        log.error(str(exc))
        return 1
    log.info(f"model ready: {source.name}", directory=str(directory))
    return 0
