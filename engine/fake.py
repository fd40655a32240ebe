"""A model-free engine core for load tests: tokens at a set rate per stream.

``--model fake:RATE`` (``RATE`` tokens per second per stream, ``inf`` for as
fast as the loop goes) runs ``FakeCore`` in place of ``EngineCore`` behind the
real ``process.py``: the same Redis scripts, consumer group, leases, fan-in
and WebSocket path carry its deltas, so a frontend can be loaded without a
model or a GPU. ``fake:RATE:stamp`` makes each token's text its production
time (`` <unix µs>``), so a client can measure publish-to-receive delay.

``FakeCore`` is a ``lifecycle.CoreBase`` whose model is ``FakeRunner``: which
words each running stream draws at a step, at the set rate. Everything else is
the model cores' own: the lifecycle takes add / abort / pause, ends turns and
keeps their KV handles, and the output processor (``output.py``) turns each
draw into its output (a byte detokenizer over the words, stop strings, the
length limit, logprobs, a turn with tools split into content and calls). Token
``i`` of a turn is always the same word, so a turn taken over from the token
log continues the same text. The context never runs out. Finished and paused
turns keep a nominal KV handle (token ids only) so resume and next-turn cache
hits look like the real engine's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from wsinfer.engine.detokenizer import ByteDetokenizer, Detokenizer
from wsinfer.engine.fake_spec import FakeSpec
from wsinfer.engine.lifecycle import CoreBase, EngineConfig
from wsinfer.engine.logprobs import TokenLogprob
from wsinfer.engine.lru import LRUBacked, RetainedLRU
from wsinfer.engine.output import OutputProcessor
from wsinfer.engine.requests import EngineRequest, RequestOutput, Sequence
from wsinfer.sessions.schema import TurnError
from wsinfer.tool_formats import format_for_template

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


class FakeWords:
    """The fake model's vocabulary: token ``i`` is the word ``WORDS[i % 8]``, or with
    ``stamp`` set (``fake:RATE:stamp``) the time of the step that drew it."""

    def __init__(self) -> None:
        self.stamp: str | None = None

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (its word), for logprobs entries."""
        return WORDS[token % len(WORDS)].encode()

    def piece(self, token: int) -> bytes:
        return self.stamp.encode() if self.stamp is not None else self.token_bytes(token)

    def new(self, context_ids: list[int], stop: tuple[str, ...] | list[str]) -> Detokenizer:
        """A turn's detokenizer (``output.MakesDetokenizers``)."""
        return ByteDetokenizer(self.piece, stop)


@dataclass(eq=False)
class FakeSequence(Sequence):
    started: float = 0.0  # monotonic time of add(): token k is due at started + k / rate
    emitted: int = 0  # tokens produced since add()


class FakeRunner:
    """The fake model: what each running stream draws at a step, at the spec's rate."""

    def __init__(self, spec: FakeSpec) -> None:
        self.spec = spec
        self.last_step = 0.0  # monotonic time of the last step that gave tokens

    def step_due(self, seqs: list[FakeSequence], woken: bool) -> bool:
        """Sleep until the next step is due (a real step takes time too): no busy loop.

        At a finite rate the core steps as a real one does, its whole batch at
        once, at most every 1/rate s: each running stream gets what is due by
        then. Stepping whenever any one stream had a token due made 200
        streams at 20 tokens/s 4,000 one-token steps a second, and the engine
        process's per-step work, not the relay, the cost being measured.
        False: woken early (the process polls controls between steps); ``woken``:
        aborts came, which step at once."""
        if not seqs or math.isinf(self.spec.tokens_per_s) or woken:
            return True
        rate = self.spec.tokens_per_s
        first = min(s.started + (s.emitted + 1) / rate for s in seqs)
        delay = max(first, self.last_step + 1 / rate) - time.monotonic()
        if delay <= 0:
            return True
        time.sleep(min(delay, 0.01))
        return delay <= 0.01

    def draws(self, seq: FakeSequence, now: float) -> tuple[list[int], list[TokenLogprob | None]]:
        """``seq``'s tokens due by ``now`` (at most ``MAX_TOKENS_PER_STEP``), and their
        log-probabilities where it asked: the fake model is sure of every word
        (log-probability 0, no alternative)."""
        rate = self.spec.tokens_per_s
        due = seq.emitted + 1 if math.isinf(rate) else int((now - seq.started) * rate)
        n = max(0, min(due - seq.emitted, MAX_TOKENS_PER_STEP))
        seq.emitted += n
        tokens = [(seq.num_generated + k) % len(WORDS) for k in range(n)]
        params = seq.request.params
        if not params.logprobs:
            return tokens, [None] * n
        return tokens, [
            TokenLogprob(t, 0.0, ((t, 0.0),) if params.top_logprobs else ()) for t in tokens
        ]


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


