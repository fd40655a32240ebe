from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import structlog
import torch

from tests.models import tiny_model_dir
from wsinfer.engine import model
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


def test_a_ggufs_conversion_is_keyed_by_its_content_not_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two venvs' copies of one file (other paths, other mtimes) share one conversion,
    announced before it begins; other bytes are another model."""
    converted: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        converted.append(gguf)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(model, "_convert_gguf", convert)
    one, two = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for path in (one, two):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    cache = tmp_path / "cache"
    with structlog.testing.capture_logs() as logs:
        first = model.converted_gguf_dir(one, cache, hint="; `wsinfer prepare` does it at install")
    assert logs[0]["event"] == (
        "converting m.gguf to transformers weights, about 5 s, once; "
        "`wsinfer prepare` does it at install"
    )
    with structlog.testing.capture_logs() as logs:
        assert model.converted_gguf_dir(two, cache) == first and converted == [one]
    assert logs == []  # nothing to do, nothing said
    two.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 1000)
    assert model.converted_gguf_dir(two, cache) != first and converted == [one, two]


def test_a_files_digest_is_remembered_and_a_read_only_cache_only_costs_a_hash(
    tmp_path: Path,
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x" * 3_000_000)
    want = hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert model.gguf_digest(gguf, tmp_path / "cache") == want
    assert len(list((tmp_path / "cache" / "models" / "digests").iterdir())) == 1
    unwritable = tmp_path / "a-file"  # no directory can be made under it (root or not)
    unwritable.write_text("")
    assert model.gguf_digest(gguf, unwritable) == want


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
