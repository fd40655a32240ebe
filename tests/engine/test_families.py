"""The fast core's families (engine/families.py), each checked token for token against
transformers' own greedy decoding of a tiny random-weight model of that architecture,
built from a config; what it does not cover goes to the eager core, with the reason
logged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from wsinfer.engine.attention import prefill_softcapped_attention
from wsinfer.engine.core import EngineConfig, EngineCore, build_core
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.families import UnsupportedModel, family_of
from wsinfer.engine.lifecycle import EngineRequest
from wsinfer.engine.llama import FastLlama, fast_model_for
from wsinfer.engine.model import LoadedModel, load_model
from wsinfer.engine.sampling import GenerationParams

from .conftest import tokens_of

COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # Wide weights keep logits apart: greedy choices do not flip on rounding.
    "initializer_range": 0.3,
    "tie_word_embeddings": False,
}

CONFIGS: dict[str, Callable[[int], Any]] = {
    "mistral": lambda vocab: MistralConfig(vocab_size=vocab, sliding_window=None, **COMMON),
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, **COMMON),
    "qwen3": lambda vocab: Qwen3Config(vocab_size=vocab, head_dim=16, **COMMON),
    "olmo2": lambda vocab: Olmo2Config(vocab_size=vocab, **COMMON),
    "phi3": lambda vocab: Phi3Config(vocab_size=vocab, pad_token_id=0, **COMMON),
    # Gemma: an attention scale (query_pre_attn_scalar) that is not the head size, and
    # a window wider than the tests' contexts (the engine caps the context to it).
    # Soft caps small enough to matter (the defaults, 50 and 30, barely touch a tiny
    # model's scores, and a cap on the logits never changes a greedy choice).
    "gemma2": lambda vocab: Gemma2Config(
        vocab_size=vocab,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=512,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=4.0,
        **COMMON,
    ),
    # Both layer types, so both rotary bases (10,000 local, 1,000,000 global).
    "gemma3": lambda vocab: Gemma3TextConfig(
        vocab_size=vocab,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=512,
        layer_types=["sliding_attention", "full_attention"],
        **COMMON,
    ),
    "phi3-partial-rotary": lambda vocab: Phi3Config(
        vocab_size=vocab,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        **COMMON,
    ),
}

PROMPTS = ["Hello", "The quick brown fox " * 6, "Once upon a time", "x"]
LENGTHS = [14, 9, 12, 6]


def tiny_of(config: Any, tokenizer: Any) -> LoadedModel:
    torch.manual_seed(1234)
    # Gemma 2's soft-capped attention has no SDPA form in transformers.
    attention = "eager" if config.model_type == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    model.generation_config.eos_token_id = None  # run to the length limit, as the engine
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=config.model_type,
        device=torch.device("cpu"),
        max_context=512,
    )


def reference_greedy(loaded: LoadedModel, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = loaded.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return [int(t) for t in out[0, len(ids) :]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_fast_core_decodes_each_family_as_transformers_does(name: str, tokenizer: Any) -> None:
    loaded = tiny_of(CONFIGS[name](len(tokenizer)), tokenizer)
    with structlog.testing.capture_logs() as logs:
        core = build_core(loaded, EngineConfig(max_batch_size=4, prefill_chunk_tokens=16))
    assert isinstance(core, EngineCore) and isinstance(core.model, FastLlama)
    [chosen] = [e for e in logs if e["event"].startswith("using the")]
    assert chosen["event"] == "using the fast engine" and loaded.name in chosen["reason"]
    ids = [list(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]
    outputs: dict[str, list[Any]] = {}
    # Requests join at different steps, one while another's prefill is chunked.
    schedule = {0: [0, 1], 3: [2], 6: [3]}
    for step in range(500):
        for i in schedule.get(step, []):
            params = GenerationParams(max_new_tokens=LENGTHS[i], temperature=0.0)
            core.add(EngineRequest(request_id=f"r{i}", prompt_ids=ids[i], params=params))
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
        if step > 6 and not core.has_unfinished():
            break
    for i, n in enumerate(LENGTHS):
        assert tokens_of(outputs[f"r{i}"]) == reference_greedy(loaded, ids[i], n), (name, i)


def test_a_family_the_fast_core_lacks_is_served_eagerly_and_says_why(tokenizer: Any) -> None:
    config = GraniteConfig(vocab_size=len(tokenizer), **COMMON)
    loaded = tiny_of(config, tokenizer)
    with structlog.testing.capture_logs() as logs:
        core = build_core(loaded, EngineConfig(max_batch_size=2))
    assert isinstance(core, EagerEngineCore)
    [chosen] = [e for e in logs if e["event"].startswith("using the")]
    assert chosen["event"] == "using the eager engine"
    assert "'granite' is not one of the fast core's families" in chosen["reason"]


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"hidden_act": "gelu"}, "activation 'gelu'"),
        (
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
            "'dynamic' rotary scaling",
        ),
    ],
)
def test_a_family_member_with_an_unsupported_feature_is_served_eagerly(
    tokenizer: Any, change: dict[str, Any], says: str
) -> None:
    config = Qwen3Config(vocab_size=len(tokenizer), head_dim=16, **COMMON)
    for key, value in change.items():
        setattr(config, key, value)
    with structlog.testing.capture_logs() as logs:
        core = build_core(tiny_of(config, tokenizer), EngineConfig(max_batch_size=2))
    assert isinstance(core, EagerEngineCore)
    assert any(says in e.get("reason", "") for e in logs), logs


def test_a_sliding_window_caps_the_context(tokenizer: Any, tmp_path: Path) -> None:
    """Neither core masks by the window: the context stops where it would matter."""
    config = MistralConfig(vocab_size=len(tokenizer), **{**COMMON, "tie_word_embeddings": True})
    config.sliding_window = 96
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    assert load_model(str(tmp_path)).max_context == 96
    config.sliding_window = None
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path))
    assert load_model(str(tmp_path)).max_context == 512


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0},
                }
            },
            "'dynamic' rotary scaling",
        ),
        ({"use_bidirectional_attention": True}, "bidirectional attention"),
        ({"hidden_activation": "gelu"}, "activation 'gelu'"),
    ],
)
def test_a_gemma_3_with_a_feature_the_fast_core_lacks_is_refused(
    change: dict[str, Any], says: str
) -> None:
    """Gemma 3 keeps rotary parameters per layer type: each set is checked."""
    config = Gemma3TextConfig(vocab_size=64, head_dim=16, **COMMON)
    assert family_of(config).norm_offset
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(UnsupportedModel, match=says):
        family_of(config)


class _WholePrompt:
    """An attention context for one prompt in one forward: causal, nothing cached."""

    def __init__(self, fast: FastLlama, n: int) -> None:
        self.fast = fast
        self.mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]

    def __call__(self, layer: int, q: Any, k: Any, v: Any) -> Any:
        groups = q.shape[1] // k.shape[1]
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        cap, scale = self.fast.attn_softcap, self.fast.scale
        if cap is None:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=self.mask, scale=scale
            )
        else:
            out = prefill_softcapped_attention(q, k, v, self.mask, scale, cap)
        return out[0].transpose(0, 1)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_fast_forward_gives_transformers_logits(name: str, tokenizer: Any) -> None:
    """Logits, not only greedy choices: a soft cap on the logits keeps their order."""
    loaded = tiny_of(CONFIGS[name](len(tokenizer)), tokenizer)
    ids = tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    with torch.inference_mode():
        want = loaded.model(torch.tensor([ids])).logits[0]
        fast = fast_model_for(loaded.model, 512, transposed=False)
        positions = torch.arange(len(ids))
        hidden = fast.forward(torch.tensor(ids), positions, _WholePrompt(fast, len(ids)))
        got = fast.logits(hidden)
    assert fast.logit_softcap is not None or fast.attn_softcap is None
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_gemma_2_directory_loads_without_sdpa_and_runs_on_the_fast_core(
    tokenizer: Any, tmp_path: Path
) -> None:
    """transformers has no SDPA attention for Gemma 2; the fast core needs none."""
    config = CONFIGS["gemma2"](len(tokenizer))
    AutoModelForCausalLM.from_config(config, attn_implementation="eager").save_pretrained(tmp_path)
    tokenizer.save_pretrained(str(tmp_path))
    loaded = load_model(str(tmp_path))
    assert loaded.model.config._attn_implementation == "eager"
    assert isinstance(build_core(loaded, EngineConfig(max_batch_size=2)), EngineCore)
