"""The page as a new user meets it, in headless Chromium against a real server: the view
follows the conversation, a long chat is trimmed to the context instead of failing,
answers are long enough by default, the sampler settings, tokens/s, export, and links
that go nowhere reading as text."""

from __future__ import annotations

import json
import re

import pytest
import pytest_asyncio
from playwright.async_api import expect

from stopline.engine.loop import Engine
from stopline.protocol.requests import DEFAULT_SAMPLING
from support import running_server
from support.web import (
    LONG_STORY,
    close_page,
    expect_connected,
    expect_state,
    generates,
    meta,
    new_page,
    open_app,
    record_frames,
    screenshot,
    send,
    settings,
)

pytestmark = pytest.mark.browser


@pytest_asyncio.fixture
async def tall_page(browser, server):
    # The size of the window the problem was seen in.
    page = await new_page(browser, viewport={"width": 1280, "height": 800}, accept_downloads=True)
    page.sent = record_frames(page)
    await open_app(page, server.http_url + "/")
    try:
        yield page
    finally:
        await close_page(page)


async def on_screen(page, locator) -> None:
    """Assert that the element is wholly inside the conversation's visible area."""
    box = await locator.bounding_box()
    view = await page.locator("#scroller").bounding_box()
    assert box is not None and view is not None
    scrolled = await page.locator("#scroller").evaluate("s => [s.scrollTop, s.scrollHeight, s.clientHeight]")
    inside = box["y"] >= view["y"] - 1 and box["y"] + box["height"] <= view["y"] + view["height"] + 1
    assert inside, (box, view, scrolled)


async def seed_chat(page, chat: dict) -> None:
    await page.context.add_init_script(
        f"localStorage.setItem('stopline.chats.v1', {json.dumps(json.dumps([chat]))});"
        f" localStorage.setItem('stopline.open-chat.v1', {json.dumps(chat['id'])});"
    )
    await page.reload()
    await expect_connected(page)


# ---------- the view follows the conversation ----------


async def test_the_view_follows_the_conversation_past_long_answers(tall_page):
    page = tall_page
    await settings(page, max_tokens=160, temperature=0)
    await page.click("details.settings summary")  # folded, as a user leaves it
    for _ in range(2):
        answer, _ = await send(page, LONG_STORY)
        await expect_state(answer, "done", timeout=90)
        # The meta line and the buttons that appear at the end are followed too.
        await expect(answer.locator(".meta")).to_contain_text("tokens")
        await on_screen(page, answer.locator(".msg-actions"))
    answer, _ = await send(page, "And what happened next?")
    question = page.locator(".msg.user").last
    await expect(question).to_have_text(re.compile("And what happened next"))
    await on_screen(page, question)
    await expect_state(answer, "done", timeout=90)
    await on_screen(page, answer.locator(".meta"))
    await screenshot(page, "follows-the-conversation")

    # Scrolled up to reread, the reader is left where they are while an answer streams.
    answer, _ = await send(page, LONG_STORY)
    await expect(answer.locator(".text")).not_to_be_empty(timeout=60_000)
    await page.locator("#scroller").evaluate("s => { s.scrollTop = 0; }")
    await expect_state(answer, "done", timeout=90)
    assert await page.locator("#scroller").evaluate("s => s.scrollTop") == 0


# ---------- a chat that outgrows the context ----------


@pytest.fixture(scope="module")
def small_engine():
    # A context of 256 tokens: a few turns outgrow it.
    return Engine.load(threads=1, context_length=256, progress=False)


SENTENCE = "Tell me about the history of bread, "


async def test_a_chat_past_the_context_leaves_out_its_oldest_turns_and_says_so(browser, small_engine):
    # Turns of about 150, 150, 165 and 35 tokens: with the system prompt and the question,
    # the newest two fit the context of 256 tokens but leave only 33 for the answer.
    chat = {
        "id": "chat-long",
        "title": "Bread",
        "updated": 1,
        "messages": [
            m
            for i, repeats in enumerate((8, 8, 9, 1))
            for m in (
                {"role": "user", "content": f"Question {i}: {SENTENCE * repeats}"},
                {"role": "assistant", "content": f"Answer {i}: {SENTENCE * repeats}", "state": "done", "meta": "done"},
            )
        ],
    }
    async with running_server(small_engine) as server:
        page = await new_page(browser)
        page.sent = record_frames(page)
        try:
            await open_app(page, server.http_url + "/")
            await seed_chat(page, chat)
            await settings(page, max_tokens=64, temperature=0)
            await page.fill("#system-prompt", "Answer briefly.")
            answer, _ = await send(page, "What is bread?")
            await expect_state(answer, "done", timeout=90)
            note = page.locator(".trim-note")
            await expect(note).to_be_visible()
            await expect(note).to_contain_text("context of 256 tokens with room for the answer")
            trimmed = await page.locator(".msg.trimmed").count()
            assert trimmed >= 2 and trimmed % 2 == 0
            await expect(note).to_contain_text(f"The {trimmed} oldest messages")
            # The page asked again with fewer turns each time, the system prompt always first.
            frames = generates(page.sent)
            assert len(frames) >= 2
            assert [len(f["messages"]) for f in frames] == sorted((len(f["messages"]) for f in frames), reverse=True)
            for frame in frames:
                assert frame["messages"][0] == {"role": "system", "content": "Answer briefly."}
                assert frame["messages"][-1] == {"role": "user", "content": "What is bread?"}
            assert frames[-1]["messages"][1]["content"].startswith(f"Question {trimmed // 2}:")
            # Each ask keeps room for the answer: its max tokens, at most a quarter of the context.
            assert [f["min_answer_tokens"] for f in frames] == [64] * len(frames)
            # Trimmed until the prompt left that room, not merely until it fit: the ask before
            # the last fit the context, but with less room than that for the answer.
            sizes = [len(small_engine.encode(messages=f["messages"])) for f in frames]
            assert sizes[-1] + 64 <= 256 and 256 - 64 < sizes[-2] < 256, sizes
            # No error reached the chat, and the next question starts from the trimmed history.
            assert "Error" not in await meta(answer)
            asked = len(frames)
            again, _ = await send(page, "And rye?")
            await expect_state(again, "done", timeout=90)
            for frame in generates(page.sent)[asked:]:
                assert not any(m["content"].startswith("Question 0:") for m in frame["messages"])
            await screenshot(page, "trimmed-to-the-context")

            # A question that fits the context but not with that room, with nothing older to
            # leave out, is still answered in the room there is.
            await page.click("#new-chat")
            asked = len(generates(page.sent))
            answer, _ = await send(page, SENTENCE * 25)
            await expect_state(answer, "done", timeout=90)
            assert [f["min_answer_tokens"] for f in generates(page.sent)[asked:]] == [64, 1]
            assert "Error" not in await meta(answer) and not await page.locator(".trim-note").count()
        finally:
            await close_page(page)


