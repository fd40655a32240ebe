from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.models import tiny_model_dir
from wsinfer.engine.cpu_linear import PackedLinear, pack_linear_weights
from wsinfer.engine.model import LoadedModel, ModelLoadError, default_cache_dir, load_model
from wsinfer.engine.prompts import render_chat, render_text


def test_tiny_model_loads_in_bfloat16() -> None:
    loaded = load_model(str(tiny_model_dir()), dtype="bfloat16")
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    assert loaded.eos_token_ids == {loaded.tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert loaded.max_context == 2048


def test_bad_specs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError):
        load_model(str(tiny_model_dir()), dtype="float8")


def test_default_model_is_cached_with_its_chat_template(smol: LoadedModel) -> None:
    converted = list((default_cache_dir() / "models").glob(f"{smol.name}-*"))
    assert converted and (converted[0] / "config.json").is_file()
    assert smol.tokenizer.chat_template and "<|im_start|>" in smol.tokenizer.chat_template
    assert smol.eos_token_ids == {smol.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_render_chat_ends_with_the_assistant_header(tokenizer: object) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    ids = render_chat(tokenizer, [*messages, {"role": "user", "content": "Bye"}])
    text = tokenizer.decode(ids)  # type: ignore[attr-defined]
    assert text.endswith("<|im_start|>assistant\n")
    assert "Hello!<|im_end|>" in text and "Bye" in text


def test_render_text_appends_to_history(tokenizer: object) -> None:
    first = render_text(tokenizer, "Once upon", [])
    more = render_text(tokenizer, " a time", first)
    assert more[: len(first)] == first
    assert tokenizer.decode(more) == "Once upon a time"  # type: ignore[attr-defined]


def test_packed_linear_matches_linear() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32, bias=False), torch.nn.Linear(32, 8))
    x = torch.randn(3, 5, 16)
    expected = model(x)
    assert pack_linear_weights(model) == 1  # the biased layer stays as it is
    assert isinstance(model[0], PackedLinear)
    torch.testing.assert_close(model(x), expected)
    assert pack_linear_weights(model) == 0  # idempotent
