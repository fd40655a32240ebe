"""Model-based test of the clients' exactly-once rule (hypothesis' stateful testing).

Both clients, the Python ``ClientProtocol`` and the browser client under node,
face the model server of model_world.py through thousands of generated orders
of: the engine appending tokens (some held back: seq moves, no text), the
server taking a request, its feed handing on a merged run of entries, the
client reading, the connection dropping with anything in flight lost (so an
unanswered ``generate`` is re-sent), the application asking for a resume while
the connection still follows the turn (replays that overlap the live feed),
a ``session`` answer repeated, and for the browser a refused resume. After
every step the text the application was handed must be the turn's text up to
the seq the client applied, nothing repeated, nothing skipped; at the end,
with the connection left alone, the client must get the whole text.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from .model_world import (
    NODE,
    ClientUnderTest,
    Connection,
    Message,
    ModelServer,
    NodeClient,
    PythonClient,
)

# Orders per client (WSINFER_MODEL_EXAMPLES to explore more) and steps per order:
# about 20 s a client here; the browser's steps each cross a pipe to node.
EXAMPLES = int(os.environ.get("WSINFER_MODEL_EXAMPLES", "1000"))
BROWSER_EXAMPLES = int(os.environ.get("WSINFER_MODEL_EXAMPLES", "600"))
STEPS = 40
counts: Counter[str] = Counter()


class ClientModel(RuleBasedStateMachine):
    make_client: Callable[[], ClientUnderTest]
    refusals = False  # a refused resume fails the Python client's turn by design

    @initialize()
    def start(self) -> None:
        self.server = ModelServer()
        self.client = self.make_client()
        self.tokens = 0
        self.continues = 0  # asked for by the application
        assert self.client.start() == []  # nothing goes out before a connection
        counts["orders"] += 1

    def _send(self, sent: list[Message]) -> None:
        if sent:
            assert self.server.conn is not None, f"sent while disconnected: {sent}"
            self.server.conn.up += sent

    # --- the engine -----------------------------------------------------------

    @rule(held=st.lists(st.booleans(), min_size=1, max_size=4))
    def engine_appends(self, held: list[bool]) -> None:
        if self.server.finished:
            return
        for hold in held:
            self.tokens += 1
            self.server.log.append("" if hold else f"<{self.tokens}>")

    @precondition(
        lambda self: len(self.server.log) > self.server.ended_at and not self.server.finished
    )
    @rule()
    def engine_finishes(self) -> None:
        self.server.finish()

    # --- the server -------------------------------------------------------------

    @precondition(lambda self: self.server.conn is not None and self.server.conn.up)
    @rule()
    def server_takes_request(self) -> None:
        self.server.take_request()

    @precondition(lambda self: self.server.conn is not None and self.server.conn.feed is not None)
    @rule(run=st.integers(1, 5))
    def feed_delivers(self, run: int) -> None:
        conn = self.server.conn
        assert conn is not None and conn.feed is not None
        self.server.deliver(conn.feed + run)

    @precondition(lambda self: self.server.conn is not None and self.server.conn.answers)
    @rule(index=st.integers(0, 3))
    def answer_repeated(self, index: int) -> None:
        self.server.repeat_answer(index)

    @precondition(lambda self: self.refusals)
    @rule()
    def next_resume_refused(self) -> None:
        self.server.refuse_next_resume = True

    # --- the connection and the client ---------------------------------------------

    @precondition(lambda self: self.server.conn is None and self.client.state()["wants"])
    @rule()
    def connect(self) -> None:
        self.server.conn = Connection()
        self._send(self.client.connect())
        counts["connects"] += 1

    @precondition(lambda self: self.server.conn is not None)
    @rule()
    def drop(self) -> None:
        self.server.conn = None
        self.client.drop()

    @precondition(lambda self: self.server.conn is not None and self.server.conn.down)
    @rule(n=st.integers(1, 3))
    def client_reads(self, n: int) -> None:
        conn = self.server.conn
        assert conn is not None
        for msg in conn.down[:n]:
            self._send(self.client.receive(msg))
        del conn.down[:n]

    @rule()
    def application_resumes(self) -> None:
        self._send(self.client.resume())

    @precondition(lambda self: self.client.state()["done"])
    @rule()
    def application_continues(self) -> None:
        self.continues += 1
        self._send(self.client.continue_())
        counts["continues"] += 1

    @rule()
    def timers_fire(self) -> None:
        self._send(self.client.tick())

    # --- the check ------------------------------------------------------------------

    @invariant()
    def text_is_the_log_up_to_seq(self) -> None:
        state = self.client.state()
        counts["checks"] += 1
        assert state["seq"] <= len(self.server.log)
        assert state["text"] == self.server.text(state["seq"]), "lost or repeated text"
        assert state["app_text"] == state["text"], "the application was handed other text"
        assert self.server.continues <= self.continues, "a continue was applied twice"

    def teardown(self) -> None:
        """Left alone, the client gets the whole turn."""
        if not hasattr(self, "server"):
            return
        for _ in range(20):
            if self.server.log and not self.server.finished:
                if len(self.server.log) == self.server.ended_at:  # continued, nothing drawn
                    self.engine_appends([False])
                self.server.finish()
            state = self.client.state()
            if state["done"] or state["failed"] or not self.server.log:
                break
            self._settle()
        state = self.client.state()
        if self.server.log and not state["failed"]:
            assert state["done"], "the turn never ended here"
            assert state["text"] == self.server.text(len(self.server.log))
            assert self.server.continues == self.continues, "a continue was lost"

    def _settle(self) -> None:
        if self.server.conn is None:
            self._send(self.client.tick())
            if self.client.state()["wants"]:
                self.connect()
        conn = self.server.conn
        if conn is None:
            return
        while conn.up:
            self.server.take_request()
        self.server.deliver(len(self.server.log))
        while conn.down:
            self._send(self.client.receive(conn.down.pop(0)))
        self._send(self.client.tick())


def explore(examples: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Iterator[None]:
    counts.clear()
    began = time.monotonic()
    yield
    took = time.monotonic() - began
    print(
        f"\n{request.node.name}: {counts['orders']} orders, {counts['checks']} checked steps,"
        f" {counts['connects']} connections, {counts['continues']} continues, {took:.1f} s"
    )


def test_python_client_exactly_once(report: None) -> None:
    class PythonModel(ClientModel):
        make_client = PythonClient

    PythonModel.TestCase.settings = explore(EXAMPLES)
    PythonModel.TestCase().runTest()


@pytest.mark.skipif(NODE is None, reason="node not installed")
def test_browser_client_exactly_once(report: None) -> None:
    class BrowserModel(ClientModel):
        make_client = NodeClient
        refusals = True

    BrowserModel.TestCase.settings = explore(BROWSER_EXAMPLES)
    BrowserModel.TestCase().runTest()
