"""The model-free load-test core: EngineCore's API and outputs, tokens at a set rate."""

from __future__ import annotations

import time

import pytest

from tests.engine.conftest import run_all, text_of, tokens_of
from wsinfer.engine.core import EngineRequest
from wsinfer.engine.fake import (
    FAKE_KV_BYTES_PER_TOKEN,
    WORDS,
    FakeCore,
    fake_engine,
)
from wsinfer.engine.fake_spec import FakeSpec, FakeSpecError
from wsinfer.sessions.schema import GenerationParams


def request(rid: str = "s:1", n: int = 5, **kwargs: object) -> EngineRequest:
    params = GenerationParams(max_new_tokens=n, stop=tuple(kwargs.pop("stop", ())))  # type: ignore[arg-type]
    return EngineRequest(rid, [1, 2, 3], params, **kwargs)  # type: ignore[arg-type]


def test_spec_parses_rate_and_stamp() -> None:
    assert FakeSpec.parse("fake:200") == FakeSpec(200.0)
    assert FakeSpec.parse("fake:inf:stamp") == FakeSpec(float("inf"), stamp=True)


@pytest.mark.parametrize(
    "spec", ["fake:", "fake:fast", "fake:0", "fake:-3", "fake:nan", "fake:5:x"]
)
def test_bad_specs_are_refused(spec: str) -> None:
    with pytest.raises(FakeSpecError):
        FakeSpec.parse(spec)


def test_a_turn_runs_to_max_new_tokens_one_output_per_token() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request(n=10))
    (outputs,) = run_all(core).values()
    assert len(outputs) == 10 and [o.num_generated for o in outputs] == list(range(1, 11))
    assert text_of(outputs) == "".join(WORDS[i % len(WORDS)] for i in range(10))
    last = outputs[-1]
    assert last.finished and last.finish_reason == "length"
    assert last.usage is not None and last.usage.completion_tokens == 10
    assert not core.has_unfinished()


def test_as_fast_as_possible_is_one_token_per_stream_per_step() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request("a", n=200))
    core.add(request("b", n=200))
    steps = 0
    while core.has_unfinished():
        outputs = core.step()
        assert sorted(o.request_id for o in outputs) == ["a", "b"]
        assert all(len(o.new_token_ids) == 1 for o in outputs)
        steps += 1
    assert steps == 200 and outputs[-1].finish_reason == "length"


def test_a_stream_behind_its_rate_gets_its_tokens_in_one_output() -> None:
    core = FakeCore(FakeSpec(1000.0))
    core.add(request(n=500))
    time.sleep(0.05)  # about 50 tokens due
    (out,) = core.step()
    assert 20 <= len(out.new_token_ids) <= 64 and out.num_generated == len(out.new_token_ids)
    assert out.text == "".join(WORDS[i % len(WORDS)] for i in range(out.num_generated))


def test_tokens_come_at_the_set_rate() -> None:
    core = FakeCore(FakeSpec(100.0))
    core.add(request(n=20))
    started = time.monotonic()
    run_all(core)
    elapsed = time.monotonic() - started
    assert 0.18 <= elapsed < 2.0  # 20 tokens at 100/s: 0.2 s, not a busy burst


def test_a_taken_over_turn_continues_the_same_text() -> None:
    whole = FakeCore(FakeSpec(float("inf")))
    whole.add(request(n=12))
    reference = text_of(run_all(whole)["s:1"])
    first = FakeCore(FakeSpec(float("inf")))
    first.add(request(n=12))
    head = [first.step()[0] for _ in range(5)]
    rest = FakeCore(FakeSpec(float("inf")))  # another engine, from the token log
    rest.add(request(n=12, generated_ids=tokens_of(head)))
    assert text_of(head) + text_of(run_all(rest)["s:1"]) == reference


def test_pause_and_cancel() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request("a", n=1000))
    core.add(request("b", n=1000))
    core.step()
    core.abort("a", pause=True)
    core.abort("b")
    outputs = {o.request_id: o for o in core.step() if o.finished or o.paused}
    assert outputs["a"].paused and not outputs["a"].finished
    assert outputs["b"].finished and outputs["b"].finish_reason == "cancelled"
    assert not core.has_unfinished()


def test_a_stop_string_ends_the_turn_before_it() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request(n=100, stop=["dolor"]))
    outputs = run_all(core)["s:1"]
    assert text_of(outputs) == " lorem ipsum "
    assert outputs[-1].finish_reason == "stop"


