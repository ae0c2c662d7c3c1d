"""The browser client, driven in headless Chromium against a real server and the real model.

Every test loads web/ from an in-process StoplineServer and clicks, types and
reloads like a user would; nothing is mocked. Screenshots of the main states go
to artifacts/screenshots/, and the Stop-to-cancelled latency seen in the page
goes to artifacts/web_stop_latency.json.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import statistics
import time
from datetime import datetime

import pytest
from playwright.async_api import expect

from stopline.app import StoplineServer
from stopline.settings import Settings
from support import UNIT, decode_step_ms, metric_value
from support.web import (
    ARTIFACTS,
    FRANCE,
    LONG_STORY,
    close_page,
    expect_connected,
    expect_state,
    meta,
    ms,
    new_page,
    screenshot,
    send,
    settings,
    wait_for_record,
    wait_for_text,
)

pytestmark = pytest.mark.browser

STOP_TRIES = 20


# ---------- helpers ----------


async def metrics(port: int) -> str:
    """GET /metrics from the server on ``port``; return the exposition text."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 10 * UNIT)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = data.decode().partition("\r\n\r\n")
    assert head.split()[1] == "200", head
    return body


async def stop_server(server: StoplineServer) -> None:
    """Shut a server down; a shutdown that hangs fails the test instead of hanging it."""
    await asyncio.wait_for(server.shutdown(), 30 * UNIT)
    assert server.scheduler.active == 0 and server.scheduler.queue_depth == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(record: dict) -> datetime:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))


# Installed just before Stop is pressed: the page's own clock from the click event to
# the message's data-state turning "cancelled", and to the next frame after that.
ARM_STOP_CLOCK = """
message => {
  window.__stopClock = new Promise((resolve) => {
    let clicked = null, stopped = null;
    const done = () => requestAnimationFrame(() => resolve({
      clicked, dom_ms: stopped - clicked, frame_ms: performance.now() - clicked,
      state: message.dataset.state,
    }));
    const check = () => {
      if (clicked === null || stopped !== null) return;
      const state = message.dataset.state;
      if (state !== 'streaming' && state !== 'stopping') {
        stopped = performance.now();
        observer.disconnect();
        done();
      }
    };
    const onStop = (e) => {
      if (clicked !== null) return;
      if (e.type === 'keydown' && e.key !== 'Escape') return;
      if (e.type === 'click' && e.target.id !== 'stop') return;
      clicked = performance.now();
      check();
    };
    // Capture on the document runs before the page's own handlers.
    document.addEventListener('click', onStop, { capture: true });
    document.addEventListener('keydown', onStop, { capture: true });
    const observer = new MutationObserver(check);
    observer.observe(message, { attributes: true, attributeFilter: ['data-state'] });
  });
}
"""


# ---------- tests ----------


async def test_stop_button_cancels_a_streaming_generation(page, server, logs):
    await settings(page, max_tokens=400)
    message, request_id = await send(page, LONG_STORY)
    await expect_state(message, "streaming")
    await expect(page.locator("#stop")).to_be_enabled()
    await expect(page.locator("#send")).to_be_disabled()

    # Tokens stream: the text keeps growing.
    first = await wait_for_text(page, message, 1)
    grown = await wait_for_text(page, message, first + 20)
    assert grown > first
    await screenshot(page, "streaming")

    await page.click("#stop")
    await expect_state(message, "cancelled")
    shown = await meta(message)
    assert "Generation cancelled" in shown
    count = re.search(r"(\d+) tokens?", shown)
    assert count and re.search(r"stopped in \d+\.\d ms", shown), shown
    await expect(page.locator("#stop")).to_be_disabled()
    await expect(page.locator("#send")).to_be_enabled()
    await screenshot(page, "cancelled")

    # Nothing more appears once the page says cancelled.
    text = await message.locator(".text").text_content()
    await asyncio.sleep(0.3 * UNIT)
    assert await message.locator(".text").text_content() == text

    record = await wait_for_record(logs, "generation_cancelled", id=request_id)
    assert record["reason"] == "user_cancelled"
    assert record["tokens_after_cancel"] <= 1
    assert record["tokens_generated"] == int(count.group(1))
    assert 0 < record["tokens_generated"] < 400
    text_metrics = await metrics(server.port)
    assert metric_value(text_metrics, "stopline_requests_total", outcome="cancelled", reason="user_cancelled") == 1
    assert metric_value(text_metrics, "stopline_requests_total") == 1