# ---------- settings, speed, export, links ----------


async def test_default_answer_length_sampler_settings_and_speed(tall_page, logs):
    page = tall_page
    answer, _ = await send(page, "Say hello.")
    await expect_state(answer, "done", timeout=90)
    [first] = generates(page.sent)
    # The answer length and the sampler's fields left empty use the server's defaults, which the
    # boxes show: one default, in SamplingParams, for the page and the terminal client alike.
    assert not {"max_tokens", "top_p", "top_k", "repetition_penalty", "seed"} & set(first)
    shown = [await page.get_attribute(box, "placeholder") for box in ("#max-tokens", "#top-p", "#top-k")]
    assert shown == [str(DEFAULT_SAMPLING.max_tokens), str(DEFAULT_SAMPLING.top_p), str(DEFAULT_SAMPLING.top_k)]
    # Long enough for a story: the room asked for is the context's quarter, as with 1,024.
    assert first["min_answer_tokens"] == min(DEFAULT_SAMPLING.max_tokens, 2048 // 4)
    # The server's decode speed, the figure its console shows too.
    [end] = logs.records("generation_done")
    assert (await meta(answer)).endswith(f" · {end['tokens_per_s']:.1f} tokens/s"), await meta(answer)

    await settings(page, max_tokens=8)
    for selector, value in (("#top-p", "0.5"), ("#top-k", "5"), ("#repetition-penalty", "1.3"), ("#seed", "7")):
        await page.fill(selector, value)
    answer, _ = await send(page, "Say hello.")
    await expect_state(answer, "done", timeout=90)
    second = generates(page.sent)[-1]
    assert (second["top_p"], second["top_k"], second["repetition_penalty"], second["seed"]) == (0.5, 5, 1.3, 7)
    # Kept for the next visit.
    await page.reload()
    await expect_connected(page)
    assert await page.input_value("#top-k") == "5" and await page.input_value("#seed") == "7"


async def test_a_chat_exports_as_markdown_and_json(tall_page, tmp_path):
    page = tall_page
    await expect(page.locator("#export-md")).to_be_disabled()  # nothing to export yet
    await settings(page, max_tokens=12, temperature=0)
    await page.fill("#system-prompt", "Be brief.")
    answer, _ = await send(page, "What is the capital of France?")
    await expect_state(answer, "done", timeout=90)
    shown = await answer.locator(".text").text_content()
    exported = {}
    for kind in ("md", "json"):
        async with page.expect_download() as info:
            await page.click(f"#export-{kind}")
        download = await info.value
        assert download.suggested_filename == f"What is the capital of France.{kind}"
        path = tmp_path / download.suggested_filename
        await download.save_as(path)
        exported[kind] = path.read_text("utf-8")
    markdown = exported["md"]
    assert markdown.startswith("# What is the capital of France?\n\n**System prompt:** Be brief.\n\n## You\n\n")
    assert "## Assistant" in markdown and shown.strip()[:20] in markdown
    data = json.loads(exported["json"])
    assert data["title"] == "What is the capital of France?" and data["system"] == "Be brief."
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    assert data["messages"][0]["content"] == "What is the capital of France?"
    assert "tokens" in data["messages"][1]["meta"]


async def test_a_link_whose_address_was_removed_reads_as_text(tall_page):
    page = tall_page
    await seed_chat(
        page,
        {
            "id": "chat-links",
            "title": "Links",
            "updated": 1,
            "messages": [
                {"role": "user", "content": "Links?"},
                {
                    "role": "assistant",
                    "content": "[dead](javascript:alert(1)) and [live](https://example.com)",
                    "state": "done",
                    "meta": "done",
                },
            ],
        },
    )
    dead = page.locator(".msg.assistant .text a:not([href])")
    live = page.locator(".msg.assistant .text a[href]")
    await expect(dead).to_have_text("dead")
    style = "el => { const s = getComputedStyle(el); return [s.color, s.textDecorationLine, s.cursor]; }"
    text_color = await page.locator(".msg.assistant .text p").evaluate("el => getComputedStyle(el).color")
    assert await dead.evaluate(style) == [text_color, "none", "text"]
    # A real link still looks like one.
    live_color, _, live_cursor = await live.evaluate(style)
    assert live_color != text_color and live_cursor == "pointer"
