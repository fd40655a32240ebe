"""The engine process: owns all I/O around an ``EngineCore``.

One loop, one thread: take turns from the Redis work queue, claim them, add
them to the core, step it, publish every step's events in one pipeline, and
act on stop/pause flags and idle sessions between steps. A turn whose engine
dies is taken over by another engine once its lease (the pending entry's idle
time in the consumer group) expires; the new engine rebuilds the turn from the
token log, so the client sees no gap and no duplicate.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog

from wsinfer.contract import ErrorCode
from wsinfer.engine.core import EngineConfig, EngineRequest, RequestOutput, build_core
from wsinfer.engine.cpu_threads import ThreadShare
from wsinfer.engine.defaults import default_dtype, resolve_device
from wsinfer.engine.fake import FakeLoaded, fake_engine
from wsinfer.engine.fake_spec import is_fake
from wsinfer.engine.lifecycle import Core, UnsupportedConfig
from wsinfer.engine.logprobs import wire_entries
from wsinfer.engine.metrics import EngineMetrics
from wsinfer.engine.model import LoadedModel, ModelLoadError, load_model
from wsinfer.engine.outage import OutageGuard
from wsinfer.engine.prompts import render_chat, render_text
from wsinfer.engine.requests import SequenceStatus, ToolCalls
from wsinfer.engine.standby import StandbyGate
from wsinfer.preflight import StartupError, require_redis, serve_metrics
from wsinfer.sessions.connect import sync_client
from wsinfer.sessions.schema import (
    DEFAULT_SESSION_TTL_S,
    Control,
    DeltaEvent,
    DoneEvent,
    PausedEvent,
    TurnError,
    TurnEvent,
    Usage,
)
from wsinfer.sessions.scripts import Reply
from wsinfer.sessions.worker import (
    ClaimedTurn,
    PendingPublish,
    Publish,
    PublishResult,
    TurnHistory,
    WorkerStore,
    WorkItem,
)

log = structlog.get_logger("wsinfer.engine")


@dataclass
class ProcessConfig:
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:8]}")
    max_batch_size: int = 16
    lease_ms: int = 10_000  # a turn whose engine is silent this long is taken over
    heartbeat_s: float = 1.0
    # How often the heartbeat carries the engine's metrics to Redis (rendering them:
    # 0.6 ms and 11 KB, measured on an Intel Xeon).
    metrics_publish_s: float = 5.0
    idle_pause_s: float = 60.0  # pause a turn nobody has watched for this long
    # --session-ttl: the registry's and queues' lifetime, and the sessions' for
    # those that recorded none (each session records the TTL it was created with).
    session_ttl_s: int = DEFAULT_SESSION_TTL_S
    poll_interval_s: float = 0.05
    idle_block_ms: int = 1000
    drain: bool = False  # exit once there is no more work (tests, batch jobs)
    # SIGTERM: take no new turns, finish running ones for up to this long, then
    # hand the rest to the other engines at once (a rolling restart).
    drain_grace_s: float = 30.0
    exit_with_parent: bool = False
    metrics_port: int | None = None  # serve /metrics here (0: any free port)
    metrics_host: str = "127.0.0.1"


@dataclass
class ActiveTurn:
    session: str
    turn: int
    epoch: int
    work: WorkItem
    prompt_tokens: int
    seq: int = 0
    announced: bool = False  # prompt_tokens recorded in the session meta
    published: int = 0  # publishes Redis took since the claim (makes a retry idempotent)
    # Monotonic time its control flag and last-watched time were last read:
    # each publish's reply carries both, so only turns that published nothing
    # for a poll interval (waiting for a batch slot, a long prefill) are polled.
    checked_at: float = 0.0
    idle_paused: bool = False  # the idle limit asked the core to pause it


class EngineProcess:
    def __init__(
        self,
        core: Core,
        loaded: LoadedModel | FakeLoaded,
        store: WorkerStore,
        config: ProcessConfig,
        metrics: EngineMetrics | None = None,
        threads: ThreadShare | None = None,
    ) -> None:
        self.core = core
        self.threads = threads  # a CPU engine's: as many as the machine leaves it
        self.loaded = loaded
        self.store = store
        self.config = config
        self.metrics = metrics or EngineMetrics(engine_id=config.engine_id)
        self.metrics.attach(core, loaded.name, str(loaded.device), config.max_batch_size)
        self.active: dict[str, ActiveTurn] = {}
        self.discard: set[str] = set()  # aborted because the turn is no longer ours
        self._stopping = False
        self._drain_deadline: float | None = None  # set by SIGTERM
        self._parent = os.getppid()
        self._next_heartbeat = 0.0
        self._next_metrics = 0.0
        self._next_takeover = 0.0
        self._next_poll = 0.0
        self._guard = OutageGuard(config.engine_id, store.ensure_group)
        # Publishing overlaps the next step: a step's call is sent, and its
        # replies read after the next step is computed (Redis writes while the
        # engine computes). ``_outbox``: the publishes sent or to send again,
        # until Redis answers them; ``_pending``: their call in flight;
        # ``_unpublished``: a step computed while an outage held up the one before.
        self._outbox: list[tuple[str, Publish]] = []
        self._pending: PendingPublish | None = None
        self._unpublished: list[RequestOutput] = []

    # --- lifecycle --------------------------------------------------------------

    def run(self) -> None:
        self.store.ensure_group()
        signal.signal(signal.SIGTERM, self._request_stop)
        signal.signal(signal.SIGINT, self._request_stop)
        log.info("engine ready", engine=self.config.engine_id, model=self.loaded.name)
        try:
            # The drain deadline and the parent are checked outside the outage guard:
            # a serve killed with -9 takes its Redis along and SIGTERMs its engine,
            # which must then end on time rather than wait for Redis forever.
            while not self._stopping and not self._drained() and not self._orphaned():
                if self._guard.run(self._iteration) is False:
                    break
        finally:
            # Unfinished turns go back to the shared queue: another engine
            # claims each at once and continues it from the token log, without
            # waiting for a lease to run out. If Redis is gone too, the leases
            # expire and the same happens later.
            try:
                self._collect()  # the last step's replies: its finished turns are done
                held = [(t.work, t.epoch) for r, t in self.active.items() if r not in self.discard]
                self.store.release(held)
                self.store.deregister()
            except redis.RedisError:  # Redis went first; our heartbeat will just age out
                log.warning("could not deregister", engine=self.config.engine_id)
            log.info("engine stopped", engine=self.config.engine_id, left=len(self.active))

    def _request_stop(self, signum: int = signal.SIGINT, *_: Any) -> None:
        if signum == signal.SIGTERM and self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.config.drain_grace_s
            log.info("draining", engine=self.config.engine_id, running=len(self.active))
        else:  # Ctrl-C, or a second SIGTERM: hand everything over now
            self._stopping = True

    def _orphaned(self) -> bool:
        if self.config.exit_with_parent and os.getppid() != self._parent:
            log.warning("parent process gone; exiting")
            return True
        return False

    def _drained(self) -> bool:
        """Draining and either nothing runs any more or the grace period is over."""
        if self._drain_deadline is None:
            return False
        return not self.active or time.monotonic() >= self._drain_deadline

    def _iteration(self) -> bool:
        now = time.monotonic()
        if self.threads is not None:
            self.threads.look()
        if now >= self._next_heartbeat:
            self._heartbeat(now)
        if self._drained():
            return False
        draining = self._drain_deadline is not None
        if now >= self._next_takeover and not draining:
            self._next_takeover = now + self.config.lease_ms / 2000
            self._admit(self.store.take_over_expired(self.config.lease_ms, self._capacity()), True)
        busy = self.core.has_unfinished() or self._pending is not None
        block = None if busy else self.config.idle_block_ms
        if self._capacity() > 0 and not draining:
            self._admit(self.store.read_work(self._capacity(), block), False)
        if self._unpublished or (self._outbox and self._pending is None):
            self._catch_up()  # an outage stopped publishing: never step past it
        elif self.core.has_unfinished():
            self._poll_controls()
            self._step()
        else:
            self._collect()
        return not (self.config.drain and not busy and not self.core.has_unfinished())

    def _heartbeat(self, now: float) -> None:
        self._next_heartbeat = now + self.config.heartbeat_s
        metrics = None
        if now >= self._next_metrics:  # for the frontends' /metrics: one scrape sees all
            self._next_metrics = now + self.config.metrics_publish_s
            metrics = self.metrics.render()
        self.metrics.queued.set(self.store.heartbeat(metrics))
        self.store.renew_leases([turn.work for turn in self.active.values()])

    def _capacity(self) -> int:
        return max(0, self.config.max_batch_size - len(self.active))

    # --- taking work -------------------------------------------------------------

    def _admit(self, items: list[WorkItem], takeover: bool) -> None:
        for item in items:
            claimed = self.store.claim(item.request, takeover=takeover)
            if claimed is None:
                self.store.ack(item)  # stale or duplicate: nothing to run
                continue
            if f"{claimed.session}:{claimed.turn}" in self.active:
                self._reclaimed(item, claimed)
                continue
            try:
                self._start(item, claimed, takeover)
            except Exception as exc:  # a broken turn must not take the engine down
                log.exception("cannot start turn", session=claimed.session, turn=claimed.turn)
                self._fail(item, claimed, exc)

    def _reclaimed(self, item: WorkItem, claimed: ClaimedTurn) -> None:
        """Our own running turn, taken over by us after Redis was unreachable
        longer than the lease: carry on under the new claim. Had Redis lost our
        last publishes, the next one reports a gap and the turn is rebuilt."""
        turn = self.active[f"{claimed.session}:{claimed.turn}"]
        turn.epoch, turn.work = claimed.epoch, item

    def _start(self, item: WorkItem, claimed: ClaimedTurn, takeover: bool = False) -> None:
        session, turn = claimed.session, claimed.turn
        history = self.store.load_history(session, turn)
        prompt_ids = self.store.load_prompt(session, turn)
        if prompt_ids is None:
            prompt_ids = self._render(history)
            self.store.save_prompt(claimed, prompt_ids)
        published = self.store.read_published(session, turn)
        generated, seq = published.ids, published.seq
        request_id = f"{session}:{turn}"
        active = ActiveTurn(session, turn, claimed.epoch, item, len(prompt_ids), seq)
        params = history.current.params
        if published.ended_at:  # continued past an end by length: as many tokens again
            budget = published.ended_at + params.max_new_tokens
            params = dataclasses.replace(params, max_new_tokens=budget)
        # A turn with tools: the core splits its text into content and calls.
        calls = ToolCalls(f"call_{session}_{turn}", published.text) if params.calls_tools else None
        self.active[request_id] = active
        self.core.add(
            EngineRequest(
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                generated_ids=generated,
                cache_key=session,
                released=published.ended_at > 0,
                tool_calls=calls,
            )
        )
        self._abort_if_asked(request_id, claimed.control)
        context = len(prompt_ids) + len(generated)
        self.metrics.turn_started(
            request_id, context_tokens=context, resumed_at=seq, takeover=takeover
        )
        # A takeover is rare and worth a look; a resumed or next turn is not one.
        flag = {"takeover": True} if takeover else {}
        log.info(
            "turn started",
            session=session,
            turn=turn,
            resumed_at=seq,
            prompt_tokens=len(prompt_ids),
            **flag,
        )

    def _render(self, history: TurnHistory) -> list[int]:
        tokenizer = self.loaded.tokenizer
        current = history.current
        if current.mode == "text":
            return render_text(tokenizer, current.prompt or "", history.previous_ids)
        messages: list[dict[str, Any]] = []
        for said, answer in history.chat_turns:
            messages += said + [{"role": "assistant", "content": answer}]
        tools = current.params.tools if current.params.calls_tools else None
        return render_chat(tokenizer, messages + (current.messages or []), tools)

    def _fail(self, item: WorkItem, claimed: ClaimedTurn, exc: Exception) -> None:
        seq = claimed.meta.seq
        # A missing input means the session expired under the turn: the
        # client's mistake to wait that long, not our fault.
        if isinstance(exc, LookupError):
            error = TurnError(ErrorCode.NOT_FOUND, "the session expired")
        else:
            error = TurnError(ErrorCode.INTERNAL, "engine could not start the turn")
        done = DoneEvent(seq, "error", Usage(completion_tokens=seq), error)
        self.store.publish_many(
            [Publish(claimed.session, claimed.turn, claimed.epoch, seq, [done])]
        )
        self.store.ack(item)
        self.active.pop(f"{claimed.session}:{claimed.turn}", None)
        self.metrics.forget(f"{claimed.session}:{claimed.turn}")
        self.metrics.finished.labels(finished_reason="error").inc()

    # --- between steps -------------------------------------------------------------

    def _poll_controls(self) -> None:
        now = time.monotonic()
        if now < self._next_poll or not self.active:
            return
        self._next_poll = now + self.config.poll_interval_s
        stale = now - self.config.poll_interval_s
        turns = {
            (t.session, t.turn): rid
            for rid, t in self.active.items()
            if rid not in self.discard and t.checked_at <= stale
        }
        if not turns:  # every turn published within the interval: its reply said it all
            return
        states = self.store.poll(list(turns))
        wall = time.time()
        for key, request_id in turns.items():
            if key not in states:  # session closed or replaced: drop it and its cache
                self._drop(request_id, forget_cache=True)
                continue
            control, seen_at = states[key]
            self._apply_control(request_id, control, seen_at, wall)

    def _apply_control(
        self, request_id: str, control: Control, seen_at: float, wall: float
    ) -> None:
        """Act on a turn's control flag (stop, pause) or on nobody watching it."""
        turn = self.active[request_id]
        turn.checked_at = time.monotonic()
        if self._abort_if_asked(request_id, control):
            return
        if wall - seen_at > self.config.idle_pause_s and not turn.idle_paused:
            turn.idle_paused = True
            log.info("pausing idle turn", session=turn.session, turn=turn.turn)
            self.core.abort(request_id, pause=True)

    def _abort_if_asked(self, request_id: str, control: Control) -> bool:
        """End the request if its flag asks: a stop, or a pause that keeps its KV."""
        if control not in (Control.STOP, Control.PAUSE):
            return False
        self.core.abort(request_id, pause=control == Control.PAUSE)
        return True

    def _drop(self, request_id: str, *, forget_cache: bool = False, ack: bool = True) -> None:
        self.discard.add(request_id)
        self.core.abort(request_id)
        turn = self.active[request_id]
        if ack:  # never after a takeover: the entry now belongs to the new engine
            self.store.ack(turn.work)
        if forget_cache:
            self.core.drop_cache(turn.session)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.core.step()
            self.metrics.step(outputs, time.perf_counter() - started)
        except Exception as exc:
            # A fault in the model must end its turns with an error the client
            # sees, not hang them: fail everything running and carry on.
            log.exception("engine step failed", active=len(self.active))
            outputs = [self._crashed_output(rid, exc) for rid in list(self.active)]
            for request_id in list(self.active):
                self.core.abort(request_id)
            self.core.step()  # flush the aborts
        self._unpublished = outputs
        self._collect()  # the previous step's replies; an outage raises, keeping both
        self._publish(self._unpublished)

    def _crashed_output(self, request_id: str, exc: Exception) -> RequestOutput:
        turn = self.active[request_id]
        return RequestOutput(
            request_id=request_id,
            new_token_ids=[],
            text="",
            num_generated=turn.seq,
            status=SequenceStatus.FINISHED,
            finish_reason="error",
            error=TurnError(ErrorCode.INTERNAL, f"engine fault: {exc}"),
        )

    # --- publishing ------------------------------------------------------------------

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Send a step's outputs to Redis; ``_collect`` reads the replies."""
        publishes: list[tuple[str, Publish]] = []
        for out in outputs:
            if out.request_id in self.discard:
                self._forget(out.request_id)
                continue
            turn = self.active.get(out.request_id)
            if turn is not None:
                publishes.append((out.request_id, self._to_publish(turn, out)))
        self._unpublished = []
        if publishes:
            self._outbox = publishes
            self._pending = self.store.publish_start([p for _, p in publishes])

    def _collect(self) -> None:
        """Act on the replies to the call in flight, if any. An outage raises
        and leaves the outbox to be sent again (the script takes a repeat once)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        results = pending.result()
        outbox, self._outbox = self._outbox, []
        wall = time.time()
        for (request_id, item), result in zip(outbox, results, strict=True):
            self._after_publish(request_id, item, result, wall)

    def _catch_up(self) -> None:
        """After an outage: the publishes Redis has not answered, then the step
        computed meanwhile, each waited for, before the engine steps again."""
        if self._outbox and self._pending is None:
            self._pending = self.store.publish_start([p for _, p in self._outbox])
        self._collect()
        if self._unpublished:
            self._publish(self._unpublished)
            self._collect()

    def _to_publish(self, turn: ActiveTurn, out: RequestOutput) -> Publish:
        events: list[TurnEvent] = []
        if out.new_token_ids or out.text or out.raw is not None:
            logprobs = wire_entries(out.logprobs, self.core.token_bytes) if out.logprobs else None
            events.append(_delta(out, list(out.new_token_ids), logprobs))
        fields: dict[str, Any] = {"pub": turn.published + 1}
        if not turn.announced:
            fields["prompt_tokens"] = turn.prompt_tokens
        if_stopped = None
        if out.status.ended:
            events.append(_final_event(out))
            cached = out.usage.cached_tokens if out.usage else 0
            fields["kv_engine"] = self.config.engine_id if out.kv_len else ""
            fields["kv_len"] = out.kv_len or 0
            # Kept for a stop that ends the turn later without the engine (paused, then stopped).
            fields["cached_tokens"] = cached
            if out.paused:  # what the pause becomes if the client's stop got there first
                usage = Usage(turn.prompt_tokens, out.num_generated, cached)
                if_stopped = DoneEvent(out.num_generated, "cancelled", usage)
        prev_seq, turn.seq = turn.seq, out.num_generated
        return Publish(
            turn.session,
            turn.turn,
            turn.epoch,
            out.num_generated,
            events,
            fields,
            prev_seq,
            if_stopped,
        )

    def _after_publish(
        self, request_id: str, item: Publish, result: PublishResult, wall: float
    ) -> None:
        turn = self.active.get(request_id)
        if turn is None:  # handed back meanwhile (a drain's release)
            return
        turn.announced = True
        turn.published += 1
        outcome = result.outcome
        if outcome != Reply.OK:
            # fenced (taken over), not_found (closed) or illegal: stop running it.
            log.warning("turn lost", session=turn.session, turn=turn.turn, outcome=outcome)
            self.metrics.forget(request_id)
            if item.final_action is None:
                gone = outcome == Reply.NOT_FOUND
                # A gap (Redis lost our last writes in a failover) is not
                # acked either: the lease runs out and the turn is rebuilt
                # from what the token log really holds.
                keep = outcome in (Reply.FENCED, Reply.GAP)
                self._drop(request_id, forget_cache=gone, ack=not keep)
            else:
                self._forget(request_id)
            return
        if item.final_action is not None:
            self.store.ack(turn.work)
            cached = int(item.fields.get("cached_tokens", 0))
            self.metrics.turn_ended(request_id, item.events[-1], cached)
            self._forget(request_id)
        else:
            self._apply_control(request_id, result.control, result.seen_at, wall)

    def _forget(self, request_id: str) -> None:
        self.active.pop(request_id, None)
        self.discard.discard(request_id)


def _delta(
    out: RequestOutput, tokens: list[int], logprobs: list[dict[str, Any]] | None
) -> DeltaEvent:
    """The delta of ``out``: for a turn with tools, the content and completed calls the
    core split out of it, with what the model wrote where that differs."""
    return DeltaEvent(
        out.num_generated,
        out.text,
        tokens,
        logprobs=logprobs,
        raw=out.raw,
        tool_calls=out.tool_calls,
        tool_call_parts=out.tool_call_parts,
    )


def _final_event(out: RequestOutput) -> TurnEvent:
    if out.paused:
        return PausedEvent(out.num_generated)
    usage = out.usage or Usage(completion_tokens=out.num_generated)
    error = None
    if out.finish_reason == "error":  # the core chose the code where the error happened
        error = out.error or TurnError(ErrorCode.INTERNAL, "generation failed")
    return DoneEvent(out.num_generated, out.finish_reason or "stop", usage, error)


def run_engine(
    redis_url: str,
    model_spec: str | None,
    *,
    device: str = "cpu",
    dtype: str = "float32",
    config: ProcessConfig | None = None,
    core_config: EngineConfig | None = None,
    revision: str | None = None,
    chat_template: str | None = None,
    standby: StandbyGate | None = None,
) -> None:
    """Check Redis and the metrics port, load the model, then serve turns until stopped.

    Start-up problems raise ``StartupError`` before the (slow) model load. A
    ``standby`` engine waits, loaded, until it is activated (or told to stop)."""
    config = config or ProcessConfig()
    parent = os.getppid()
    require_redis(redis_url)  # before anything slow: one clear line if it is not there
    metrics = EngineMetrics(engine_id=config.engine_id)
    if config.metrics_port is not None:
        port = serve_metrics(metrics, config.metrics_host, config.metrics_port)
        log.info("engine metrics", url=f"http://{config.metrics_host}:{port}/metrics")
    core_config = core_config or EngineConfig(max_batch_size=config.max_batch_size)
    if not is_fake(model_spec):
        try:
            device = resolve_device(device)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        dtype = default_dtype(device, dtype)
    log.info("loading model", model=model_spec or "default", device=device, dtype=dtype)
    started = time.monotonic()
    core: Core
    loaded: LoadedModel | FakeLoaded
    if is_fake(model_spec):
        core, loaded = fake_engine(str(model_spec), core_config)
    else:
        try:
            loaded = load_model(
                model_spec,
                device=device,
                dtype=dtype,
                revision=revision,
                chat_template=chat_template,
            )
        except ModelLoadError as exc:
            raise StartupError(str(exc)) from None
    log.info("model loaded", model=loaded.name, seconds=round(time.monotonic() - started, 1))
    if isinstance(loaded, LoadedModel):
        started = time.monotonic()
        try:
            core = build_core(loaded, core_config)
        except UnsupportedConfig as exc:
            raise StartupError(str(exc)) from None
        log.info(
            "engine core ready",
            core=type(core).__name__,
            max_batch_size=core_config.max_batch_size,
            seconds=round(time.monotonic() - started, 1),
            graph_capture_seconds=round(core.stats().graph_capture_seconds, 1),
        )
    if standby is not None and not standby.wait(lambda: os.getppid() != parent):
        return
    store = WorkerStore(sync_client(redis_url), config.engine_id, ttl_s=config.session_ttl_s)
    threads = ThreadShare() if isinstance(loaded, LoadedModel) and device == "cpu" else None
    EngineProcess(core, loaded, store, config, metrics, threads).run()