@pytest.mark.alone
@pytest.mark.both_engines(why="the stop's wait ends in each engine's own loop")
async def test_stop_to_cancelled_latency_over_20_tries(page, server, logs):
    await settings(page, max_tokens=400, temperature=0)
    samples = []
    for attempt in range(STOP_TRIES):
        await page.click("#new-chat")
        await expect(page.locator(".msg")).to_have_count(0)
        message, request_id = await send(page, LONG_STORY)
        await wait_for_text(page, message, 10)
        await message.evaluate(ARM_STOP_CLOCK)
        started = time.perf_counter()
        await page.click("#stop")
        await expect_state(message, "cancelled")
        outside_ms = (time.perf_counter() - started) * 1000
        clock = await page.evaluate("() => window.__stopClock")
        assert clock["state"] == "cancelled", (attempt, clock)
        assert "Generation cancelled" in await meta(message), attempt
        record = await wait_for_record(logs, "generation_cancelled", id=request_id)
        assert record["reason"] == "user_cancelled" and record["tokens_after_cancel"] <= 1, record
        samples.append(
            {
                "request_id": request_id,
                "dom_ms": round(clock["dom_ms"], 2),
                "frame_ms": round(clock["frame_ms"], 2),
                "playwright_ms": round(outside_ms, 2),
                "server_cancel_latency_ms": record["cancel_latency_ms"],
                "tokens_generated": record["tokens_generated"],
                "tokens_after_cancel": record["tokens_after_cancel"],
            }
        )

    assert len(samples) == STOP_TRIES
    text_metrics = await metrics(server.port)
    assert (
        metric_value(text_metrics, "stopline_requests_total", outcome="cancelled", reason="user_cancelled")
        == STOP_TRIES
    )
    assert metric_value(text_metrics, "stopline_requests_total") == STOP_TRIES

    def summary(key):
        values = [s[key] for s in samples]
        return {"p50": round(statistics.median(values), 2), "max": round(max(values), 2)}

    report = {
        "tries": STOP_TRIES,
        "what": "Stop clicked (click event in the page) to the assistant message's data-state turning "
        "'cancelled' (dom_ms) and to the next animation frame (frame_ms); playwright_ms is the "
        "test's own clock around the click and the wait.",
        "dom_ms": summary("dom_ms"),
        "frame_ms": summary("frame_ms"),
        "playwright_ms": summary("playwright_ms"),
        "server_cancel_latency_ms": summary("server_cancel_latency_ms"),
        "samples": samples,
    }
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "web_stop_latency.json").write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\nStop -> cancelled on screen over {STOP_TRIES} tries: "
        f"p50 {report['dom_ms']['p50']} ms, max {report['dom_ms']['max']} ms "
        f"(next frame: p50 {report['frame_ms']['p50']} ms, max {report['frame_ms']['max']} ms; "
        f"server loop exit: p50 {report['server_cancel_latency_ms']['p50']} ms)"
    )


async def test_escape_stops_like_the_stop_button(page, server, logs):
    await settings(page, max_tokens=400)
    message, request_id = await send(page, LONG_STORY)
    await wait_for_text(page, message, 10)
    await page.keyboard.press("Escape")
    await expect_state(message, "cancelled")
    shown = await meta(message)
    assert "Generation cancelled" in shown and re.search(r"\d+ tokens? · stopped in \d+\.\d ms", shown), shown
    await expect(page.locator("#send")).to_be_enabled()

    record = await wait_for_record(logs, "generation_cancelled", id=request_id)
    assert record["reason"] == "user_cancelled" and record["tokens_after_cancel"] <= 1
    text_metrics = await metrics(server.port)
    assert metric_value(text_metrics, "stopline_requests_total", outcome="cancelled", reason="user_cancelled") == 1

    # Esc with nothing running does nothing at all.
    await page.keyboard.press("Escape")
    await asyncio.sleep(0.2 * UNIT)
    assert len(logs.records("generation_cancelled", id=request_id)) == 1
    await expect(page.locator(".msg.assistant")).to_have_count(1)
    assert len(logs.records("generation_accepted")) == 1


