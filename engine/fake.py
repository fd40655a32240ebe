"""A model-free engine core for load tests: tokens at a set rate per stream.

``--model fake:RATE`` (``RATE`` tokens per second per stream, ``inf`` for as
fast as the loop goes) runs ``FakeCore`` in place of ``EngineCore`` behind the
real ``process.py``: the same Redis scripts, consumer group, leases, fan-in
and WebSocket path carry its deltas, so a frontend can be loaded without a
model or a GPU. ``fake:RATE:stamp`` makes each token's text its production
time (`` <unix µs>``), so a client can measure publish-to-receive delay.

The public API and outputs are ``EngineCore``'s: add / abort / step /
has_unfinished / cached_length / drop_cache / num_running / num_waiting, and
``RequestOutput`` (a turn with tools split into content and calls as theirs
are, by ``tool_calls.py``). Token ``i`` of a turn is always the same word, so a turn
taken over from the token log continues the same text. ``max_new_tokens``
and ``stop`` strings are honoured; the context never runs out. Finished and
paused turns keep a nominal KV handle (token ids only) so resume and
next-turn cache hits look like the real engine's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from wsinfer.contract import ErrorCode, FinishReasonName
from wsinfer.engine.core import EngineRequest, RequestOutput
from wsinfer.engine.fake_spec import FakeSpec
from wsinfer.engine.lifecycle import refused
from wsinfer.engine.logprobs import TokenLogprob
from wsinfer.engine.lru import LRUBacked, RetainedLRU
from wsinfer.engine.requests import SequenceStatus
from wsinfer.engine.stats import CoreStats, kept_caches
from wsinfer.engine.tool_calls import call_parser, split_calls, with_tools
from wsinfer.sessions.schema import TurnError, Usage
from wsinfer.tool_formats import CallParser, format_for_template

WORDS = (" lorem", " ipsum", " dolor", " sit", " amet", " consectetur", " adipiscing", " elit")
# Nominal size of one token's KV, so the cache metrics move like a small model's.
FAKE_KV_BYTES_PER_TOKEN = 16 * 1024
# A stream behind its rate gets its due tokens in one output (one delta), at
# most this many per step; at ``inf`` every step gives each stream one token,
# as a real engine does. One output per request per step: process.py numbers
# a step's publishes per turn on that assumption.
MAX_TOKENS_PER_STEP = 64


class FakeTokenizer:
    """Byte-level stand-in with the calls ``prompts.py`` makes."""

    bos_token_id = None
    eos_token_id = None
    add_bos_token = False

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict[str, Any]], **_: Any) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self.encode(text)


@dataclass
class FakeLoaded:
    """What ``process.py`` reads of a ``LoadedModel``."""

    name: str
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    device: str = "cpu"
    max_context: int = 1 << 30


@dataclass
class _Stream:
    request: EngineRequest
    started: float  # monotonic time of add(): token k is due at started + k / rate
    num_generated: int
    emitted: int = 0  # tokens produced since add()
    cached_tokens: int = 0
    tail: str = ""  # recent text, to find stop strings that span tokens
    calls: CallParser | None = None  # a turn with tools: reads the calls out of its text


class _FakeStore(LRUBacked):
    """Retained token ids in the cores' LRU (``lru.py``), sized in nominal bytes."""

    def __init__(self, budget_bytes: int) -> None:
        self.lru: RetainedLRU[list[int]] = RetainedLRU(budget_bytes, _nominal_bytes)

    def put(self, key: str, token_ids: list[int]) -> bool:
        if not token_ids:
            self.lru.drop(key)
            return False
        return self.lru.put(key, token_ids)

    def take(self, key: str) -> list[int] | None:
        return self.lru.take(key)

    def length(self, key: str) -> int:
        return len(self.lru.get(key) or ())

    def drop(self, key: str) -> None:
        self.lru.drop(key)

    def __len__(self) -> int:
        return len(self.lru)


def _nominal_bytes(token_ids: list[int]) -> int:
    return len(token_ids) * FAKE_KV_BYTES_PER_TOKEN


