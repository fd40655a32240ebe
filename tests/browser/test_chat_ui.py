"""The chat page as a person uses it, in headless Chromium against the stand-in:
Markdown streamed in pieces (and kept safe), the phone layout, the conversation
list across reloads and tabs, regenerate, edit-and-resend, keyboard and
settings. The stand-in's text is chosen per test, so what the page must show is
known exactly."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.clients.standin import StandIn, word_text

from .helpers import answer_text, ask, screenshot, wait_done, wait_seq

MARKDOWN = (
    "# Plan\n\n"
    "Some **bold** words, `inline code` and a list:\n\n"
    "- one\n- two\n\n"
    "```python\n"
    "def double(x):\n"
    '    """Twice x."""\n'
    "    return x * 2  # simple\n"
    "```\n\n"
    "Raw HTML stays text: <script>window.__pwned = 1</script> "
    '<img src="x" onerror="window.__pwned = 2"> '
    "[a link](javascript:window.__pwned=3) ![pic](https://example.invalid/x.png "
    '"t") <a href="#" onclick="window.__pwned = 4">click</a>\n'
)
CODE = 'def double(x):\n    """Twice x."""\n    return x * 2  # simple'


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def words(n: int) -> str:
    return "".join(word_text(i) for i in range(1, n + 1))


@pytest.fixture
async def standin() -> AsyncIterator[tuple[StandIn, int]]:
    server = StandIn(delay=0.01, default_tokens=50, serve_files=True)
    port = (await server.start()).port
    yield server, port
    await server.stop()


def generates(server: StandIn) -> list[dict[str, Any]]:
    return [m for m in server.received if m["type"] == "generate"]


async def safety_probe(page: Any) -> dict[str, Any]:
    return dict(
        await page.evaluate(
            """() => { const c = document.querySelector("li.msg.assistant:last-child .content");
            return { pwned: window.__pwned ?? null,
                     scripts: c.querySelectorAll("script").length,
                     imgs: c.querySelectorAll("img").length,
                     handlers: [...c.querySelectorAll("*")].filter((e) =>
                         [...e.attributes].some((a) => a.name.startsWith("on"))).length,
                     jsLinks: c.querySelectorAll("a[href^='javascript']").length }; }"""
        )
    )


SAFE = {"pwned": None, "scripts": 0, "imgs": 0, "handlers": 0, "jsLinks": 0}


async def test_markdown_streamed_in_pieces_renders_safely(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    server.delay = 0.03
    server.pieces = pieces(MARKDOWN, 3)  # fences, ** and tags all cut mid-way
    page = await make_page()
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    await page.goto(f"http://127.0.0.1:{port}/")
    await ask(page, "show me")
    # Pause inside the code block: its fence is open, yet it already renders as code.
    inside = MARKDOWN.index("return x") // 3
    await wait_seq(page, inside)
    await page.click("#pause")
    await page.wait_for_selector("body[data-turn=paused]")
    await page.wait_for_selector("li.msg.assistant pre code.language-python .hljs-keyword")
    partial = await page.text_content("li.msg.assistant pre code")
    assert partial is not None and partial.startswith("def double(x):") and "```" not in partial
    assert await page.locator("li.msg.assistant strong").text_content() == "bold"
    await screenshot(page, "ui-markdown-streaming")
    await page.click("#resume")
    assert await wait_done(page) == "length"
    assert await answer_text(page) == MARKDOWN

    answer = page.locator("li.msg.assistant .content")
    assert await answer.locator("h1").text_content() == "Plan"
    assert await answer.locator("ul > li").all_text_contents() == ["one", "two"]
    assert await answer.locator("p > code").text_content() == "inline code"
    assert await answer.locator("pre code").text_content() == CODE
    keywords = await answer.locator("pre code .hljs-keyword").all_text_contents()
    assert "def" in keywords and "return" in keywords
    assert await answer.locator("pre .code-lang").text_content() == "python"
    # Nothing the model wrote ran or became live markup; the raw tags read as text.
    assert await safety_probe(page) == SAFE
    text = await answer.text_content()
    assert text is not None and "<script>window.__pwned = 1</script>" in text
    assert '<img src="x" onerror=' in text
    assert await answer.locator("a", has_text="pic").get_attribute("href") == (
        "https://example.invalid/x.png"
    )
    for link in await answer.locator("a[href]").all():
        assert await link.get_attribute("rel") == "noopener noreferrer nofollow"
    # The copy button copies the code exactly.
    await answer.locator("pre button.copy").click()
    await page.wait_for_selector("pre button.copy[data-copied=true]")
    assert await page.evaluate("navigator.clipboard.readText()") == CODE
    await screenshot(page, "ui-markdown-done")
    # And it stays safe when rendered again from storage.
    await page.reload()
    await page.wait_for_selector("li.msg.assistant pre code .hljs-keyword")
    assert await safety_probe(page) == SAFE
    assert await answer_text(page) == MARKDOWN


async def test_phone_layout(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    server.pieces = pieces("A **phone** answer with `code`:\n\n```js\nlet x = 1;\n```\n", 4)
    for scheme in ("light", "dark"):
        page = await make_page(390, 844, scheme)
        await page.goto(f"http://127.0.0.1:{port}/")
        box = await page.locator("#input").bounding_box()
        assert box is not None and box["width"] >= 200, box
        placeholder = await page.get_attribute("#input", "placeholder")
        assert placeholder and await page.evaluate(
            "() => document.getElementById('input').scrollWidth"
            " <= document.getElementById('input').clientWidth"
        ), "the placeholder fits"
        await ask(page, f"hello from a phone, {scheme}")
        assert await wait_done(page) == "length"
        # Nothing sticks out sideways; the list is a drawer behind the menu button.
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390
        assert (
            not await page.locator("#conversations").is_visible()
            or (await page.locator("#sidebar").bounding_box())["x"] < 0
        )
        await screenshot(page, f"ui-phone-{scheme}")
        await page.click("#menu")
        await page.wait_for_function(
            "() => document.getElementById('sidebar').getBoundingClientRect().x >= 0"
        )
        assert await page.locator("#conversations li").count() >= 1
        await screenshot(page, f"ui-phone-{scheme}-list")
        await page.click("#scrim", position={"x": 375, "y": 420})  # beside the drawer
        await page.wait_for_function(
            "() => document.getElementById('sidebar').getBoundingClientRect().right <= 0"
        )


async def test_wide_layout_both_themes(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    server.pieces = pieces(MARKDOWN.split("Raw HTML")[0], 5)
    colours = {}
    for scheme in ("light", "dark"):
        page = await make_page(1280, 800, scheme)
        await page.goto(f"http://127.0.0.1:{port}/")
        await ask(page, "Plan a function that doubles a number")
        assert await wait_done(page) == "length"
        sidebar = await page.locator("#sidebar").bounding_box()
        assert sidebar is not None and sidebar["x"] == 0 and sidebar["width"] > 200
        assert await page.evaluate("document.documentElement.scrollWidth") <= 1280
        colours[scheme] = await page.evaluate("getComputedStyle(document.body).backgroundColor")
        await screenshot(page, f"ui-wide-{scheme}")
    assert colours["light"] != colours["dark"], colours


async def test_conversation_list_survives_reload_and_new_tab(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    url = f"http://127.0.0.1:{port}/?max_new_tokens=5"
    page = await make_page()
    await page.goto(url)
    await ask(page, "first conversation")
    await wait_done(page)
    first = await page.evaluate("window.wsinferChat.client.session")
    await page.click("#new-chat")
    assert await page.locator("li.msg").count() == 0
    await ask(page, "second conversation")
    await wait_done(page)
    second = await page.evaluate("window.wsinferChat.client.session")
    assert first != second

    titles = "#conversations li .open span"
    await page.reload()
    await page.wait_for_selector("li.msg.assistant")
    assert await page.locator(titles).all_text_contents() == [
        "second conversation",
        "first conversation",
    ]
    assert await page.text_content("li.msg.user .content") == "second conversation"

    tab = await make_page()  # same browser profile: a new tab
    await tab.goto(url)
    await tab.wait_for_selector("#conversations li")
    assert await tab.locator(titles).all_text_contents() == [
        "second conversation",
        "first conversation",
    ]
    assert await tab.locator("li.msg").count() == 0  # a new tab starts a new chat
    sessions = await tab.eval_on_selector_all(
        "#conversations li", "ls => ls.map(l => l.dataset.session)"
    )
    assert sessions == [second, first]
    await tab.click("#conversations li:nth-child(2) .open")
    await tab.wait_for_selector("li.msg.assistant")
    assert await tab.text_content("li.msg.user .content") == "first conversation"
    assert await tab.evaluate("window.wsinferChat.client.session") == first
    await ask(tab, "a follow-up")
    await wait_done(tab)
    follow_up = generates(server)[-1]
    # The reopened conversation continues its own session: only the new question goes.
    assert follow_up["session"] == first
    assert follow_up["messages"] == [{"role": "user", "content": "a follow-up"}]
    assert await tab.locator("li.msg").count() == 4
    # The first tab learns about the change (storage event): most recent first.
    await page.wait_for_function(
        "() => document.querySelector('#conversations li .open span').textContent"
        " === 'first conversation'"
    )


async def test_reopening_a_conversation_resumes_its_answer(
    make_page: Any, standin: tuple[StandIn, int]
) -> None:
    server, port = standin
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=200")
    await ask(page, "a long answer")
    at = await wait_seq(page, 20)
    await page.click("#new-chat")  # leave it mid-answer: the server goes on
    assert await page.locator("li.msg").count() == 0
    await asyncio.sleep(0.3)
    await page.click("#conversations li .open")
    assert await wait_done(page) == "length"
    assert await answer_text(page) == words(200)
    resumes = [m for m in server.received if m["type"] == "resume"]
    assert resumes and resumes[-1]["after"] >= at and resumes[-1]["turn"] == 1
    assert sum(1 for m in server.received if m["type"] == "close") == 0


async def test_regenerate_and_edit(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/?max_new_tokens=4")
    await ask(page, "one")
    await wait_done(page)
    await ask(page, "two")
    await wait_done(page)
    old_session = await page.evaluate("window.wsinferChat.client.session")
    # Only the last answer offers Regenerate.
    assert await page.locator(".regenerate:visible").count() == 1
    await page.click("li.msg.assistant:last-child .regenerate")
    await page.wait_for_function("() => document.body.dataset.turn === 'idle'")
    assert await wait_done(page) == "length"
    regen = generates(server)[-1]
    assert "session" not in regen  # a fresh session with the history up to the question
    assert regen["messages"] == [
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": words(4)},
        {"role": "user", "content": "two"},
    ]
    closes = [m for m in server.received if m["type"] == "close"]
    assert [m["session"] for m in closes] == [old_session]
    assert await page.locator("li.msg").count() == 4
    await screenshot(page, "ui-regenerated")

    # Edit the first question: everything after it is replaced by the new answer.
    await page.click("li.msg.user >> nth=0 >> .edit")
    await page.fill("li.msg.user .edit-box", "uno")
    await page.press("li.msg.user .edit-box", "Enter")
    assert await wait_done(page) == "length"
    edited = generates(server)[-1]
    assert "session" not in edited and edited["messages"] == [{"role": "user", "content": "uno"}]
    assert await page.locator("li.msg").count() == 2
    assert await page.text_content("li.msg.user .content") == "uno"
    assert await page.text_content("#conversations li .open span") == "uno"
    # Esc cancels an edit and keeps the message as it was.
    await page.click("li.msg.user .edit")
    await page.fill("li.msg.user .edit-box", "never sent")
    await page.press("li.msg.user .edit-box", "Escape")
    assert await page.text_content("li.msg.user .content") == "uno"
    # And all of it is what a reload shows.
    await page.reload()
    await page.wait_for_selector("li.msg.assistant")
    shown = await page.locator("li.msg .content").all_text_contents()
    assert [t.strip() for t in shown] == ["uno", words(4).strip()]


async def test_keyboard_and_settings_persist(make_page: Any, standin: tuple[StandIn, int]) -> None:
    server, port = standin
    server.delay = 0.02
    page = await make_page()
    await page.goto(f"http://127.0.0.1:{port}/")
    await page.click("#open-settings")
    await page.fill("#temperature", "0.3")
    await page.fill("#max-new-tokens", "300")
    await page.fill("#system", "You are terse.")
    await page.select_option("#theme-select", "dark")
    await screenshot(page, "ui-settings")
    await page.click("#close-settings")
    await page.reload()
    await page.click("#open-settings")
    assert await page.input_value("#temperature") == "0.3"
    assert await page.input_value("#max-new-tokens") == "300"
    assert await page.input_value("#system") == "You are terse."
    assert await page.input_value("#theme-select") == "dark"
    assert await page.get_attribute("html", "data-theme") == "dark"
    await page.click("#close-settings")
    # Enter sends with those settings; Esc stops the answer.
    await ask(page, "go on forever")
    await wait_seq(page, 5)
    await page.keyboard.press("Escape")
    assert await wait_done(page) == "cancelled"
    sent = generates(server)[-1]
    assert sent["params"] == {"temperature": 0.3, "max_new_tokens": 300}
    assert sent["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "go on forever"},
    ]
    assert await page.text_content("li.msg.assistant .note") == "Stopped"
    # The header button cycles the theme, and that choice persists too.
    await page.click("#theme")
    assert await page.get_attribute("html", "data-theme") == "system"
    await page.click("#theme")
    await page.reload()
    assert await page.get_attribute("html", "data-theme") == "light"


async def test_page_loads_only_its_own_files(make_page: Any, standin: tuple[StandIn, int]) -> None:
    """No CDN: every request stays on the page's origin and succeeds, favicon included."""
    server, port = standin
    origin = f"http://127.0.0.1:{port}"
    page = await make_page()
    responses: list[tuple[str, int]] = []
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.on("response", lambda r: responses.append((r.url, r.status)))
    await page.goto(origin + "/")
    await page.wait_for_selector("#conn[data-state=open]")
    assert await page.get_attribute("link[rel=icon]", "href") == "/static/favicon.svg"
    icon = await page.evaluate(
        "fetch('/static/favicon.svg').then(async (r) => [r.status, (await r.text()).slice(0, 4)])"
    )
    assert icon == [200, "<svg"]
    assert all(u.startswith((origin, f"ws://127.0.0.1:{port}/")) for u in requests), requests
    # The stand-in has no /v1/models (the real server's gives the page the model's name).
    assert all(status == 200 for u, status in responses if "/v1/models" not in u), responses
    loaded = {u.removeprefix(origin) for u, _ in responses}
    assert {"/static/vendor/marked.esm.js", "/static/vendor/purify.es.mjs"} <= loaded
    assert "/static/vendor/highlight.min.js" in loaded and "/static/wsinfer.js" in loaded
