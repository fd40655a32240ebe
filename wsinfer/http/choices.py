"""``n`` choices of a chat or text completion: ``n`` sessions started alike,
answered and streamed as one completion (docs/protocol.md, chat completions).

Each choice is a turn of a session of its own, so everything a turn has (the
KV cache, pause, resume from any frontend by ``seq``) each choice has; what
this adds is starting them together, closing those started when a later one
is refused, and merging their answers and streams by choice index.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from wsinfer.contract import SessionMessage
from wsinfer.http.connection import HttpResponse
from wsinfer.http.openai import (
    SSE_DONE,
    SSE_KEEPALIVE,
    TOKEN_HEADER,
    ChatRequest,
    Completion,
    OpenAIError,
    bad_request,
    combined_usage,
    delta_chunk,
    failure,
    finish_reason_of,
    ignored_headers,
    openai_usage,
    sse,
    sse_comment,
    turn_headers,
)
from wsinfer.http.peer import KEEPALIVE_S, HttpPeer, merged_messages
from wsinfer.messages import Generate
from wsinfer.waiting import within

if TYPE_CHECKING:
    from wsinfer.http.host import RouteHost


class ManyChoices:
    def __init__(self, app: RouteHost) -> None:
        self.app = app

    async def complete(self, chat: ChatRequest, kind: type[Completion]) -> HttpResponse:
        """``n`` choices: ``n`` sessions started alike, answered as one completion. A
        seed is offset by the choice's index, so that choices differ and repeat."""
        if chat.generate.session is not None:
            raise bad_request("n > 1 starts a session per choice: it cannot continue one", "n")
        peers: list[HttpPeer] = []
        accepted: list[SessionMessage] = []
        try:
            for index in range(chat.n):
                peers.append(self.app.open_peer())
                await peers[-1].handlers.handle(_choice(chat.generate, index))
                accepted.append(peers[-1].accepted())
            created = await self.app.created(accepted[0]["session"], accepted[0]["turn"])
        except BaseException:
            for peer in peers:
                self.app.close_peer(peer)
            await self._forget(accepted)
            raise
        model = self.app.frontend.config.model_name
        first = kind(accepted[0]["session"], accepted[0]["turn"], model, created).id
        completions = [
            kind(a["session"], a["turn"], model, created, index=i, shared_id=first)
            for i, a in enumerate(accepted)
        ]
        tokens = ", ".join(a["token"] for a in accepted)
        headers = [(TOKEN_HEADER, tokens), *turn_headers(completions)]
        headers += ignored_headers(chat.ignored)

        readers: list[asyncio.Task[None]] = []  # a streamed answer's, one per choice

        def close() -> None:
            for reader in readers:  # the stream may end between two of its events
                reader.cancel()
            for peer in peers:
                self.app.close_peer(peer)

        if chat.stream:
            events = self._events(peers, completions, chat.include_usage, readers)
            return self.app.sse_answer(events, headers, close)
        logprobs = chat.generate.params.logprobs
        try:
            answers = await asyncio.gather(
                *(self.app.answer(p, c, logprobs) for p, c in zip(peers, completions, strict=True))
            )
        except OpenAIError as exc:  # a choice's turn failed: the answer names them all
            exc.extra.extend(headers)
            raise
        finally:
            close()
        whole = {**answers[0], "choices": [a["choices"][0] for a in answers]}
        whole["usage"] = combined_usage([a["usage"] for a in answers])
        return HttpResponse.json(200, whole, headers)

    async def _forget(self, accepted: list[SessionMessage]) -> None:
        """Close the sessions of a request refused after some of its choices started."""
        for started in accepted:
            with contextlib.suppress(Exception):  # the request's own refusal goes on
                await self.app.close_session(started["session"], started["token"])

    async def _events(
        self,
        peers: list[HttpPeer],
        completions: list[Completion],
        include_usage: bool,
        readers: list[asyncio.Task[None]],
    ) -> AsyncIterator[bytes]:
        """The chunks of ``n`` choices as they come, each with its index; the usage of
        all and ``[DONE]`` once every choice is done. Events carry no ``id``: one
        number cannot say where ``n`` streams are (each choice's session resumes on
        its own, ``GET /v1/sessions/{id}/stream``). ``readers`` gets the tasks that
        follow the choices, for the response's cleanup to cancel."""
        arrivals = merged_messages(peers, readers)
        usages: dict[int, dict[str, Any]] = {}
        try:
            for completion in completions:
                opening = completion.opening()
                if opening is not None:
                    yield sse(opening)
            while len(usages) < len(peers):
                try:
                    index, messages = await within(arrivals.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield SSE_KEEPALIVE
                    continue
                completion = completions[index]
                for message in messages:
                    failed = failure(message)
                    if failed is not None:
                        yield sse(failed.body()) + SSE_DONE
                        return
                    if message["type"] == "delta":
                        yield sse(delta_chunk(completion, message))
                    elif message["type"] == "paused":
                        yield sse_comment(f"choice {index} paused at seq {message['seq']}")
                    elif message["type"] == "done":
                        yield sse(completion.chunk({}, finish_reason_of(message)))
                        usages[index] = openai_usage(message["usage"])
            if include_usage:
                usage = combined_usage([usages[i] for i in range(len(peers))])
                yield sse(completions[0].usage_chunk(usage))
            yield SSE_DONE
        finally:
            for reader in readers:
                reader.cancel()


def _choice(generate: Generate, index: int) -> Generate:
    """Choice ``index``'s turn: its own seed where the request has one."""
    seed = generate.params.seed
    if index == 0 or seed is None:
        return generate
    params = dataclasses.replace(generate.params, seed=(seed + index) % 2**63)
    return dataclasses.replace(generate, params=params)
