"""Helpers for the browser tests: pages opened in headless Chromium, the page's controls used
as a user would, and the frames the page sends."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from playwright.async_api import expect

from support import UNIT

ROOT = Path(__file__).resolve().parent.parent.parent
ARTIFACTS = ROOT / "artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"

LONG_STORY = "Write a very long story about a dragon."
FRANCE = "What is the capital of France? Answer in one word."


def ms(seconds: float) -> float:
    """A Playwright timeout (milliseconds) for a wait of ``seconds``, scaled by UNIT."""
    return seconds * 1000 * UNIT


async def new_page(browser, url: str | None = None, **context_options):
    """A fresh context and page; uncaught page errors are collected on ``page.errors``."""
    context = await browser.new_context(**{"viewport": {"width": 1024, "height": 768}, **context_options})
    page = await context.new_page()
    page.set_default_timeout(ms(30))
    page.errors = []
    page.on("pageerror", lambda error: page.errors.append(str(error)))
    if url is not None:
        await open_app(page, url)
    return page


async def close_page(page) -> None:
    errors = list(page.errors)
    await page.context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


async def open_app(page, url: str) -> None:
    await page.goto(url)
    await expect_connected(page)


async def expect_connected(page, timeout: float = 30) -> None:
    await expect(page.locator("#status")).to_have_attribute("data-state", "connected", timeout=ms(timeout))
    await expect(page.locator("#send")).to_be_enabled()


async def settings(page, *, max_tokens=None, temperature=None, timeout=None) -> None:
    """Fill the Settings fields the way a user would: open the panel, type the numbers."""
    panel = page.locator("details.settings")
    if not await panel.evaluate("d => d.open"):
        await page.click("details.settings summary")
    for selector, value in (("#max-tokens", max_tokens), ("#temperature", temperature), ("#timeout", timeout)):
        if value is not None:
            await page.fill(selector, str(value))


async def send(page, text: str):
    """Type a prompt, click Send; return the new assistant message and its request id."""
    before = await page.locator(".msg.assistant").count()
    await page.fill("#prompt", text)
    await page.click("#send")
    messages = page.locator(".msg.assistant")
    await expect(messages).to_have_count(before + 1)
    message = messages.last
    request_id = await message.get_attribute("data-id")
    assert request_id
    return message, request_id


async def wait_for_text(page, message, at_least: int, timeout: float = 60) -> int:
    """Wait until the message shows at least ``at_least`` characters; return how many it shows."""
    handle = await message.element_handle()
    await page.wait_for_function(
        "([el, n]) => el.querySelector('.text').textContent.length >= n", arg=[handle, at_least], timeout=ms(timeout)
    )
    return await message.locator(".text").evaluate("el => el.textContent.length")


async def expect_state(message, state: str, timeout: float = 30) -> None:
    await expect(message).to_have_attribute("data-state", state, timeout=ms(timeout))


async def meta(message) -> str:
    return await message.locator(".meta").inner_text()


async def wait_for_record(logs, event: str, timeout: float = 10, **match) -> dict:
    deadline = time.monotonic() + timeout * UNIT
    while True:
        records = logs.records(event, **match)
        if records:
            assert len(records) == 1, records
            return records[0]
        assert time.monotonic() < deadline, f"no {event} log record matching {match}"
        await asyncio.sleep(0.02)


async def screenshot(page, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SCREENSHOTS / f"{name}.png"))


def record_frames(page) -> list[dict]:
    """Every JSON frame the page sends on its WebSockets, in order."""
    sent: list[dict] = []

    def on_websocket(ws):
        ws.on("framesent", lambda payload: sent.append(json.loads(payload)) if isinstance(payload, str) else None)

    page.on("websocket", on_websocket)
    return sent


def generates(sent: list[dict]) -> list[dict]:
    return [f for f in sent if f["type"] == "generate"]
