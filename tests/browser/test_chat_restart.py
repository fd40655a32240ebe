"""The chat page carries an answer across a restart of the whole server.

``wsinfer serve`` is killed with -9 mid-answer (its process group: the
supervisor, whose children die with it) and started again on the same port and
data directory. The page, left alone, reconnects, resumes after its last seq,
and ends with the exact text of an uninterrupted greedy run of the same
question; the user does nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ports import free_ports
from tests.stack import start_serve, stop_serve

from .conftest import RunningServer
from .helpers import answer_text, ask, reference_run, screenshot, seq_of, wait_done, wait_seq

N = 1000
PARAMS = {"max_new_tokens": N, "temperature": 0.0}
PAGE_QUERY = f"/?max_new_tokens={N}&temperature=0"

pytestmark = pytest.mark.timeout(600)


class Restartable:
    """One server that can be killed and started again as the same one."""

    def __init__(self, state: Path, model: str) -> None:
        self.state, self.model = state, model
        [self.port] = free_ports(1)
        self.process = self.start()

    def start(self) -> subprocess.Popen[str]:
        args = ("--model", self.model)
        process, _ = start_serve(self.state, *args, port=self.port, start_new_session=True)
        return process

    def kill_9(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    @property
    def running(self) -> RunningServer:
        return RunningServer(self.port, self.process)


@pytest.fixture
def restartable(tmp_path: Path, tiny_model: str) -> Iterator[Restartable]:
    server = Restartable(tmp_path, tiny_model)
    yield server
    if server.process.poll() is None:
        assert stop_serve(server.process) == 0


async def test_kill_9_of_the_server_mid_answer(page: Any, restartable: Restartable) -> None:
    server = restartable.running
    [expected] = await reference_run(
        server.ws_url, [[{"role": "user", "content": "Survive a restart"}]], PARAMS
    )
    await page.goto(server.http_url + PAGE_QUERY)
    await ask(page, "Survive a restart")
    at = await wait_seq(page, 15)
    restartable.kill_9()
    await page.wait_for_selector("#conn:not([data-state=open])")
    restartable.process = restartable.start()
    assert await wait_done(page) in ("length", "stop")
    assert at < await seq_of(page)
    assert await answer_text(page) == expected
    await screenshot(page, "real-after-server-restart")