def _nominal_bytes(token_ids: list[int]) -> int:
    return len(token_ids) * FAKE_KV_BYTES_PER_TOKEN


class FakeCore(CoreBase):
    no_grammar = "the fake model cannot follow a response_format"  # its words follow none

    def __init__(
        self, spec: FakeSpec, *, max_batch_size: int = 16, kv_cache_bytes: int = 2 << 30
    ) -> None:
        self.spec = spec
        self.max_batch_size = max_batch_size
        self.words = FakeWords()
        loaded = FakeLoaded(name="fake")
        # Its tokenizer has no chat template: tool calls in the default format.
        tool_format = format_for_template(None)
        output = OutputProcessor(
            (), loaded.max_context, self.words.token_bytes, self.words, tool_format
        )
        config = EngineConfig(max_batch_size=max_batch_size, kv_cache_bytes=kv_cache_bytes)
        super().__init__(loaded, config, output)
        self.store = _FakeStore(kv_cache_bytes)
        self.runner = FakeRunner(spec)
        self._woken = False  # this step ended aborts: it runs at once

    @property
    def num_running(self) -> int:
        return min(len(self._seqs), self.max_batch_size)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self._seqs) - self.max_batch_size)

    # --- the step (``CoreBase.step``) ------------------------------------------------

    def _forward(self) -> list[RequestOutput]:
        """Each running stream's due words, one output each (``_accept_tokens``)."""
        seqs: list[FakeSequence] = list(self._seqs.values())  # admission order
        if not self.runner.step_due(seqs, self._woken):
            return []
        now = self.runner.last_step = time.monotonic()
        self.words.stamp = f" {time.time_ns() // 1000}" if self.spec.stamp else None
        outputs = []
        for seq in seqs[: self.max_batch_size]:
            tokens, logprobs = self.runner.draws(seq, now)
            if tokens:
                outputs.append(self._accept_tokens(seq, tokens, logprobs))
        return outputs

    def _process_aborts(self) -> list[RequestOutput]:
        self._woken = bool(self._aborts)
        return super()._process_aborts()

    def _fail_all(self, message: str) -> list[RequestOutput]:
        return self._faulted(list(self._seqs.values())[: self.max_batch_size], message)

    # --- admission -------------------------------------------------------------------

    def _sequence_type(self) -> type[Sequence]:
        return FakeSequence

    def _validate(self, request: EngineRequest) -> TurnError | None:
        return None  # any prompt, the empty one too: its context never runs out

    def _enqueue(self, seq: FakeSequence) -> None:
        seq.started = time.monotonic()
        seq.cached_tokens = self._reuse(seq.request)

    # --- the nominal KV cache ------------------------------------------------------------

    def _retain(self, seq: FakeSequence) -> int | None:
        key = seq.request.cache_key
        if key is None:
            return None
        tokens = list(seq.tokens)
        return len(tokens) if self.store.put(key, tokens) else None

    def _remove(self, seq: FakeSequence) -> None:
        self._seqs.pop(seq.id, None)

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