def test_a_kept_cache_covers_the_next_turn() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request("s:1", n=4, cache_key="s"))
    first = run_all(core)["s:1"][-1]
    assert first.kv_len == 7 and core.cached_length("s") == 7
    assert core.store.used_bytes == 7 * FAKE_KV_BYTES_PER_TOKEN and len(core.store) == 1
    context = [1, 2, 3, 0, 1, 2, 3, 9, 9]  # the first turn's prompt and tokens, then new ones
    core.add(EngineRequest("s:2", context, GenerationParams(max_new_tokens=2), cache_key="s"))
    last = run_all(core)["s:2"][-1]
    assert last.usage is not None and last.usage.cached_tokens == 7
    core.drop_cache("s")
    assert core.cached_length("s") == 0 and core.store.used_bytes == 0


def test_the_batch_limit_leaves_the_rest_waiting() -> None:
    core, _ = fake_engine("fake:inf", type("C", (), {"max_batch_size": 2, "kv_cache_bytes": 1})())
    for i in range(3):
        core.add(request(f"r{i}", n=1000))
    assert (core.num_running, core.num_waiting) == (2, 1)
    assert {o.request_id for o in core.step()} == {"r0", "r1"}
    with pytest.raises(ValueError):
        core.add(request("r0"))


def test_at_a_set_rate_the_whole_batch_steps_together() -> None:
    """As a real engine: 20 streams at 50 tokens/s each, started at different
    times, take about 50 steps a second between them, not one per token."""
    core = FakeCore(FakeSpec(50.0), max_batch_size=32)
    for i in range(20):
        core.add(request(f"s{i}", n=10))
        time.sleep(0.001)
    steps_with_tokens = 0
    while core.has_unfinished():
        if any(out.new_token_ids for out in core.step()):
            steps_with_tokens += 1
    assert steps_with_tokens <= 15  # 10 tokens each at 50/s: ~11 steps (one per token, 200)


# --- through the one lifecycle and output processor -----------------------------------


def test_a_paused_turn_keeps_its_kv_handle_and_the_resume_starts_from_it() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request("s:1", n=100, cache_key="s"))
    for _ in range(3):
        core.step()
    core.abort("s:1", pause=True)
    (paused,) = core.step()
    assert paused.paused and paused.finish_reason is None and paused.new_token_ids == []
    assert paused.kv_len == 3 + 3 and core.cached_length("s") == 6
    resumed = request("s:1", n=100, cache_key="s", generated_ids=[0, 1, 2])
    core.add(resumed)
    (first,) = core.step()
    assert first.text == WORDS[3]
    core.abort("s:1")
    (cancelled,) = core.step()
    assert cancelled.usage is not None and cancelled.usage.cached_tokens == 5


def test_a_stop_string_across_words_is_cut_where_it_begins() -> None:
    """As in the model cores: text that may begin a stop string is held back."""
    core = FakeCore(FakeSpec(float("inf")))
    core.add(request(n=100, stop=["m d"]))
    outputs = run_all(core)["s:1"]
    assert [o.text for o in outputs] == [" lore", "m ipsu", ""]
    assert outputs[-1].finish_reason == "stop"


def test_each_word_of_a_merged_output_carries_its_logprob() -> None:
    core = FakeCore(FakeSpec(1000.0))
    params = GenerationParams(max_new_tokens=500, logprobs=True, top_logprobs=1)
    core.add(EngineRequest("s:1", [1, 2, 3], params))
    time.sleep(0.02)
    (out,) = core.step()
    assert len(out.new_token_ids) > 1 and len(out.logprobs) == len(out.new_token_ids)
    assert [lp.token for lp in out.logprobs] == out.new_token_ids
    assert all(lp.logprob == 0.0 and lp.top == ((lp.token, 0.0),) for lp in out.logprobs)
    assert core.token_bytes(out.new_token_ids[1]) == WORDS[1].encode()


def test_a_response_format_is_refused_at_once() -> None:
    core = FakeCore(FakeSpec(float("inf")))
    params = GenerationParams(response_format='{"type":"json_object"}')
    core.add(EngineRequest("s:1", [1, 2, 3], params))
    (out,) = core.step()
    assert out.finished and out.finish_reason == "error" and out.error is not None
    assert out.error.message == "the fake model cannot follow a response_format"
    assert not core.has_unfinished()