class FakeCore:
    def __init__(
        self, spec: FakeSpec, *, max_batch_size: int = 16, kv_cache_bytes: int = 2 << 30
    ) -> None:
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.store = _FakeStore(kv_cache_bytes)
        self._streams: dict[str, _Stream] = {}  # insertion order = admission order
        self._immediate: list[RequestOutput] = []
        self._aborts: dict[str, bool] = {}
        self._last_step = 0.0  # monotonic time of the last step that gave tokens
        self.tool_format = format_for_template(None)  # its tokenizer has no chat template

    # --- EngineCore's public API ------------------------------------------------

    def stats(self) -> CoreStats:
        return CoreStats(**kept_caches(self.store))

    def add(self, request: EngineRequest) -> None:
        rid = request.request_id
        if rid in self._streams or any(o.request_id == rid for o in self._immediate):
            raise ValueError(f"duplicate request id {rid!r}")
        request = with_tools(request, self.tool_format)
        if request.params.response_format is not None:
            # Its words follow no grammar: refuse rather than answer outside the format.
            message = "the fake model cannot follow a response_format"
            self._immediate.append(refused(request, TurnError(ErrorCode.BAD_REQUEST, message)))
            return
        stream = _Stream(request, time.monotonic(), len(request.generated_ids))
        stream.calls = call_parser(request, self.tool_format)
        stream.cached_tokens = self._reuse(request)
        if stream.num_generated >= request.params.max_new_tokens:  # rebuilt, already over
            self._immediate.append(self._final(stream, "length", [], ""))
            return
        self._streams[rid] = stream

    def abort(self, request_id: str, *, pause: bool = False) -> None:
        if request_id in self._streams:
            self._aborts[request_id] = pause

    def step(self) -> list[RequestOutput]:
        outputs, self._immediate = self._immediate, []
        outputs += self._process_aborts()
        if not self._step_due():
            return outputs
        now = self._last_step = time.monotonic()
        stamp = f" {time.time_ns() // 1000}" if self.spec.stamp else None
        for stream in list(self._streams.values())[: self.max_batch_size]:
            outputs += self._advance(stream, now, stamp)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._streams or self._immediate)

    def cached_length(self, cache_key: str) -> int:
        return self.store.length(cache_key)

    def drop_cache(self, cache_key: str) -> None:
        self.store.drop(cache_key)

    @property
    def num_running(self) -> int:
        return min(len(self._streams), self.max_batch_size)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._streams) - self.max_batch_size)

    # --- the step -----------------------------------------------------------------

    def _step_due(self) -> bool:
        """Sleep until the next step is due (a real step takes time too): no busy loop.

        At a finite rate the core steps as a real one does, its whole batch at
        once, at most every 1/rate s: each running stream gets what is due by
        then. Stepping whenever any one stream had a token due made 200
        streams at 20 tokens/s 4,000 one-token steps a second, and the engine
        process's per-step work, not the relay, the cost being measured.
        False: woken early (the process polls controls between steps)."""
        if not self._streams or math.isinf(self.spec.tokens_per_s) or self._aborts:
            return True
        rate = self.spec.tokens_per_s
        first = min(s.started + (s.emitted + 1) / rate for s in self._streams.values())
        delay = max(first, self._last_step + 1 / rate) - time.monotonic()
        if delay <= 0:
            return True
        time.sleep(min(delay, 0.01))
        return delay <= 0.01

    def _advance(self, stream: _Stream, now: float, stamp: str | None) -> list[RequestOutput]:
        rate = self.spec.tokens_per_s
        due = stream.emitted + 1 if math.isinf(rate) else int((now - stream.started) * rate)
        outputs: list[RequestOutput] = []
        for _ in range(min(due - stream.emitted, MAX_TOKENS_PER_STEP)):
            outputs.append(self._token(stream, stamp))
            if outputs[-1].finished:
                break
        if len(outputs) > 1:  # one output carrying them all
            last = outputs[-1]
            last.new_token_ids = [t for out in outputs for t in out.new_token_ids]
            last.text = "".join(out.text for out in outputs)
            last.logprobs = [lp for out in outputs for lp in out.logprobs]
            outputs = [last]
        if stream.calls is not None:
            outputs = [split_calls(stream.calls, out) for out in outputs]
        return outputs

    def _token(self, stream: _Stream, stamp: str | None) -> RequestOutput:
        token = stream.num_generated % len(WORDS)
        text = stamp if stamp is not None else WORDS[token]
        stream.num_generated += 1
        stream.emitted += 1
        reason: FinishReasonName | None = None
        stop_at = self._find_stop(stream, text)
        if stop_at is not None:
            reason, text = "stop", text[:stop_at]
        elif stream.num_generated >= stream.request.params.max_new_tokens:
            reason = "length"
        # The fake model is sure of every word: log-probability 0, no alternative.
        params = stream.request.params
        top = ((token, 0.0),) if params.top_logprobs else ()
        logprobs = [TokenLogprob(token, 0.0, top)] if params.logprobs else []
        if reason is not None:
            final = self._final(stream, reason, [token], text)
            final.logprobs = logprobs
            return final
        out = RequestOutput(stream.request.request_id, [token], text, stream.num_generated)
        out.logprobs = logprobs
        return out

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (its word), for logprobs entries."""
        return WORDS[token % len(WORDS)].encode()

    def _find_stop(self, stream: _Stream, text: str) -> int | None:
        """Where in ``text`` a stop string completes (its start), if one does."""
        stops = stream.request.params.stop
        if not stops:
            return None
        window = stream.tail + text
        hits = [window.find(s) for s in stops if s in window]
        stream.tail = window[-max(map(len, stops)) :]
        if not hits:
            return None
        return max(0, min(hits) - (len(window) - len(text)))

    # --- leaving ---------------------------------------------------------------------

    def _process_aborts(self) -> list[RequestOutput]:
        outputs = []
        for rid, pause in self._aborts.items():
            stream = self._streams.get(rid)
            if stream is not None:
                reason: FinishReasonName | None = None if pause else "cancelled"
                status = SequenceStatus.PAUSED if pause else SequenceStatus.FINISHED
                outputs.append(self._final(stream, reason, [], "", status))
        self._aborts.clear()
        return outputs

    def _final(
        self,
        stream: _Stream,
        reason: FinishReasonName | None,
        new_ids: list[int],
        text: str,
        status: SequenceStatus = SequenceStatus.FINISHED,
    ) -> RequestOutput:
        request = stream.request
        self._streams.pop(request.request_id, None)
        kv_len = self._retain(stream)
        return RequestOutput(
            request.request_id,
            new_ids,
            text,
            stream.num_generated,
            status,
            reason,
            usage=Usage(len(request.prompt_ids), stream.num_generated, stream.cached_tokens),
            kv_len=kv_len,
        )

    # --- the nominal KV cache ------------------------------------------------------------

    def _tokens(self, stream: _Stream) -> list[int]:
        request = stream.request
        generated = list(request.generated_ids)
        generated += [i % len(WORDS) for i in range(len(generated), stream.num_generated)]
        return list(request.prompt_ids) + generated

    def _retain(self, stream: _Stream) -> int | None:
        key = stream.request.cache_key
        if key is None:
            return None
        tokens = self._tokens(stream)
        return len(tokens) if self.store.put(key, tokens) else None

    def _reuse(self, request: EngineRequest) -> int:
        """Tokens of the request's context a retained handle covers (as ``EngineCore``)."""
        held = self.store.take(request.cache_key) if request.cache_key else None
        if not held:
            return 0
        context = list(request.prompt_ids) + list(request.generated_ids)
        same = 0
        for a, b in zip(held, context, strict=False):
            if a != b:
                break
            same += 1
        return min(same, len(context) - 1)


def fake_engine(spec: str, config: Any) -> tuple[FakeCore, FakeLoaded]:
    """The fake core for a ``fake:`` spec, sized by the engine's ``EngineConfig``."""
    parsed = FakeSpec.parse(spec)
    core = FakeCore(
        parsed, max_batch_size=config.max_batch_size, kv_cache_bytes=config.kv_cache_bytes
    )
    return core, FakeLoaded(name=spec)
