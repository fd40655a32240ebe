"""Fixtures for the real-browser tests: headless Debian Chromium driven by
Playwright, a real ``wsinfer serve`` on localhost, and a TCP proxy the tests
can cut to simulate a dropped connection.

Everything skips with the reason when Chromium, Playwright or the server is
missing; CI installs them, so there the tests really run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .helpers import Proxy

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # for `tests.models`
    sys.path.insert(0, str(REPO))

CHROMIUM = os.environ.get("WSINFER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SERVER_START_TIMEOUT = 180.0


# ---- browser ------------------------------------------------------------------


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright)")
    async with async_playwright() as pw:
        b = await pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            await b.close()


@pytest.fixture
async def page(browser: Any) -> AsyncIterator[Any]:
    """A fresh page; uncaught page errors fail the test."""
    context = await browser.new_context(viewport={"width": 1000, "height": 760})
    pg = await context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(30_000)
    try:
        yield pg
    finally:
        await context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
async def make_page(browser: Any) -> AsyncIterator[Any]:
    """``await make_page(width=, height=, scheme=)``: pages in one browser context
    (they share localStorage, like tabs); uncaught page errors fail the test."""
    contexts: dict[tuple[int, int, str], Any] = {}
    errors: list[str] = []

    async def make(width: int = 1000, height: int = 760, scheme: str = "light") -> Any:
        key = (width, height, scheme)
        if key not in contexts:
            contexts[key] = await browser.new_context(
                viewport={"width": width, "height": height}, color_scheme=scheme
            )
        pg = await contexts[key].new_page()
        pg.on("pageerror", lambda exc: errors.append(str(exc)))
        pg.set_default_timeout(30_000)
        return pg

    try:
        yield make
    finally:
        for context in contexts.values():
            await context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


@pytest.fixture
async def proxy_to() -> AsyncIterator[Any]:
    proxies: list[Proxy] = []

    async def make(target_port: int) -> Proxy:
        p = Proxy(target_port)
        await p.start()
        proxies.append(p)
        return p

    yield make
    for p in proxies:
        await p.close()


# ---- the real server ------------------------------------------------------------


@dataclass
class RunningServer:
    port: int
    proc: subprocess.Popen[str]
    log: Path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:]


def _wsinfer_exe() -> str | None:
    beside = Path(sys.executable).parent / "wsinfer"
    if beside.exists():
        return str(beside)
    return shutil.which("wsinfer")


@pytest.fixture(scope="session")
def wsinfer_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """``wsinfer serve`` with the tiny random-weight model, once per test session."""
    exe = _wsinfer_exe()
    if exe is None or not (REPO / "wsinfer" / "cli.py").exists():
        pytest.skip("wsinfer serve is not available (wsinfer/cli.py missing)")
    try:
        from tests.models import tiny_model_dir
    except ImportError as exc:
        pytest.skip(f"tests.models.tiny_model_dir unavailable: {exc}")
    model_dir = tiny_model_dir()
    port = _free_port()
    log = tmp_path_factory.mktemp("browser-serve") / "serve.log"
    logf = log.open("w")
    cmd = [exe, "serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir)]
    proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, text=True)
    server = RunningServer(port, proc, log)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT
        while not _healthy(server.http_url):
            if proc.poll() is not None:
                pytest.fail(f"wsinfer serve exited ({proc.returncode}):\n{_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"wsinfer serve not healthy in {SERVER_START_TIMEOUT}s:\n{_tail(log)}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        logf.close()
