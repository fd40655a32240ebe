"""Continue on another device: two browser contexts (two devices, sharing
nothing but the link) against a real ``wsinfer serve``. The second opens the
link mid-answer, follows that answer live to the same text, then asks the next
question; each device sees what the other added."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from .conftest import RunningServer
from .helpers import LAST_ANSWER, answer_text, ask, screenshot, wait_done, wait_seq

N = 1000  # tokens: several seconds on the tiny model, so the link is opened mid-answer
PAGE_QUERY = f"/?max_new_tokens={N}&temperature=0"


@pytest.fixture
async def devices(browser: Any) -> AsyncIterator[Any]:
    """``await device(width, height, scheme)``: a page in a browser context of its own."""
    contexts: list[Any] = []
    errors: list[str] = []

    async def make(width: int, height: int, scheme: str = "light") -> Any:
        context = await browser.new_context(
            viewport={"width": width, "height": height}, color_scheme=scheme
        )
        contexts.append(context)
        page = await context.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.set_default_timeout(60_000)
        return page

    yield make
    for context in contexts:
        await context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


async def share_link(page: Any) -> str:
    await page.click("#share")
    await page.wait_for_function("() => document.getElementById('share-link').value")
    return str(await page.input_value("#share-link"))


async def wait_messages(page: Any, n: int) -> None:
    await page.wait_for_function(
        "n => document.querySelectorAll('li.msg').length === n"
        " && document.querySelector('li.msg:last-child').dataset.finish",
        arg=n,
        timeout=300_000,
    )


@pytest.mark.slow
async def test_second_device_follows_mid_answer_and_goes_on(
    devices: Any, wsinfer_server: RunningServer
) -> None:
    desk = await devices(1280, 800)
    phone = await devices(390, 844, "dark")
    await desk.goto(wsinfer_server.http_url + PAGE_QUERY)
    await desk.wait_for_selector("#model:not([hidden])")  # GET /v1/models names it
    model = await desk.text_content("#model") or ""
    assert model and model in (await desk.get_attribute("#input", "placeholder") or "")
    await ask(desk, "What is a WebSocket?")
    await wait_seq(desk, 20)

    link = await share_link(desk)
    base, _, fragment = link.partition("#")
    assert base == wsinfer_server.http_url + "/" and fragment.startswith("follow=")
    session = await desk.evaluate("window.wsinferChat.client.session")
    token = await desk.evaluate("window.wsinferChat.client.sessionToken")
    assert session not in link and token not in link  # packed, and only after the '#'
    warning = await desk.text_content("#share-dialog .warning") or ""
    assert "Anyone who has this link can read this conversation and write in it" in warning
    assert await desk.locator("#share-qr svg").count() == 1
    await screenshot(desk, "follow-share-1280-light")
    await desk.click("#share-dialog button[value=close]")

    await phone.goto(link)
    await phone.wait_for_selector(LAST_ANSWER)
    assert await desk.get_attribute(LAST_ANSWER, "data-finish") is None, "opened mid-answer"
    assert "follow=" not in phone.url  # the token leaves the address bar at once
    await wait_seq(phone, 1)
    await screenshot(phone, "follow-phone-streaming-390-dark")
    assert await wait_done(desk) in ("length", "stop")
    assert await wait_done(phone) in ("length", "stop")
    first = await answer_text(desk)
    assert await answer_text(phone) == first and len(first) > 100
    assert await phone.text_content("li.msg.user .content") == "What is a WebSocket?"
    assert await phone.evaluate("window.wsinferChat.client.session") == session

    # The phone goes on with the conversation: one more turn of the same session.
    await ask(phone, "And HTTP?")
    await wait_messages(phone, 4)
    second = await answer_text(phone)
    assert await phone.evaluate("window.wsinferChat.client.session") == session
    # The desk sees that question and answer after a reload (the question read
    # back from GET /v1/sessions/{id}/messages, marked as asked elsewhere).
    await desk.reload()
    await wait_messages(desk, 4)
    assert await answer_text(desk) == second
    assert await desk.text_content("li.msg.user.elsewhere .content") == "And HTTP?"
    assert await desk.locator("li.msg.user.remote").count() == 0
    await screenshot(desk, "follow-desk-after-phone-1280-light")

    # And the desk can go on too; the phone sees it once it reloads.
    await ask(desk, "Thanks!")
    await wait_messages(desk, 6)
    third = await answer_text(desk)
    await phone.reload()
    await wait_messages(phone, 6)
    assert await answer_text(phone) == third
    texts = await phone.locator("li.msg.assistant .content").evaluate_all(
        "els => els.map((e) => e.source)"
    )
    assert texts == [first, second, third]
    await screenshot(phone, "follow-phone-after-desk-390-dark")


async def settled_with(page: Any, messages: int, text_longer_than: int) -> str:
    """Until ``messages`` are shown, none streaming, the last one cut again and
    longer than before: its text."""
    await page.wait_for_function(
        "([n, longer]) => { const m = document.querySelector('li.msg:last-child');"
        " return document.querySelectorAll('li.msg').length === n"
        " && !document.querySelector('li.msg.streaming') && m.dataset.finish === 'length'"
        " && m.querySelector('.content').source.length > longer; }",
        arg=[messages, text_longer_than],
        timeout=300_000,
    )
    return await answer_text(page)


@pytest.mark.slow
async def test_a_continue_on_one_device_is_followed_on_the_other(
    devices: Any, wsinfer_server: RunningServer
) -> None:
    desk = await devices(1280, 800)
    phone = await devices(390, 844, "dark")
    await desk.goto(wsinfer_server.http_url + "/?max_new_tokens=8&temperature=0")
    await ask(desk, "Count to a hundred.")
    assert await wait_done(desk) == "length"
    cut = await answer_text(desk)
    link = await share_link(desk)
    await desk.click("#share-dialog button[value=close]")

    await phone.goto(link)
    assert await wait_done(phone) == "length"
    assert await answer_text(phone) == cut
    await phone.click(f"{LAST_ANSWER} .continue")  # the same turn goes on, on the phone
    longer = await settled_with(phone, 2, len(cut))
    assert longer.startswith(cut)

    # Back on the desk (the page gets the focus): the answer it shows went on
    # elsewhere, so it follows that turn again, into the same place.
    await desk.evaluate("window.dispatchEvent(new Event('focus'))")
    assert await settled_with(desk, 2, len(cut)) == longer
    assert await desk.locator("li.msg").count() == 2
    await screenshot(desk, "follow-desk-after-phone-continue-1280-light")