async def test_reload_mid_generation_cancels_it_on_the_server(page, server, logs):
    await settings(page, max_tokens=400)
    message, request_id = await send(page, LONG_STORY)
    await wait_for_text(page, message, 10)

    await page.reload()
    await expect_connected(page)
    # The chat is kept; the answer that was running shows as interrupted, with its text so far.
    await expect(page.locator(".msg.user")).to_have_count(1)
    kept = page.locator(".msg.assistant")
    await expect(kept).to_have_count(1)
    await expect_state(kept, "interrupted")
    assert len(await kept.locator(".text").text_content()) >= 10

    record = await wait_for_record(logs, "generation_cancelled", id=request_id)
    assert record["reason"] == "client_disconnected"
    # It stopped within one decode step of the socket closing.
    assert record["tokens_after_cancel"] <= 1
    assert record["tokens_generated"] < 400
    disconnected = [r for r in logs.records("client_disconnected") if r["peer"] == record["peer"]]
    assert len(disconnected) == 1 and disconnected[0]["live_requests"] == 1
    gap_ms = (_time(record) - _time(disconnected[0])).total_seconds() * 1000
    print(
        f"\nclient_disconnected -> generation_cancelled: {gap_ms:.1f} ms, "
        f"loop exit {record['cancel_latency_ms']} ms after the cancel"
    )
    text_metrics = await metrics(server.port)
    assert metric_value(text_metrics, "stopline_requests_total", outcome="cancelled", reason="client_disconnected") == 1
    assert metric_value(text_metrics, "stopline_active_generations") == 0


async def test_one_second_timeout_shows_as_timeout(page, server, logs):
    await settings(page, max_tokens=2000, timeout=1)
    message, request_id = await send(page, LONG_STORY)
    await expect_state(message, "timeout", timeout=30)
    shown = await meta(message)
    after = re.search(r"Timed out after (\d+(?:\.\d)?) s · \d+ tokens?", shown)
    assert after, shown
    await expect(page.locator("#send")).to_be_enabled()
    await expect(page.locator("#stop")).to_be_disabled()
    await screenshot(page, "timeout")

    record = await wait_for_record(logs, "generation_timeout", id=request_id)
    assert record["reason"] == "total_timeout"
    assert record["tokens_generated"] < 2000
    # At the deadline, not before, and within a few decode steps after. On a loaded machine the
    # deadline can come before the second token: then there is no step to bound it by.
    assert 1000 <= record["duration_ms"]
    if record["tokens_generated"] >= 2:
        assert record["duration_ms"] <= 1000 + 5 * decode_step_ms(record)
    # The page shows the timeout frame's duration_ms, in seconds rounded as Math.round does.
    assert float(after.group(1)) == math.floor(record["duration_ms"] / 100 + 0.5) / 10, (shown, record)
    text_metrics = await metrics(server.port)
    assert metric_value(text_metrics, "stopline_requests_total", outcome="timeout", reason="total_timeout") == 1


async def test_page_reconnects_after_the_server_restarts(browser, engine, logs):
    port = free_port()
    config = Settings.build(host="127.0.0.1", port=port)
    first = StoplineServer(engine, config)
    second = None
    first_running = False
    page = None
    try:
        await asyncio.wait_for(first.start(), 30 * UNIT)
        first_running = True
        page = await new_page(browser, f"http://127.0.0.1:{port}/")
        # Record every status the page goes through.
        await page.evaluate("""() => {
          const status = document.getElementById('status');
          window.__statuses = [status.dataset.state];
          new MutationObserver(() => window.__statuses.push(status.dataset.state))
            .observe(status, { attributes: true, attributeFilter: ['data-state'] });
        }""")
        await settings(page, max_tokens=400, temperature=0)

        # A generation running when the server goes down is cancelled with reason shutdown.
        message, request_id = await send(page, LONG_STORY)
        await wait_for_text(page, message, 10)
        first_running = False
        await stop_server(first)
        await expect(page.locator("#status")).to_have_attribute("data-state", "disconnected", timeout=ms(10))
        await expect(page.locator("#status-text")).to_have_text("Disconnected")
        await expect(page.locator("#send")).to_be_disabled()
        await expect(page.locator("#stop")).to_be_disabled()
        await expect_state(message, "cancelled", timeout=5)
        assert "the server is shutting down" in await meta(message)
        record = await wait_for_record(logs, "generation_cancelled", id=request_id)
        assert record["reason"] == "shutdown" and record["tokens_after_cancel"] <= 1
        assert (
            metric_value(
                first.metrics.render().decode(), "stopline_requests_total", outcome="cancelled", reason="shutdown"
            )
            == 1
        )
        await screenshot(page, "disconnected")

        restarted = StoplineServer(engine, config)
        await asyncio.wait_for(restarted.start(), 30 * UNIT)
        second = restarted
        await expect_connected(page, timeout=30)
        statuses = await page.evaluate("() => window.__statuses")
        assert "disconnected" in statuses and statuses[-1] == "connected", statuses

        # And it can chat again.
        await page.click("#new-chat")
        await settings(page, max_tokens=32, temperature=0)
        answer, answer_id = await send(page, FRANCE)
        await expect_state(answer, "done", timeout=60)
        assert "Paris" in await answer.locator(".text").text_content()
        done = await wait_for_record(logs, "generation_done", id=answer_id)
        # EOS ends the answer unless it used all 32 tokens; the page says which.
        assert done["reason"] == ("max_tokens" if done["tokens_generated"] == 32 else "eos")
        ending = "end of text" if done["reason"] == "eos" else "max tokens reached"
        assert re.search(rf"\d+ tokens? · {ending}", await meta(answer))
        assert metric_value(await metrics(port), "stopline_requests_total", outcome="done") == 1
    finally:
        if page is not None:
            await close_page(page)
        if first_running:
            await stop_server(first)
        if second is not None:
            await stop_server(second)


