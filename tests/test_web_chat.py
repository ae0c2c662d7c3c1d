"""The chat page's everyday features, driven in headless Chromium against a real server.

Markdown, copy, regenerate, continue, edit-and-resend, the system prompt, chats kept
in localStorage, the chat list and the theme. The frames the page sends are read
off its WebSocket, so each test checks what reached the server as well as what
the page shows. Screenshots go to artifacts/screenshots/.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re

import pytest
import pytest_asyncio
from playwright.async_api import expect

from support.web import (
    FRANCE,
    LONG_STORY,
    ROOT,
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
    wait_for_record,
    wait_for_text,
)

pytestmark = pytest.mark.browser


CODE = "Write a Python function that adds two numbers. Use a markdown code block."


@pytest_asyncio.fixture
async def chat(browser, server):
    page = await new_page(browser, permissions=["clipboard-read", "clipboard-write"])
    page.sent = record_frames(page)
    await open_app(page, server.http_url + "/")
    try:
        yield page
    finally:
        await close_page(page)


async def stored_chats(page) -> list[dict]:
    return await page.evaluate("() => JSON.parse(localStorage.getItem('stopline.chats.v1') ?? '[]')")


async def text_of(message) -> str:
    return await message.locator(".text").text_content()


async def ask(page, text: str, state: str = "done", timeout: float = 60):
    message, request_id = await send(page, text)
    await expect_state(message, state, timeout=timeout)
    return message, request_id


# ---------- markdown ----------


async def test_markdown_with_a_code_block_renders_highlighted(chat, server, logs):
    await settings(chat, max_tokens=120, temperature=0)
    message, request_id = await ask(chat, CODE)
    code = message.locator(".text pre code")
    await expect(code).to_have_count(1)
    assert "def " in await code.text_content() and "return" in await code.text_content()
    # highlight.js ran on it: keywords are wrapped in spans.
    await expect(code).to_have_class(re.compile(r"\bhljs\b"))
    assert await code.locator(".hljs-keyword").count() >= 1
    # The markdown around the block renders too (inline code becomes <code>, not backticks).
    assert "```" not in await text_of(message)
    assert await message.locator(".text p").count() >= 1
    await expect(message.locator(".copy-code")).to_have_count(1)
    record = await wait_for_record(logs, "generation_done", id=request_id)
    assert record["tokens_generated"] > 10
    await chat.click("details.settings summary")  # fold the settings away for the picture
    await screenshot(chat, "markdown-light")

    # The copy button on the block copies the code alone.
    await message.locator(".copy-code").click()
    await expect(message.locator(".copy-code")).to_have_text("Copied")
    assert await chat.evaluate("() => navigator.clipboard.readText()") == await code.text_content()

    # The same answer in the dark theme.
    await chat.click("#theme")  # auto -> light
    await chat.click("#theme")  # light -> dark
    await expect(chat.locator("html")).to_have_attribute("data-theme", "dark")
    await screenshot(chat, "markdown-dark")


async def test_script_and_javascript_links_in_model_output_are_inert(chat, server, logs):
    # A stopped answer that already holds hostile markup, as a model could have written it.
    # Continue makes the real model write the rest of it: it closes the <script> itself.
    hostile = (
        "Here is a page: <img src=x onerror=\"window.__pwned = 'img'\">\n\n"
        "[click me](javascript:window.__pwned='link')\n\n"
        "<!DOCTYPE html>\n<html>\n<body>\n<script>window.__pwned = 'script';"
    )
    stored = [
        {
            "id": "chat-hostile",
            "title": "A page",
            "updated": 1,
            "messages": [
                {"role": "user", "content": "Write a small HTML page with JavaScript."},
                {"role": "assistant", "content": hostile, "state": "cancelled", "meta": "Generation cancelled"},
            ],
        }
    ]
    await chat.context.add_init_script(
        f"localStorage.setItem('stopline.chats.v1', {json.dumps(json.dumps(stored))});"
        " localStorage.setItem('stopline.open-chat.v1', 'chat-hostile');"
    )
    await chat.reload()
    await expect_connected(chat)
    message = chat.locator(".msg.assistant")
    await expect(message).to_have_count(1)
    await settings(chat, max_tokens=60, temperature=0)
    await message.locator("button.continue").click()
    await expect_state(message, "done", timeout=60)
    request_id = await message.get_attribute("data-id")
    record = await wait_for_record(logs, "generation_done", id=request_id)
    assert record["tokens_generated"] > 0
    [frame] = generates(chat.sent)
    assert frame["messages"][-1] == {"role": "assistant", "content": hostile}

    # None of it became live...
    assert await chat.evaluate("() => window.__pwned") is None
    assert await message.locator(".text script, .text img, .text [onerror], .text iframe").count() == 0
    # ...and the markup is shown as the text it is.
    shown = await text_of(message)
    assert "<script>window.__pwned = 'script';" in shown and "<img src=x onerror=" in shown
    link = message.locator(".text a")
    await expect(link).to_have_count(1)
    assert await link.get_attribute("href") is None
    await link.click()
    await expect(chat.locator(".msg.assistant")).to_have_count(1)  # still here, nothing navigated
    assert await chat.evaluate("() => window.__pwned") is None
    await screenshot(chat, "inert-markup")


# ---------- stop, continue, regenerate ----------


async def test_a_stopped_answer_can_be_continued_and_regenerated(chat, server, logs):
    await settings(chat, max_tokens=400, temperature=0)
    message, first_id = await send(chat, LONG_STORY)
    await expect(message).to_have_attribute("aria-busy", "true")  # read out once it is complete
    await wait_for_text(chat, message, 40)
    await chat.click("#stop")
    await expect_state(message, "cancelled")
    await expect(message).not_to_have_attribute("aria-busy", "true")
    partial = await text_of(message)
    assert "Generation cancelled" in await meta(message)
    stopped = await wait_for_record(logs, "generation_cancelled", id=first_id)

    # Continue: the same message grows from where it stopped.
    await expect(message.locator("button.continue")).to_be_visible()
    await settings(chat, max_tokens=24)
    await message.locator("button.continue").click()
    await expect_state(message, "done", timeout=60)
    continued_id = await message.get_attribute("data-id")
    assert continued_id != first_id
    continued = await text_of(message)
    assert continued.startswith(partial.rstrip()) and len(continued) > len(partial)
    assert re.search(r"24 tokens · max tokens reached", await meta(message))
    record = await wait_for_record(logs, "generation_done", id=continued_id)
    assert record["tokens_generated"] == 24
    first, cont = generates(chat.sent)
    assert cont["messages"][:-1] == first["messages"]
    assert cont["messages"][-1]["role"] == "assistant" and cont["messages"][-1]["content"].startswith(
        partial.strip()[:20]
    )
    accepted = {r["id"]: r for r in logs.records("generation_accepted")}
    assert (
        accepted[continued_id]["prompt_tokens"] >= accepted[first_id]["prompt_tokens"] + stopped["tokens_generated"] - 1
    )

    # A done answer offers Regenerate but not Continue.
    await expect(message.locator("button.continue")).to_be_hidden()
    await expect(chat.locator("#stop")).to_be_disabled()

    # Regenerate, stop it mid-way, regenerate again: each time the answer is replaced by a new one.
    await settings(chat, max_tokens=400)
    await message.locator("button.regenerate").click()
    messages = chat.locator(".msg.assistant")
    await expect(messages).to_have_count(1)
    message = messages.last
    regenerated_id = await message.get_attribute("data-id")
    assert regenerated_id not in (first_id, continued_id)
    await wait_for_text(chat, message, 20)
    await chat.keyboard.press("Escape")
    await expect_state(message, "cancelled")
    await message.locator("button.regenerate").click()
    await expect(messages).to_have_count(1)
    again_id = await messages.last.get_attribute("data-id")
    assert again_id != regenerated_id
    await wait_for_text(chat, messages.last, 20)
    await chat.click("#stop")
    await expect_state(messages.last, "cancelled")
    # Each regeneration asked the same question with the same history as the first request.
    frames = generates(chat.sent)
    assert [f["id"] for f in frames] == [first_id, continued_id, regenerated_id, again_id]
    assert frames[2]["messages"] == frames[3]["messages"] == first["messages"]
    assert accepted[first_id]["prompt_tokens"] == wait_prompt_tokens(logs, again_id)
    await expect(chat.locator(".msg.user")).to_have_count(1)
    await screenshot(chat, "stopped-regenerable")


def wait_prompt_tokens(logs, request_id: str) -> int:
    [record] = logs.records("generation_accepted", id=request_id)
    return record["prompt_tokens"]


# ---------- edit and resend ----------


async def test_edit_and_resend_replaces_the_rest_of_the_chat(chat, server, logs):
    await settings(chat, max_tokens=32, temperature=0)
    first, _ = await ask(chat, FRANCE)
    assert "Paris" in await text_of(first)
    await ask(chat, "And what is the capital of Spain?")
    await expect(chat.locator(".msg")).to_have_count(4)

    user = chat.locator(".msg.user").first
    # Keyboard: the Edit button opens an editor holding the message; Esc closes it again.
    await user.locator("button.edit").focus()
    await chat.keyboard.press("Enter")
    editor = user.locator("textarea.edit-text")
    await expect(editor).to_be_focused()
    await expect(editor).to_have_value(FRANCE)
    await chat.keyboard.press("Escape")
    await expect(editor).to_have_count(0)
    await expect(user.locator("button.edit")).to_be_focused()
    await expect(chat.locator(".msg")).to_have_count(4)

    await user.locator("button.edit").click()
    await editor.fill("What is the capital of Italy?")
    await screenshot(chat, "editing")
    await chat.keyboard.press("Enter")
    # Everything after the edited message is gone; a new answer follows it.
    await expect(chat.locator(".msg")).to_have_count(2)
    answer = chat.locator(".msg.assistant")
    await expect_state(answer, "done", timeout=60)
    assert await user.locator(".text").text_content() == "What is the capital of Italy?"
    edited_answer = await text_of(answer)
    assert edited_answer.strip() and "Paris" not in edited_answer
    frames = generates(chat.sent)
    assert len(frames) == 3
    assert [m["content"] for m in frames[2]["messages"]] == ["What is the capital of Italy?"]
    [stored] = await stored_chats(chat)
    assert [m["content"] for m in stored["messages"]][0] == "What is the capital of Italy?"
    assert len(stored["messages"]) == 2


# ---------- system prompt, storage, chat list ----------


async def test_system_prompt_is_sent_and_remembered(chat, server, logs):
    system = "You are a pirate. Answer every question like a pirate would."
    await settings(chat, max_tokens=16, temperature=0)
    await chat.fill("#system-prompt", system)
    await ask(chat, FRANCE)
    [frame] = generates(chat.sent)
    assert frame["messages"] == [{"role": "system", "content": system}, {"role": "user", "content": FRANCE}]
    # The setting survives a reload, and the next question carries it along with the chat so far.
    await chat.reload()
    await expect_connected(chat)
    await expect(chat.locator("#system-prompt")).to_have_value(system)
    await expect(chat.locator("#max-tokens")).to_have_value("16")
    await ask(chat, "And of Spain?")
    second = generates(chat.sent)[-1]
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][0]["content"] == system
    # Cleared, it is not sent at all (the model's own default applies).
    await settings(chat)
    await chat.fill("#system-prompt", "")
    await chat.click("#new-chat")
    await ask(chat, FRANCE)
    assert [m["role"] for m in generates(chat.sent)[-1]["messages"]] == ["user"]


async def test_reload_keeps_the_chat_and_the_list_switches_and_deletes(chat, server, logs):
    await settings(chat, max_tokens=24, temperature=0)
    first, _ = await ask(chat, FRANCE)
    first_answer = await text_of(first)
    await chat.reload()
    await expect_connected(chat)
    # The conversation is back, rendered the same, and it goes on with its history.
    await expect(chat.locator(".msg")).to_have_count(2)
    assert await chat.locator(".msg.user .text").text_content() == FRANCE
    assert await text_of(chat.locator(".msg.assistant")) == first_answer
    await expect_state(chat.locator(".msg.assistant"), "done")
    await ask(chat, "And of Germany?")
    assert len(generates(chat.sent)[-1]["messages"]) == 3

    # A second chat; the list shows both, newest first, the open one marked.
    await chat.click("#new-chat")
    await expect(chat.locator(".msg")).to_have_count(0)
    await ask(chat, "Name a colour.")
    items = chat.locator("#chat-list .chat-open")
    await expect(items).to_have_count(2)
    await expect(items.nth(0)).to_have_text("Name a colour.")
    await expect(items.nth(1)).to_have_text(FRANCE)
    await expect(items.nth(0)).to_have_attribute("aria-current", "true")
    await screenshot(chat, "chat-list")

    # Switching back shows the first chat; a reload stays on it.
    await items.nth(1).click()
    await expect(chat.locator(".msg")).to_have_count(4)
    await chat.reload()
    await expect_connected(chat)
    await expect(chat.locator(".msg")).to_have_count(4)
    await expect(chat.locator("#chat-list .chat-open[aria-current]")).to_have_text(FRANCE)

    # Delete the open chat: the page shows a new, empty chat; the other one stays.
    await chat.get_by_role("button", name=f"Delete chat “{FRANCE}”").click()
    await expect(chat.locator(".msg")).to_have_count(0)
    await expect(chat.locator("#chat-list .chat-open")).to_have_count(1)
    await expect(chat.locator("#announcer")).to_have_text(f"Deleted “{FRANCE}”")
    assert [c["title"] for c in await stored_chats(chat)] == ["Name a colour."]
    await chat.reload()
    await expect_connected(chat)
    await expect(chat.locator("#chat-list .chat-open")).to_have_count(1)
    await expect(chat.locator(".msg")).to_have_count(0)


async def test_deleting_a_chat_while_it_answers_stops_the_answer(chat, server, logs):
    await settings(chat, max_tokens=400)
    message, request_id = await send(chat, LONG_STORY)
    await wait_for_text(chat, message, 10)
    await chat.get_by_role("button", name=f"Delete chat “{LONG_STORY}”").click()
    record = await wait_for_record(logs, "generation_cancelled", id=request_id)
    assert record["reason"] == "user_cancelled"
    await expect(chat.locator("#send")).to_be_enabled()
    await expect(chat.locator("#chat-list .chat-open")).to_have_count(0)
    assert await stored_chats(chat) == []


async def test_on_a_narrow_screen_the_chat_list_is_a_panel(browser, server, logs):
    page = await new_page(browser, server.http_url + "/", viewport={"width": 375, "height": 740})
    try:
        await settings(page, max_tokens=8, temperature=0)
        await page.click("details.settings summary")
        await ask(page, FRANCE)
        await page.click("#new-chat")
        toggle = page.locator("#chats-toggle")
        await expect(page.locator("#sidebar")).to_be_hidden()
        await expect(toggle).to_have_attribute("aria-expanded", "false")
        await toggle.click()
        await expect(toggle).to_have_attribute("aria-expanded", "true")
        first = page.locator("#chat-list .chat-open").first
        await expect(first).to_be_visible()
        await expect(first).to_be_focused()
        width = await page.evaluate("() => document.documentElement.scrollWidth")
        assert width <= 375, width
        await screenshot(page, "narrow-chats")
        # Esc closes it and gives focus back to the toggle; choosing a chat closes it too.
        await page.keyboard.press("Escape")
        await expect(page.locator("#sidebar")).to_be_hidden()
        await expect(toggle).to_be_focused()
        await toggle.click()
        await first.click()
        await expect(page.locator("#sidebar")).to_be_hidden()
        await expect(page.locator(".msg")).to_have_count(2)
    finally:
        await close_page(page)


# ---------- copy, theme ----------


async def test_copy_buttons_copy_the_message_text(chat, server, logs):
    await settings(chat, max_tokens=32, temperature=0)
    answer, _ = await ask(chat, FRANCE)
    [stored] = await stored_chats(chat)
    await answer.locator("button.copy").click()
    await expect(answer.locator("button.copy")).to_have_text("Copied")
    await expect(chat.locator("#announcer")).to_have_text("Copied to the clipboard")
    # The answer's own text (its markdown source), not the rendered page.
    assert await chat.evaluate("() => navigator.clipboard.readText()") == stored["messages"][1]["content"]
    await chat.locator(".msg.user button.copy").click()
    assert await chat.evaluate("() => navigator.clipboard.readText()") == FRANCE
    await expect(answer.locator("button.copy")).to_have_text("Copy")


async def test_theme_toggle_cycles_and_is_remembered(chat, server):
    html = chat.locator("html")
    theme = chat.locator("#theme")
    await expect(theme).to_have_text("Theme: Auto")
    await expect(html).to_have_attribute("data-theme", "light")  # the headless default scheme is light
    await theme.click()
    await expect(theme).to_have_text("Theme: Light")
    await theme.click()
    await expect(theme).to_have_text("Theme: Dark")
    await expect(html).to_have_attribute("data-theme", "dark")
    background = await chat.evaluate("() => getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(22, 24, 28)"
    # The code theme follows the page's theme.
    assert await chat.evaluate("() => document.getElementById('code-dark').media") == "all"
    assert await chat.evaluate("() => document.getElementById('code-light').media") == "not all"
    await chat.reload()
    await expect_connected(chat)
    await expect(html).to_have_attribute("data-theme", "dark")
    await expect(theme).to_have_text("Theme: Dark")
    assert await theme.get_attribute("aria-label") == "Theme: dark. Switch to the system theme"
    await screenshot(chat, "dark")
    await theme.click()
    await expect(html).to_have_attribute("data-theme", "light")
    await expect(theme).to_have_text("Theme: Auto")


async def test_auto_theme_follows_the_system(browser, server):
    page = await new_page(browser, server.http_url + "/", color_scheme="dark")
    try:
        await expect(page.locator("html")).to_have_attribute("data-theme", "dark")
        await page.emulate_media(color_scheme="light")
        await expect(page.locator("html")).to_have_attribute("data-theme", "light")
    finally:
        await close_page(page)


# ---------- the shipped libraries ----------


def test_vendored_libraries_match_their_integrity_attributes():
    html = (ROOT / "stopline" / "web" / "index.html").read_text()
    lock = json.loads((ROOT / "stopline" / "web" / "vendor" / "vendor.json").read_text())
    shipped = [name for package in lock["packages"] for name in package["files"].values()]
    for name in shipped:
        path = ROOT / "stopline" / "web" / "vendor" / name
        assert path.is_file(), name
        if name.endswith((".js", ".css")):
            digest = base64.b64encode(hashlib.sha384(path.read_bytes()).digest()).decode()
            tag = re.search(rf'(?:src|href)="vendor/{re.escape(name)}"[^>]*?integrity="([^"]+)"', html, re.S)
            assert tag, f"index.html does not load {name} with an integrity attribute"
            assert tag.group(1) == f"sha384-{digest}", name
    # Every package ships its licence.
    for package in lock["packages"]:
        assert any(n.endswith("LICENSE") for n in package["files"].values()), package["name"]
        assert re.fullmatch(r"\d+\.\d+\.\d+", package["version"]) and package["integrity"].startswith("sha512-")


async def raw_get(port: int, path: str) -> tuple[int, str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode().lower(), body


async def test_the_page_has_a_content_security_policy_and_vendor_files_are_served(server):
    status, head, _ = await raw_get(server.port, "/")
    assert status == 200
    assert "content-security-policy: default-src 'self'; img-src 'self' data:;" in head
    status, head, body = await raw_get(server.port, "/vendor/purify.min.js")
    assert status == 200 and "content-type: text/javascript; charset=utf-8" in head
    assert body == (ROOT / "stopline" / "web" / "vendor" / "purify.min.js").read_bytes()
    for path in (
        "/vendor/",
        "/vendor/../README.md",
        "/vendor/x/../../README.md",
        "/vendor/.hidden",
        "/docs/protocol.md",
        "/vendor/%2e%2e/app.js",
    ):
        status, _, _ = await raw_get(server.port, path)
        assert status == 404, path
