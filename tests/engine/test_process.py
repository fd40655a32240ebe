"""The engine process's own rules, without a model: how a turn's end is
reported, and what the process imports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.models import tiny_model_dir
from wsinfer.contract import ErrorCode
from wsinfer.engine.lifecycle import EngineConfig, RequestOutput
from wsinfer.engine.process import _final_event, run_engine
from wsinfer.engine.requests import SequenceStatus
from wsinfer.preflight import StartupError
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, TurnError, Usage, decode_event, encode


def _failed(error: TurnError | None) -> DoneEvent:
    out = RequestOutput(
        "s:1", [], "", 3, SequenceStatus.FINISHED, "error", usage=Usage(4, 3), error=error
    )
    done = _final_event(out)
    assert isinstance(done, DoneEvent)
    return done


def test_the_code_the_core_chose_crosses_redis_as_is() -> None:
    too_long = TurnError(ErrorCode.TOO_LARGE, "prompt of 9000 tokens does not fit")
    done = decode_event(encode(_failed(too_long)))
    assert isinstance(done, DoneEvent) and done.error == too_long
    assert done.error.code is ErrorCode.TOO_LARGE


def test_words_in_a_message_do_not_choose_its_code() -> None:
    # Was: any message mentioning "context" became too_large.
    fault = TurnError(ErrorCode.INTERNAL, "CUDA error: context is destroyed")
    assert _failed(fault).error == fault
    assert _failed(None).error == TurnError(ErrorCode.INTERNAL, "generation failed")


def test_the_engine_process_does_not_import_the_frontends_modules() -> None:
    # redis itself imports redis.asyncio; what the engine must not load is the
    # frontend's asyncio store (it did, through sessions/worker.py), nor its
    # start-up (the checks both share are wsinfer/preflight.py's).
    probe = "import json, sys, wsinfer.engine.process; print(json.dumps(list(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert "wsinfer.engine.process" in loaded
    assert "wsinfer.sessions.store" not in loaded
    assert "wsinfer.startup" not in loaded and "wsinfer.server" not in loaded


def test_a_deltas_logprobs_cross_redis_and_a_delta_without_them_has_no_key() -> None:
    entry = {"token": " Paris", "logprob": -0.01, "bytes": list(b" Paris"), "top_logprobs": []}
    scored = DeltaEvent(3, " Paris", [7], logprobs=[entry])
    assert decode_event(encode(scored)) == scored
    plain = DeltaEvent(4, ".", [8])
    assert decode_event(encode(plain)) == plain
    assert b"logprobs" not in encode(plain)["m"]


def test_a_kv_dtype_the_model_cannot_use_stops_the_start_in_one_line(redis_url: str) -> None:
    """After the model loads (only then is its dtype known): a StartupError, which the
    command prints as one line, not a traceback."""
    with pytest.raises(StartupError, match="--kv-dtype float16: only the CPU engine's native"):
        run_engine(
            redis_url, str(tiny_model_dir()), dtype="bfloat16",
            core_config=EngineConfig(kv_dtype="float16"),
        )  # fmt: skip
