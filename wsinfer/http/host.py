"""What the route groups that ``HttpApp`` holds need of it, as a protocol.

``ManyChoices`` (``choices.py``) and ``ResponsesRoutes``
(``responses_routes.py``) run their turns on the app's peers and answer as its
routes do. Typed by ``RouteHost`` rather than ``HttpApp``, they do not import
``app.py``, which imports them: no import circle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

from wsinfer.http.connection import HttpResponse

if TYPE_CHECKING:
    from wsinfer.http.openai import Completion
    from wsinfer.http.peer import HttpPeer
    from wsinfer.services import FrontendServices

# A route: called with the request and the path's named groups.
Handler = Callable[..., Awaitable[HttpResponse]]


class RouteHost(Protocol):
    """``HttpApp``'s peers, answers and event streams, for the routes it holds."""

    @property
    def frontend(self) -> FrontendServices: ...

    def open_peer(self) -> HttpPeer: ...

    def close_peer(self, peer: HttpPeer) -> None: ...

    async def created(self, session: str, turn: int) -> int: ...

    async def answer(
        self, peer: HttpPeer, completion: Completion, asked_logprobs: bool = False
    ) -> dict[str, Any]: ...

    def sse_answer(
        self,
        events: AsyncIterator[bytes],
        headers: list[tuple[str, str]],
        cleanup: Callable[[], None],
    ) -> HttpResponse: ...

    async def close_session(self, session: str, token: str) -> None: ...
