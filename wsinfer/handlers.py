"""What each client request does: Redis operations plus protocol bookkeeping.

One method per message type. Errors are raised, never answered here: the
connection maps them to protocol errors in one place (``errors.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wsinfer.errors import NotFound, Overloaded
from wsinfer.messages import ClientMessage, Generate, Resume, SessionCommand
from wsinfer.sessions import keys
from wsinfer.sessions.schema import DeltaEvent
from wsinfer.sessions.states import IllegalTransition, Status
from wsinfer.sessions.store import TurnInput

if TYPE_CHECKING:
    from wsinfer.peer import Peer

MAX_FOLLOWED_PER_CONNECTION = 64


class Handlers:
    def __init__(self, conn: Peer) -> None:
        self.conn = conn
        self.frontend = conn.frontend
        self.store = conn.frontend.store
        self.protocol = conn.protocol

    async def handle(self, message: ClientMessage) -> None:
        if isinstance(message, Generate):
            await self.generate(message)
        elif isinstance(message, Resume):
            await self.resume(message)
        elif message.type == "close":
            await self.close(message)
        else:
            await self.control(message)

    async def generate(self, msg: Generate) -> None:
        self._check_follow_limit(msg.session)
        alive = await self.frontend.capacity.admit()
        turn_input = TurnInput(
            mode="chat" if msg.messages is not None else "text",
            messages=msg.messages,
            prompt=msg.prompt,
            params=msg.params,
        )
        if msg.session is None or msg.token is None:
            session, token = await self.store.create(turn_input)
            turn = 1
        else:
            session, token = msg.session, msg.token
            turn = await self.store.add_turn(session, token, turn_input, alive)
        self.frontend.metrics.turns.inc()
        self.conn.log.info("turn accepted", session=session, turn=turn)
        self.conn.started_turn(session, turn)
        self.protocol.accepted(msg.id, session, token, turn)
        self._subscribe(session, turn, "0-0")

    def _check_follow_limit(self, session: str | None) -> None:
        """Every way of following a new session (generate, resume, stop, pause) counts."""
        feeds = self.protocol.feeds
        if session not in feeds and len(feeds) >= MAX_FOLLOWED_PER_CONNECTION:
            raise Overloaded(f"a connection follows at most {MAX_FOLLOWED_PER_CONNECTION} sessions")

    async def resume(self, msg: Resume) -> None:
        self._check_follow_limit(msg.session)
        self.frontend.metrics.resumes.inc()
        info = await self.store.info(msg.session, msg.token)
        turn = msg.turn if msg.turn is not None else info.turn
        if turn > info.turn:
            raise NotFound(f"session has no turn {turn}")
        if turn == info.turn and info.status == Status.PAUSED.value:
            await self.store.control(msg.session, msg.token, turn, "resume")
        await self._replay_and_follow(msg.session, turn, msg.after)

    async def _replay_and_follow(self, session: str, turn: int, after: int) -> None:
        # Replay the history, then follow live from the last entry read, so
        # nothing falls between the two; anything sent twice is dropped by seq.
        # Watched from now on, not from the next touch tick: a running turn
        # must not be idle-paused under a client that has just come back.
        if await self.store.touch({session: turn}):
            raise NotFound("no such session (or wrong token)")
        self.protocol.follow(session, turn, after)
        try:
            events, last_id = await self.store.read_turn(session, turn)
        except Exception:  # Redis went away: do not leave a feed nothing feeds
            self.protocol.unfollow(session)
            self.frontend.fanin.unsubscribe((self.conn.id, session))
            raise
        replayed = sum(isinstance(e, DeltaEvent) and e.seq > after for e in events)
        self.frontend.metrics.replayed.inc(replayed)
        self.protocol.replay(session, turn, events)
        if session in self.protocol.feeds:  # not yet done
            self._subscribe(session, turn, last_id)

    async def control(self, msg: SessionCommand) -> None:
        info = await self.store.info(msg.session, msg.token)
        following = msg.session in self.protocol.feeds
        if not following:
            self._check_follow_limit(msg.session)
            # The requester sees the outcome (paused/done) like any follower.
            await self._replay_and_follow(msg.session, info.turn, info.seq)
        try:
            await self.store.control(msg.session, msg.token, info.turn, msg.type)
        except IllegalTransition as exc:
            if exc.current == Status.PAUSED.value and msg.type == "pause":
                if following:  # otherwise the replay just said so
                    self.protocol.notify_paused(msg.session, info.turn, info.seq)
            elif exc.current != Status.DONE.value:  # stopping a finished turn is a no-op
                raise

    async def close(self, msg: SessionCommand) -> None:
        await self.store.close(msg.session, msg.token)
        self.protocol.unfollow(msg.session)
        self.frontend.fanin.unsubscribe((self.conn.id, msg.session))

    def _subscribe(self, session: str, turn: int, position: str) -> None:
        owner = (self.conn.id, session)
        fanin = self.frontend.fanin
        fanin.subscribe(
            keys.turn_stream(session, turn), owner, position, self.conn.on_events(session, turn)
        )
        if self.conn.congested:  # its client is not reading: wait in Redis
            fanin.pause(owner)
