"""The new states of the chat page (versions, a cut answer with Continue, a
refusal in words, the "continue elsewhere" dialog) laid out at 390 and 1280 px,
light and dark: nothing wider than the screen, the dialog and its QR code
inside it. Pictures go to WSINFER_SCREENSHOTS when it names a folder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.clients.standin import StandIn

from .helpers import LAST_ANSWER, ask, screenshot, settled

ANSWER = ["A WebSocket ", "is one **TCP** connection ", "that both sides ", "write to."]


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandIn, int]]:
    server = StandIn(delay=0.003, serve_files=True)
    port = (await server.start()).port
    yield server, port
    await server.stop()


async def fits(page: Any, selector: str) -> bool:
    return bool(
        await page.eval_on_selector(
            selector,
            """e => { const r = e.getBoundingClientRect();
            return r.left >= 0 && r.right <= innerWidth + 0.5 && r.top >= 0
                && r.bottom <= innerHeight + 0.5; }""",
        )
    )


@pytest.mark.parametrize("width,height", [(390, 844), (1280, 800)])
@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_new_states_fit_the_screen(
    make_page: Any, standin: tuple[StandIn, int], width: int, height: int, scheme: str
) -> None:
    server, port = standin
    page = await make_page(width, height, scheme)
    await page.goto(f"http://127.0.0.1:{port}/")
    server.pieces = ANSWER
    await ask(page, "What is a WebSocket?")
    await settled(page, 2)
    server.pieces = ["In short: ", "a two-way pipe."]
    await page.click(f"{LAST_ANSWER} .regenerate")
    await settled(page, 2)
    server.refuse_generate = {"code": "too_large", "message": "prompt too long"}
    await ask(page, "Now all of RFC 6455, word for word, please")
    await settled(page, 4)
    server.pieces = ["Frames have ", "an opcode, ", "a length and"]
    await page.click(f"{LAST_ANSWER} .regenerate")  # Retry
    await settled(page, 4)
    name = f"{width}-{scheme}"
    await screenshot(page, f"states-{name}")
    overflow = await page.evaluate(
        "() => document.scrollingElement.scrollWidth - innerWidth"
        " + Math.max(...[...document.querySelectorAll('li.msg')].map("
        "(e) => e.getBoundingClientRect().right - innerWidth))"
    )
    assert overflow <= 1
    for selector in ("#share", f"{LAST_ANSWER} .continue", "li.msg.assistant .version-label"):
        assert await fits(page, selector), selector

    await page.click("#share")
    await page.wait_for_selector("#share-qr svg")
    await screenshot(page, f"share-{name}")
    for selector in ("#share-dialog", "#share-qr svg", "#share-dialog .warning", "#copy-link"):
        assert await fits(page, selector), selector
