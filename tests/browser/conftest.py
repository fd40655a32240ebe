"""Fixtures for the real-browser tests: headless Debian Chromium driven by
Playwright, a real ``wsinfer serve`` on localhost, and a TCP proxy the tests
can cut to simulate a dropped connection.

Everything skips with the reason when Chromium or Playwright is missing; CI
installs them, so there the tests really run.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.stack import start_serve, stop_serve

from .helpers import Proxy

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

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"


@pytest.fixture(scope="session")
def wsinfer_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model: str
) -> Iterator[RunningServer]:
    """``wsinfer serve`` with the tiny random-weight model, once per test session."""
    process, port = start_serve(tmp_path_factory.mktemp("browser-serve"), "--model", tiny_model)
    yield RunningServer(port, process)
    assert stop_serve(process) == 0
