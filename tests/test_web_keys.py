"""The page on a server that asks for an API key: it says so, takes the key in Settings, and sends it
as a WebSocket subprotocol (docs/protocol.md#api-keys). Headless Chromium, the real server and model."""

from __future__ import annotations

import pytest
from playwright.async_api import expect

from stopline.auth import Quota, add_key
from support import running_server
from support.web import FRANCE, close_page, expect_connected, expect_state, ms, new_page, send, settings

pytestmark = pytest.mark.browser


async def test_the_page_asks_for_a_key_and_then_sends_it(browser, engine, logs, tmp_path):
    path = tmp_path / "keys.jsonl"
    key, entry = add_key(path, "page-user", Quota())
    async with running_server(engine, api_keys_file=str(path)) as server:
        page = await new_page(browser)
        try:
            await page.goto(server.http_url + "/")
            # Refused without a key: a prompt, the key field open and focused, no reconnect loop.
            await expect(page.locator("#status-text")).to_have_text("API key needed", timeout=ms(30))
            await expect(page.locator("#notice")).to_have_text("This server needs an API key. Enter it in Settings.")
            await expect(page.locator("#api-key")).to_be_focused()
            await expect(page.locator("#send")).to_be_disabled()
            refused = len(logs.records("unauthorized"))
            # A wrong key is refused too, and the page says that it was this key.
            await page.fill("#api-key", "stopline_not-the-key-0123456789")
            await page.press("#api-key", "Enter")
            await page.locator("#api-key").blur()
            await expect(page.locator("#notice")).to_have_text(
                "The server refused this API key. Enter another one in Settings.", timeout=ms(30)
            )
            await page.fill("#api-key", key)
            await page.locator("#api-key").blur()
            await expect_connected(page)
            await expect(page.locator("#notice")).to_be_hidden()
            await settings(page, max_tokens=16, temperature=0)
            answer, request_id = await send(page, FRANCE)
            await expect_state(answer, "done", timeout=60)
            [done] = logs.records("generation_done", id=request_id)
            assert done["user_id"] == "page-user" and done["key_id"] == entry.key_id
            # Kept in the browser: a reload connects with it.
            await page.reload()
            await expect_connected(page)
            assert await page.input_value("#api-key") == key
            # Every refusal was counted once a second at most, and the key never reached the log.
            assert logs.records("unauthorized") and len(logs.records("unauthorized")) <= refused + 2
            assert key not in "\n".join(logs.lines)
        finally:
            await close_page(page)
