"""The chat page against a real ``wsinfer serve --api-key``: it asks for the key
(instead of reconnecting for ever), refuses a wrong one, answers with the right one,
and never keeps the key in the address bar."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.models import tiny_model_dir
from tests.stack import start_serve, stop_serve

from .helpers import ask, wait_done

KEY = "k-0123456789"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    state: Path = tmp_path_factory.mktemp("keyed-serve")
    process, port = start_serve(state, "--model", str(tiny_model_dir()), "--api-key", KEY)
    yield f"http://127.0.0.1:{port}"
    assert stop_serve(process) == 0


async def test_the_page_asks_for_the_key_and_refuses_a_wrong_one(
    page: Any, keyed_server: str
) -> None:
    await page.goto(keyed_server + "/?max_new_tokens=3")
    await page.wait_for_selector("#api-key-dialog[open]")
    assert await page.text_content("#conn-text") == "API key needed"
    assert await page.is_hidden("#api-key-refused")  # no key yet: nothing was refused
    await page.fill("#api-key", "wrong")
    await page.click("#api-key-form button[type=submit]")
    await page.wait_for_selector("#api-key-refused:not([hidden])")
    await page.fill("#api-key", KEY)
    await page.click("#api-key-form button[type=submit]")
    await page.wait_for_selector("#api-key-dialog:not([open])", state="attached")
    await page.wait_for_selector("#conn[data-state=open]")
    await ask(page, "Hello")
    assert await wait_done(page) == "length"
    assert KEY not in page.url
    # A reload in the same tab keeps the key (sessionStorage) without asking again.
    await page.reload()
    await page.wait_for_selector("#conn[data-state=open]")
    assert await page.evaluate("document.getElementById('api-key-dialog').open") is False


async def test_a_key_in_the_link_is_used_and_taken_out_of_the_address_bar(
    page: Any, keyed_server: str
) -> None:
    await page.goto(f"{keyed_server}/?token={KEY}&max_new_tokens=3")
    await page.wait_for_selector("#conn[data-state=open]")
    assert KEY not in page.url and "max_new_tokens=3" in page.url
    assert await page.evaluate("localStorage.getItem('wsinfer.apiKey')") is None
    assert await page.evaluate("document.getElementById('api-key-dialog').open") is False


async def test_remember_keeps_the_key_for_new_tabs(make_page: Any, keyed_server: str) -> None:
    first = await make_page()
    await first.goto(keyed_server + "/")
    await first.wait_for_selector("#api-key-dialog[open]")
    await first.fill("#api-key", KEY)
    await first.check("#remember-key")
    await first.click("#api-key-form button[type=submit]")
    await first.wait_for_selector("#conn[data-state=open]")
    second = await make_page()  # same context: shares localStorage, not sessionStorage
    await second.goto(keyed_server + "/")
    await second.wait_for_selector("#conn[data-state=open]")
    assert await second.evaluate("document.getElementById('api-key-dialog').open") is False