async def test_narrow_viewport_stays_usable(browser, server, logs):
    page = await new_page(browser, server.http_url + "/", viewport={"width": 375, "height": 740})
    try:

        async def no_horizontal_scroll():
            width = await page.evaluate("() => document.documentElement.scrollWidth")
            assert width <= 375, width

        async def in_view(selector):
            box = await page.locator(selector).bounding_box()
            assert box is not None, selector
            assert box["x"] >= 0 and box["x"] + box["width"] <= 375, (selector, box)
            assert box["y"] >= 0 and box["y"] + box["height"] <= 740, (selector, box)

        await no_horizontal_scroll()
        for selector in ("#prompt", "#send", "#stop", "#new-chat"):
            await expect(page.locator(selector)).to_be_visible()
            await in_view(selector)

        await settings(page, max_tokens=48, temperature=0)
        await no_horizontal_scroll()
        await page.click("details.settings summary")  # fold it away again

        # A chat completes.
        message, _ = await send(page, FRANCE)
        await expect_state(message, "done", timeout=60)
        assert "Paris" in await message.locator(".text").text_content()
        await no_horizontal_scroll()

        # A long answer wraps instead of widening the page, and Stop is reachable with a click.
        await settings(page, max_tokens=300)
        await page.click("details.settings summary")
        story, _ = await send(page, "Write a very long story about a dragon. Use very long words.")
        await wait_for_text(page, story, 40)
        await no_horizontal_scroll()
        for selector in ("#prompt", "#send", "#stop"):
            await in_view(selector)
        await page.click("#stop")
        await expect_state(story, "cancelled")
        await no_horizontal_scroll()
        await screenshot(page, "narrow")
    finally:
        await close_page(page)


async def test_enter_sends_and_shift_enter_adds_a_line(page, server, logs):
    await settings(page, max_tokens=32, temperature=0)
    prompt = page.locator("#prompt")
    await prompt.click()
    await page.keyboard.type("What is the capital of France?")
    await page.keyboard.press("Shift+Enter")
    await page.keyboard.type("Answer briefly.")
    assert await prompt.input_value() == "What is the capital of France?\nAnswer briefly."
    await asyncio.sleep(0.3 * UNIT)
    await expect(page.locator(".msg")).to_have_count(0)
    assert not logs.records("generation_accepted")

    await page.keyboard.press("Enter")
    await expect(page.locator(".msg.user")).to_have_count(1)
    assert await page.locator(".msg.user .text").text_content() == "What is the capital of France?\nAnswer briefly."
    await expect(prompt).to_have_value("")
    message = page.locator(".msg.assistant").last
    request_id = await message.get_attribute("data-id")
    await expect_state(message, "done", timeout=60)
    assert await message.locator(".text").text_content()
    record = await wait_for_record(logs, "generation_done", id=request_id)
    assert record["tokens_generated"] >= 1

    # Enter on an empty prompt sends nothing.
    await expect(prompt).to_be_focused()
    await page.keyboard.press("Enter")
    await asyncio.sleep(0.2 * UNIT)
    await expect(page.locator(".msg.assistant")).to_have_count(1)
    assert len(logs.records("generation_accepted")) == 1
