"""The Responses API routes: ``/v1/responses`` over the HTTP door's session operations.

Each route runs what the chat-completions routes run (an ``HttpPeer``: the
connection protocol's exactly-once delivery by ``seq``, and ``Handlers`` for
every Redis operation); ``responses.py`` names, shapes and numbers what they
send. A response is a (session, turn) and its id carries the session's
token, so every route answers from Redis alone, on any frontend.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from wsinfer.contract import ClientMessageType, PausedMessage, ServerMessage, TurnStatus
from wsinfer.errors import TooLarge
from wsinfer.http.connection import HttpRequest, HttpResponse
from wsinfer.http.openai import (
    SESSION_HEADER,
    SSE_KEEPALIVE,
    TURN_HEADER,
    bad_request,
    ignored_headers,
    sse_comment,
    turn_error,
)
from wsinfer.http.peer import CONTROL_WAIT_S, KEEPALIVE_S, HttpPeer
from wsinfer.http.responses import (
    Output,
    ResponseEvents,
    ResponseId,
    ResponseRequest,
    ResponseView,
    live_status,
    not_found,
    parse_response_request,
    sse_events,
    streamed_calls,
)
from wsinfer.messages import Resume, SessionCommand, done_message
from wsinfer.sessions.schema import DeltaEvent, DoneEvent, GenerationParams
from wsinfer.sessions.store import SessionInfo, SessionNotFound

if TYPE_CHECKING:
    from wsinfer.http.host import Handler, RouteHost


class ResponsesRoutes:
    def __init__(self, app: RouteHost) -> None:
        self.app = app
        self.frontend = app.frontend

    def routes(self) -> list[tuple[re.Pattern[str], dict[str, Handler]]]:
        one = r"/v1/responses/(?P<response_id>[^/]+)"
        return [
            (re.compile(r"/v1/responses"), {"POST": self.create}),
            (re.compile(one), {"GET": self.retrieve, "DELETE": self.delete}),
            (re.compile(one + "/cancel"), {"POST": self.cancel}),
        ]

    # --- routes -----------------------------------------------------------------------

    async def create(self, request: HttpRequest) -> HttpResponse:
        config = self.frontend.config
        ask = parse_response_request(request.body, config.limits, config.model_name)
        peer, view, status = await self.start(ask)
        headers = [*_headers(view.rid), *ignored_headers(ask.ignored)]
        if ask.stream:
            stream = self._sse(peer, ResponseEvents(view, -1), status)
            return self.app.sse_answer(stream, headers, lambda: self.app.close_peer(peer))
        if ask.background:  # answered at once; the turn runs on, unwatched
            self.app.close_peer(peer)
            return HttpResponse.json(200, view.body(status, None), headers)
        try:
            return await self._whole(peer, view, headers)
        finally:
            self.app.close_peer(peer)

    async def start(self, ask: ResponseRequest) -> tuple[HttpPeer, ResponseView, str]:
        """Start the response's turn on a peer of its own, which follows it: the peer
        (the caller closes it), the response's view and its status as started."""
        if ask.previous is not None and not await self._is_latest(ask.previous):
            ask = await self._branch(ask, ask.previous)
        peer = self.app.open_peer()
        try:
            await peer.handlers.handle(ask.generate)
            accepted = peer.accepted()
            rid = ResponseId(accepted["session"], accepted["turn"], accepted["token"])
            if ask.background:  # before the POST's own follower can leave
                await self.frontend.store.keep_running(rid.session, rid.token, rid.turn)
            created = await self.app.created(rid.session, rid.turn)
        except BaseException:
            self.app.close_peer(peer)
            raise
        view = ResponseView(
            rid, self.frontend.config.model_name, created, ask.generate.params,
            ask.instructions, ask.background, ask.metadata,
        )  # fmt: skip
        return peer, view, live_status(accepted["status"])

    async def retrieve(self, request: HttpRequest, response_id: str) -> HttpResponse:
        rid = ResponseId.parse(response_id)
        if request.query.get("stream", "").lower() in ("1", "true"):
            return await self._resume(request, rid)
        info = await self.info(rid)
        return HttpResponse.json(200, await self._snapshot(rid, info), _headers(rid))

    async def cancel(self, request: HttpRequest, response_id: str) -> HttpResponse:
        """Stop the turn (a finished one stays as it is) and answer the response."""
        rid = ResponseId.parse(response_id)
        info = await self.info(rid)
        if rid.turn == info.turn and info.status != TurnStatus.DONE.value:
            stop = SessionCommand(ClientMessageType.STOP, None, rid.session, rid.token)
            peer = self.app.open_peer()
            try:
                await peer.handlers.handle(stop)
                await peer.outcome(CONTROL_WAIT_S)
            finally:
                self.app.close_peer(peer)
            info = await self.info(rid)
        return HttpResponse.json(200, await self._snapshot(rid, info), _headers(rid))

    async def delete(self, request: HttpRequest, response_id: str) -> HttpResponse:
        """Close the response's session: every response of the conversation goes with it."""
        rid = ResponseId.parse(response_id)
        await self.info(rid)
        await self.app.close_session(rid.session, rid.token)
        return HttpResponse.json(200, {"id": str(rid), "object": "response", "deleted": True})

    # --- streams ----------------------------------------------------------------------

    async def _resume(self, request: HttpRequest, rid: ResponseId) -> HttpResponse:
        after = _starting_after(request.query.get("starting_after"))
        peer, events, status = await self.follow(rid, after)
        stream = self._sse(peer, events, status)
        return self.app.sse_answer(stream, _headers(rid), lambda: self.app.close_peer(peer))

    async def follow(self, rid: ResponseId, after: int) -> tuple[HttpPeer, ResponseEvents, str]:
        """A peer following the response from its events after ``after``, then live:
        the turn resumed from the seq that number maps to (a paused turn goes on)."""
        info = await self.info(rid)
        events = ResponseEvents(await self._view(rid, info), after)
        peer = self.app.open_peer()
        try:
            await peer.handlers.handle(
                Resume(None, rid.session, rid.token, events.seq_after, rid.turn)
            )
        except BaseException:
            self.app.close_peer(peer)
            raise
        status = live_status(info.status) if rid.turn == info.turn else "in_progress"
        return peer, events, status

    async def _sse(
        self, peer: HttpPeer, events: ResponseEvents, status: str
    ) -> AsyncIterator[bytes]:
        async for out in self.stream(peer, events, status):
            if out is None:
                yield SSE_KEEPALIVE
            elif isinstance(out, list):
                yield sse_events(out)
            else:  # a comment: the stream stays open and goes on when resumed
                yield sse_comment(f"paused at seq {out['seq']}")

    async def stream(
        self, peer: HttpPeer, events: ResponseEvents, status: str
    ) -> AsyncIterator[list[dict[str, Any]] | PausedMessage | None]:
        """What a follower of the response is sent, for either door to encode: its
        events, the turn's ``paused`` (no Responses event says it), or None after
        ``KEEPALIVE_S`` of silence. It ends after the response's last event."""
        opening = events.opening_events(status)
        if opening:
            yield opening
        while True:
            messages = await peer.messages(KEEPALIVE_S)
            if not messages:
                yield None
            for message in messages:
                if message["type"] == "paused":
                    yield message
                    continue
                out = await self._events_for(events, message)
                if out:
                    yield out
                if message["type"] in ("done", "error"):
                    return

    async def _events_for(
        self, events: ResponseEvents, message: ServerMessage
    ) -> list[dict[str, Any]]:
        if message["type"] == "delta":
            calls, parts = message.get("tool_calls"), message.get("tool_call_parts")
            if parts:  # a resumed reader: were its calls shown?
                await self._read_before(events)
            text, lps = message["text"], message.get("logprobs")
            return events.delta_events(message["seq"], text, lps, calls, parts)
        if message["type"] == "done":
            return events.closing_events(message, await self._read_before(events))
        if message["type"] == "error":  # the follow failed (a refusal): OpenAI's error ends it
            return [events.error_event(message["code"], message["message"])]
        return []

    async def _whole(
        self, peer: HttpPeer, view: ResponseView, headers: list[tuple[str, str]]
    ) -> HttpResponse:
        """Wait for the turn's ``done`` (through pauses: a paused turn may be resumed)."""
        text: list[str] = []
        logprobs: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        while True:
            for message in await peer.messages(KEEPALIVE_S):
                if message["type"] == "delta":
                    text.append(message["text"])
                    logprobs += message.get("logprobs") or ()
                    calls += message.get("tool_calls") or ()
                elif message["type"] == "done" and message["finish_reason"] == "error":
                    raise turn_error(message)
                elif message["type"] == "done":
                    body = view.body("completed", "".join(text), message, logprobs, calls)
                    return HttpResponse.json(200, body, headers)

    # --- reads ------------------------------------------------------------------------

    async def info(self, rid: ResponseId) -> SessionInfo:
        """The session, if the id's token opens it and it has the turn (else 404)."""
        try:
            info = await self.frontend.store.info(rid.session, rid.token)
        except SessionNotFound:
            raise not_found() from None
        if rid.turn > info.turn:
            raise not_found()
        return info

    async def _is_latest(self, previous: ResponseId) -> bool:
        """Whether ``previous_response_id`` names its session's latest turn (which
        the next turn continues); 404 when it names nothing."""
        return previous.turn == (await self.info(previous)).turn

    async def _branch(self, ask: ResponseRequest, previous: ResponseId) -> ResponseRequest:
        """An earlier response of a conversation: a new session whose messages are
        the conversation up to it, then this input. Its prompt begins as that
        session's did, so the engine's prefix cache serves their shared KV."""
        store, history = self.frontend.store, []
        for turn in range(1, previous.turn + 1):
            _, record = await store.turn_record(previous.session, turn)
            if record is None or record.messages is None:
                raise not_found()  # expired meanwhile, or a raw-text session's turn
            events, _ = await store.read_turn(previous.session, turn)
            answer = "".join(e.model_text for e in events if isinstance(e, DeltaEvent))
            history += [*record.messages, {"role": "assistant", "content": answer}]
        messages = history + (ask.generate.messages or [])
        limits = self.frontend.config.limits
        size = sum(len(m["content"]) for m in messages)
        if len(messages) > limits.max_messages or size > limits.max_prompt_chars:
            raise TooLarge(f"the conversation up to {previous} and this input is too long")
        generate = dataclasses.replace(ask.generate, messages=messages, session=None, token=None)
        return dataclasses.replace(ask, generate=generate)

    async def _view(self, rid: ResponseId, info: SessionInfo) -> ResponseView:
        """The response's fixed fields, from the turn's record in Redis."""
        created, turn_input = await self.frontend.store.turn_record(rid.session, rid.turn)
        params = turn_input.params if turn_input else GenerationParams()
        messages = (turn_input.messages if turn_input else None) or []
        leading = messages[0] if messages else {}
        instructions = leading["content"] if leading.get("role") == "system" else None
        # Only the latest turn may be a running background one; earlier ones: not known.
        background = info.meta.seen_at > time.time() if rid.turn == info.turn else None
        model = self.frontend.config.model_name
        created = created or int(time.time())  # a turn started before this was recorded
        return ResponseView(rid, model, created, params, instructions, background)

    async def _snapshot(self, rid: ResponseId, info: SessionInfo) -> dict[str, Any]:
        """The response object as of now, from the turn's events in Redis."""
        view = await self._view(rid, info)
        events, _ = await self.frontend.store.read_turn(rid.session, rid.turn)
        out = _output_of(events, upto=None)
        done = next((e for e in reversed(events) if isinstance(e, DoneEvent)), None)
        if done is not None:
            message = done_message(rid.session, rid.turn, done)
            return view.body("completed", out.text, message, out.logprobs, out.calls)
        status = live_status(info.status) if rid.turn == info.turn else "in_progress"
        return view.body(status, out.text if events else None, None, out.logprobs, out.calls)

    async def _read_before(self, events: ResponseEvents) -> Output:
        """What ``events``' reader had before its stream, read once (``before``)."""
        if events.before is None:
            events.before = await self._output(events.view.rid, upto=events.seq_after)
        return events.before

    async def _output(self, rid: ResponseId, upto: int) -> Output:
        """The output of the turn's deltas up to seq ``upto``: what a resumed reader had."""
        if upto <= 0:
            return Output()
        events, _ = await self.frontend.store.read_turn(rid.session, rid.turn)
        return _output_of(events, upto)


def _output_of(events: list[Any], upto: int | None) -> Output:
    """The text, logprobs entries and calls of ``events``' deltas (up to seq ``upto``)."""
    deltas = [e for e in events if isinstance(e, DeltaEvent) and (upto is None or e.seq <= upto)]
    return Output(
        "".join(e.text for e in deltas),
        [x for e in deltas for x in e.logprobs or ()],
        [call for e in deltas for call in e.tool_calls or ()],
        streamed_calls([(e.text, e.tool_call_parts) for e in deltas]),
    )


def _headers(rid: ResponseId) -> list[tuple[str, str]]:
    """The session and turn, as every completion's answer names them (the token
    travels in the response id)."""
    return [(SESSION_HEADER, rid.session), (TURN_HEADER, str(rid.turn))]


def _starting_after(raw: str | None) -> int:
    """-1 (every event) when absent; else a sequence number we could have sent."""
    if raw is None or raw == "":
        return -1
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
        raise bad_request("starting_after must be a non-negative integer", "starting_after")
    return int(raw)
