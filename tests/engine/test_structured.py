"""Structured output: response_format checked on the way in, and every draw held to it.

A random-weight model left alone writes gibberish; under a grammar every turn
that ends by itself must be a document that parses and validates, whatever the
seed, the batch around it, the core (paged, its CUDA-graph program, async
steps, eager) or a takeover in the middle. Unconstrained rows beside it draw
exactly what they draw alone.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jsonschema
import pytest
import torch

from tests.engine.conftest import run_all, text_of, tokens_of
from tests.engine.test_attention_cpu import quantized_tiny  # noqa: F401 (fixture)
from tests.engine.test_core import reference_greedy, request
from wsinfer.engine.core import EngineConfig, EngineCore, build_core
from wsinfer.engine.eager import EagerEngineCore
from wsinfer.engine.fake import FakeCore, FakeSpec
from wsinfer.engine.grammar import apply_bitmask
from wsinfer.engine.model import LoadedModel
from wsinfer.response_format import MAX_FORMAT_CHARS, canonical, responses_format, schema_of
from wsinfer.sessions.schema import GenerationParams, ParamsError

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "size"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def params(fmt: Any = FORMAT, **kw: Any) -> GenerationParams:
    raw = {"max_new_tokens": 60, "temperature": 1.0, "seed": 1, "response_format": fmt}
    return GenerationParams.parse({**raw, **kw})


def assert_valid(text: str, fmt: str | None) -> None:
    assert fmt is not None
    jsonschema.validate(json.loads(text), schema_of(fmt))


# --- checking the format ---------------------------------------------------------------------


def test_formats_are_checked_and_kept_canonical() -> None:
    assert canonical({"type": "text"}) is None
    assert canonical({"type": "json_object"}) == '{"type":"json_object"}'
    text = canonical(FORMAT)
    assert text is not None and json.loads(text)["json_schema"]["strict"] is False
    assert canonical({**FORMAT, "json_schema": {**FORMAT["json_schema"]}}) == text
    p = params()
    assert p.response_format == text
    assert GenerationParams.from_dict(p.to_dict()) == p
    assert "response_format" not in GenerationParams().to_dict()  # a rolling upgrade
    assert responses_format(text) == {"type": "json_schema", "name": "thing", "schema": SCHEMA,
                                      "strict": False}  # fmt: skip
    assert responses_format(None) == {"type": "text"}


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ("json", "must be an object"),
        ({"type": "xml"}, "type must be text, json_object or json_schema"),
        ({"type": "text", "extra": 1}, "unknown fields in response_format: extra"),
        ({"type": "json_schema"}, "json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "name must be"),
        ({"type": "json_schema", "json_schema": {"name": "a b"}}, "name must be"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "schema must be"),
        ({"type": "json_schema", "json_schema": {"name": "a", "strict": 1}}, "strict must be"),
        ({"type": "json_schema", "json_schema": {"name": "a", "x": 1}}, "unknown fields"),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}},
            "cannot be enforced",
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "strict": True,
                    "schema": {"type": "object", "dependentSchemas": {"a": {}}},
                },
            },
            "cannot be enforced",
        ),  # fmt: skip
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {"description": "x" * MAX_FORMAT_CHARS},
                },
            },
            "longer than",
        ),  # fmt: skip
    ],
)
def test_bad_formats_are_refused_with_a_reason(fmt: Any, message: str) -> None:
    with pytest.raises(ParamsError, match=message):
        params(fmt)


def test_a_keyword_strict_mode_cannot_enforce_is_ignored_without_strict() -> None:
    loose = {"name": "a", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}
    assert canonical({"type": "json_schema", "json_schema": loose}) is not None


def test_min_tokens_and_a_format_together_are_refused() -> None:
    with pytest.raises(ParamsError, match="min_tokens cannot be combined"):
        params(min_tokens=3)


def test_the_bitmask_keeps_exactly_the_allowed_tokens() -> None:
    logits = torch.randn(3, 70)
    mask = torch.full((2, 3), -1, dtype=torch.int32)
    mask[0] = 0
    mask[0, 1] = 1 << 3  # token 35 only
    mask[1, 2] = 0  # tokens 64-69 banned
    out = apply_bitmask(logits, mask)
    assert torch.isinf(out[0]).sum() == 69 and out[0, 35] == logits[0, 35]
    assert torch.equal(out[1, :64], logits[1, :64]) and torch.isinf(out[1, 64:]).all()
    assert torch.equal(out[2], logits[2])  # past the bitmask's rows: untouched


# --- the engine -----------------------------------------------------------------------------

PROMPT = [5, 9, 13, 17, 21]


def constrained_batch(core: Any, n: int = 12) -> dict[str, list[Any]]:
    """``n`` seeded constrained turns, one greedy, a json_object one and two free ones."""
    for i in range(n):
        core.add(request(f"s{i}", PROMPT + [i], dataclasses.replace(params(), seed=i)))
    core.add(request("greedy", PROMPT, params(temperature=0)))
    core.add(request("free", PROMPT, GenerationParams(max_new_tokens=20, temperature=0)))
    core.add(request("free2", PROMPT[:3], GenerationParams(max_new_tokens=9, temperature=0)))
    return run_all(core)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(max_batch_size=8, prefill_chunk_tokens=4),
        EngineConfig(max_batch_size=8, async_steps=True),
        EngineConfig(max_batch_size=8, cuda_graphs=True),
    ],
    ids=["paged", "async", "graph-buckets"],
)
def test_every_constrained_turn_is_a_valid_document_and_free_rows_are_untouched(
    tiny: LoadedModel, config: EngineConfig
) -> None:
    outputs = constrained_batch(EngineCore(tiny, config))
    fmt = params().response_format
    for rid, outs in outputs.items():
        if rid.startswith("free"):
            continue
        assert outs[-1].finish_reason == "stop", (rid, text_of(outs))
        assert_valid(text_of(outs), fmt)
        assert list(json.loads(text_of(outs))) == ["ok", "color", "size"]  # the schema's order
    assert tokens_of(outputs["free"]) == reference_greedy(tiny, PROMPT, 20)
    assert tokens_of(outputs["free2"]) == reference_greedy(tiny, PROMPT[:3], 9)


def test_the_eager_core_holds_its_draws_to_the_format_too(tmp_path: Any) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.models import tiny_model_dir
    from wsinfer.engine.model import load_model

    tokenizer = load_model(str(tiny_model_dir())).tokenizer
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=256)
    torch.manual_seed(0)
    loaded = LoadedModel(
        GPT2LMHeadModel(config).eval(), tokenizer, "gpt2-tiny", torch.device("cpu"), set(), 256
    )
    core = build_core(loaded)
    assert isinstance(core, EagerEngineCore)
    outputs = constrained_batch(core, 4)
    for rid in ("s0", "s1", "s2", "s3", "greedy"):
        assert_valid(text_of(outputs[rid]), params().response_format)
    assert tokens_of(outputs["free"]) == reference_greedy(loaded, PROMPT, 20)


def test_a_json_object_turn_only_ever_writes_a_json_prefix(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    p = params({"type": "json_object"}, max_new_tokens=40)
    core.add(request("o", PROMPT, p))
    text = text_of(run_all(core)["o"])
    assert text.startswith("{")
    # Cut by max_new_tokens (a random model rarely closes it), but never off the grammar:
    # llguidance's own matcher accepts the text as a prefix.
    from wsinfer.engine.grammar import Grammars

    grammars = Grammars(tiny.tokenizer, core.vocab_size, tiny.eos_token_ids)
    assert p.response_format is not None
    ids = tiny.tokenizer.encode(text, add_special_tokens=False)
    grammars.constraint(p.response_format, ids)  # raises if the text broke the grammar


def test_a_constrained_turn_taken_over_mid_document_ends_the_same(
    quantized_tiny: LoadedModel,  # noqa: F811
) -> None:
    """Rebuilt from its token log (another engine, after a crash), the matcher is
    advanced past the tokens already drawn: the continuation is the same, bit for bit
    on the quantized CPU path."""
    config = EngineConfig(quantized_cpu_weights=True)
    core = EngineCore(quantized_tiny, config)
    core.add(request("t", PROMPT, params(seed=5)))
    whole = tokens_of(run_all(core)["t"])
    assert len(whole) > 8
    for cut in (1, 4, len(whole) - 1):
        core = EngineCore(quantized_tiny, config)
        core.add(request("t", PROMPT, params(seed=5), generated_ids=whole[:cut]))
        outs = run_all(core)["t"]
        assert tokens_of(outs) == whole[cut:], cut
        assert outs[-1].finish_reason == "stop"


def test_a_rebuilt_turn_whose_document_was_complete_ends_at_once(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("t", PROMPT, params(seed=2)))
    whole = tokens_of(run_all(core)["t"])
    core.add(request("again", PROMPT, params(seed=2), generated_ids=whole))
    [out] = core.step()
    assert out.finished and out.finish_reason == "stop" and out.new_token_ids == []


def test_a_token_log_that_breaks_the_format_is_a_client_error(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    text = tiny.tokenizer.encode("not json", add_special_tokens=False)
    core.add(request("t", PROMPT, params(), generated_ids=text))
    [out] = core.step()
    assert out.finish_reason == "error" and out.error is not None
    assert out.error.code == "bad_request" and "break" in out.error.message


def test_the_fake_model_refuses_a_format_instead_of_ignoring_it() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request("t", [1, 2], params()))
    [out] = core.step()
    assert out.finish_reason == "error" and out.error is not None
    assert out.error.code == "bad_request" and "response_format" in out.error.message


def test_masks_from_the_thread_pool_equal_those_computed_one_by_one(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsinfer.engine import grammar

    grammars = grammar.Grammars(tiny.tokenizer, 49152, tiny.eos_token_ids)
    fmt = params().response_format
    assert fmt is not None
    texts = ['{"ok": true', '{"ok": false, "color": "r', "", '{"ok": false, "color": "blue"']
    constraints: list[grammar.Constraint | None] = []
    for i in range(20):
        ids = tiny.tokenizer.encode(texts[i % 4], add_special_tokens=False)
        constraints.append(None if i % 5 == 3 else grammars.constraint(fmt, ids))
    assert len(grammars._compiled) == 1  # one compile, deep copies for every turn
    serial = grammars.bitmask(constraints[: grammar.PARALLEL_MASK_ROWS - 1])
    pooled = grammars.bitmask(constraints)
    assert grammars._executor is not None and serial is not None and pooled is not None
    assert torch.equal(pooled[: len(serial)], serial)
    assert (pooled[3] == -1).all() and not (pooled[0] == -1).all()


def test_a_full_batch_of_constrained_rows_all_end_valid(tiny: LoadedModel) -> None:
    core = EngineCore(tiny, EngineConfig(max_batch_size=20))
    for i in range(20):
        core.add(request(f"s{i}", PROMPT + [i], dataclasses.replace(params(), seed=i)))
    outputs = run_all(core)
    assert core.grammars._executor is not None  # the thread pool served the batch
    for outs in outputs.values():
        assert outs[-1].finish_reason == "stop"
        assert_valid(text_of(outs), params().response_format)


class GaveUp:
    """A matcher that hit llguidance's limits while computing its mask."""

    def is_error(self) -> bool:
        return True

    def get_error(self) -> str:
        return "parser too complex"

    def unsafe_compute_mask_ptr(self, pointer: int, size: int) -> None:
        return None  # writes nothing: what it allowed no longer matters


def test_a_grammar_that_gives_up_ends_its_turn_as_the_clients_error(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("t", PROMPT, params()))
    core.add(request("free", PROMPT, GenerationParams(max_new_tokens=5, temperature=0)))
    core._seqs["t"].constraint.matcher = GaveUp()
    outputs = run_all(core)
    [end] = outputs["t"]
    assert end.finish_reason == "error" and end.error is not None
    assert end.error.code == "bad_request" and "parser too complex" in end.error.message
    assert tokens_of(outputs["free"]) == reference_greedy(tiny, PROMPT, 5)  # unharmed


def test_a_draw_outside_the_grammar_is_our_error_not_the_clients(tiny: LoadedModel) -> None:
    core = EngineCore(tiny)
    core.add(request("t", PROMPT, params()))
    core._seqs["t"].constraint.accept = lambda token: False  # type: ignore[method-assign]
    [end] = run_all(core)["t"]
    assert end.finish_reason == "error" and end.error is not None
    assert end.error.code == "internal" and "breaks the turn's response_format" in end.error.message
