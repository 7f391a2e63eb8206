"""The chat page and the dashboard in a real browser (Debian's Chromium driven by Playwright) against a
real server with the real model. Screenshots go to test-output/web/."""

import asyncio
import re
import shutil
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Page, async_playwright, expect

from cache_store import CacheStore
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, connect
from chatd.config import Settings

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREENSHOTS = Path(__file__).resolve().parent.parent / "test-output" / "web"
# The flags the machine needs: no sandbox as root, and no background calls to Google's hosts.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Chromium is not installed (make test installs it as root)"),
]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def server(smollm2):
    async with ChatServer(Settings(port=0, model="smollm2-135m"), load=lambda: smollm2) as started:
        await started.wait_ready()
        yield started


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def browser():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        await launched.close()


class PageWatch:
    """Console errors, uncaught exceptions (a CSP violation is one) and every URL the page asked for."""

    def __init__(self, page: Page):
        self.errors: list[str] = []
        self.urls: list[str] = []
        page.on("console", lambda message: message.type == "error" and self.errors.append(message.text))
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("request", lambda request: self.urls.append(request.url))
        page.on("websocket", lambda socket: self.urls.append(socket.url))

    def assert_clean(self, origin: str, expected_errors: tuple[str, ...] = ()) -> None:
        errors = [e for e in self.errors if not any(expected in e for expected in expected_errors)]
        assert errors == []
        host = origin.split("://", 1)[1]
        assert all(url.split("://", 1)[1].startswith(host) for url in self.urls), self.urls  # no CDN


async def open_page(browser, origin: str, path: str, **options) -> tuple[Page, PageWatch]:
    page = await browser.new_page(**options)
    watch = PageWatch(page)
    await page.goto(origin + path)
    return page, watch


async def send(page: Page, text: str) -> None:
    await page.fill("#input", text)
    await page.press("#input", "Enter")


async def test_chat_streams_reuses_the_cache_survives_reload_and_stops(server, browser):
    origin = f"http://127.0.0.1:{server.port}"
    page, watch = await open_page(browser, origin, "/", viewport={"width": 1100, "height": 800})
    await expect(page.locator("#status")).to_have_text("connected")
    # Record every text the streaming reply shows, to see it arrive piece by piece.
    await page.evaluate("""() => {
        window.__seen = new Set();
        new MutationObserver(() => document.querySelectorAll('.message.assistant.streaming .bubble')
            .forEach((b) => window.__seen.add(b.textContent))).observe(document.getElementById('log'),
            {childList: true, subtree: true, characterData: true});
    }""")

    await send(page, "Hi! What is the capital of France? One sentence, please.")
    first = page.locator(".message.assistant").nth(0)
    await expect(first.locator(".meta")).to_contain_text("TTFT", timeout=120_000)
    assert await page.evaluate("window.__seen.size") >= 3  # streamed, not delivered at once
    await send(page, "And of Italy?")
    second = page.locator(".message.assistant").nth(1)
    await expect(second.locator(".meta")).to_contain_text("TTFT", timeout=120_000)
    await expect(second.locator(".badge.hit")).to_have_text("cache: device")
    await expect(second.locator(".meta")).not_to_contain_text(" 0/")  # some prompt tokens were cached
    assert (await first.locator(".bubble").inner_text()).strip()
    await page.screenshot(path=SCREENSHOTS / "chat-two-turns.png")

    # Typing sends the hint that brings an offloaded cache back to the device before the message.
    session_id = await page.evaluate("localStorage.getItem('chatd.session_id')")
    assert await asyncio.wrap_future(server.engine.call(CacheStore.evict_idle)) >= 1
    assert await asyncio.wrap_future(server.engine.call(lambda store: session_id in store.host))
    await page.type("#input", "Thanks, one more", delay=20)
    for _ in range(100):
        if await asyncio.wrap_future(server.engine.call(lambda store: session_id in store.device)):
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("typing did not bring the cache back to the device")
    await page.fill("#input", "")

    # A reload keeps the session: same id, both turns redrawn from the server's history.
    await page.reload()
    await expect(page.locator("#status")).to_have_text("connected")
    await expect(page.locator(".message")).to_have_count(4)
    assert await page.evaluate("localStorage.getItem('chatd.session_id')") == session_id

    # Stop during a long reply.
    await send(page, "Write a very long story about a dragon who learns to cook, with many chapters.")
    third = page.locator(".message.assistant").nth(2)
    await expect(page.locator("#send")).to_have_text("Stop")
    await expect(third.locator(".bubble")).not_to_have_text("", timeout=60_000)
    await page.click("#send")
    await expect(third.locator(".badge.cancelled")).to_have_text("stopped", timeout=30_000)
    await expect(page.locator("#send")).to_have_text("Send")
    await page.screenshot(path=SCREENSHOTS / "chat-stopped.png")

    # A dropped socket: the page reconnects by itself and reopens the same session.
    for connection in list(server._uvicorn.server_state.connections):
        connection.transport.abort()
    await expect(page.locator("#status")).to_have_text("connected", timeout=20_000)
    await expect(page.locator(".message")).to_have_count(4)  # the stopped turn was not recorded
    await send(page, "Thanks!")
    await expect(page.locator(".message.assistant").nth(2).locator(".meta")).to_contain_text("TTFT",
                                                                                            timeout=120_000)
    watch.assert_clean(origin)
    await page.close()


async def test_phone_viewport_and_unreachable_server(smollm2, browser):
    async with ChatServer(Settings(port=0), load=lambda: smollm2) as server:
        await server.wait_ready()
        origin = f"http://127.0.0.1:{server.port}"
        page, watch = await open_page(browser, origin, "/", viewport={"width": 390, "height": 844}, is_mobile=True,
                                      has_touch=True)
        await expect(page.locator("#status")).to_have_text("connected")
        await send(page, "Hello!")
        await expect(page.locator(".message.assistant .meta")).to_contain_text("TTFT", timeout=120_000)
        assert await page.evaluate("document.documentElement.scrollWidth") <= 390  # no sideways scrolling
        box = await page.locator("#send").bounding_box()
        assert box["x"] + box["width"] <= 390 and box["y"] + box["height"] <= 844  # the composer is on screen
        await page.screenshot(path=SCREENSHOTS / "chat-phone.png")
    # The server is gone: the page says so plainly and keeps retrying.
    await expect(page.locator("#banner")).to_contain_text("Cannot reach the chatd server", timeout=20_000)
    await expect(page.locator("#status")).to_have_text("offline")
    await page.screenshot(path=SCREENSHOTS / "chat-unreachable.png")
    watch.assert_clean(origin, expected_errors=("WebSocket", "ERR_CONNECTION_REFUSED"))
    await page.close()


CARDS_OVERFLOWING = """[...document.querySelectorAll('.tile')].filter(tile => {
    const box = tile.getBoundingClientRect();
    return [...tile.children].some(part => { const inner = part.getBoundingClientRect();
        return inner.left < box.left || inner.right > box.right || part.scrollWidth > part.clientWidth + 1; });
}).map(tile => tile.querySelector('.label').textContent)"""


async def test_dashboard_draws_live_charts_after_traffic(server, browser):
    """Runs after the chat test in this module, so the server has traffic to show."""
    origin = f"http://127.0.0.1:{server.port}"
    page, watch = await open_page(browser, origin, "/dashboard", viewport={"width": 1300, "height": 1000})
    await expect(page.locator("#updated")).to_contain_text("updated")
    for chart in ("chart-ttft", "chart-tps", "chart-hit", "chart-tiers", "chart-arena", "chart-evictions"):
        assert int(await page.locator(f"#{chart}").get_attribute("data-points")) > 0, chart
    assert "ms" in await page.locator("#tile-ttft").inner_text()
    used, reserved, free = (int(n) for n in (await page.locator("#tile-arena").inner_text()).split(" / "))
    assert used > 0 and used + reserved + free == server.engine.arena.tokens
    segments, sessions, *_ = (await page.locator("#tile-shared").inner_text()).replace(" · ", " / ").split(" / ")
    stats = server.engine.cache_stats
    assert (int(segments), int(sessions)) == (stats["prefixes"], stats["shared_sessions"])
    assert await page.locator("#summary tr").count() >= 4
    await expect(page.locator("#summary")).to_contain_text("Host offloads: written / not written again")
    most = server.engine.cache_stats["engine_threads_max"]
    await expect(page.locator("#summary")).to_contain_text(
        re.compile(rf"Engine threads: now / max \(CPUs others take\)\d+ / {most} \(\d+\.\d\)"))
    await expect(page.locator("#summary")).to_contain_text(re.compile(
        r"Speculation: draft tokens / accepted \(acceptance\)\d+ / \d+ \((\d+%|–)\)"))
    assert server.engine.cache_stats["spec_max_tokens"] > 0, "speculation is on by default"
    await expect(page.locator("#summary")).to_contain_text(re.compile(
        r"Responses WebSockets: connections / lanes / queued creates0 / 0 / 0"))
    await expect(page.locator("#summary")).to_contain_text("Steers: accepted / successors / pending / refused")
    first_update = await page.locator("#updated").inner_text()
    for width in (1024, 1280, 1920):  # every card holds its text, at every width a desk's screen has
        await page.set_viewport_size({"width": width, "height": 1000})
        assert await page.evaluate(CARDS_OVERFLOWING) == [], width
    await asyncio.sleep(3.5)
    assert await page.locator("#updated").inner_text() != first_update  # it refreshes by itself
    await page.screenshot(path=SCREENSHOTS / "dashboard.png", full_page=True)
    watch.assert_clean(origin)
    await page.close()


async def test_api_key_form_and_a_reply_resumed_after_a_dropped_socket(smollm2, browser):
    key = "sk-browser-0123456789"
    async with ChatServer(Settings(port=0, api_key=[key]), load=lambda: smollm2) as server:
        await server.wait_ready()
        origin = f"http://127.0.0.1:{server.port}"
        page, watch = await open_page(browser, origin, "/", viewport={"width": 1000, "height": 800})
        await expect(page.locator("#auth")).to_be_visible()
        await page.fill("#api-key", key)
        await page.press("#api-key", "Enter")
        await expect(page.locator("#auth")).to_be_hidden()
        await expect(page.locator("#send")).to_have_text("Send")
        await send(page, "Tell me, in three sentences, about a lighthouse keeper and a storm.")
        reply = page.locator(".message.assistant").nth(0)
        await expect(reply.locator(".bubble")).not_to_have_text("", timeout=60_000)
        assert server.turns.running_turns, "the network must drop while the reply is still being written"
        for connection in list(server._uvicorn.server_state.connections):  # the network drops mid-reply
            connection.transport.abort()
        await expect(page.locator("#status")).to_have_text("connected", timeout=20_000)
        await expect(reply.locator(".meta")).to_contain_text("TTFT", timeout=120_000)
        shown = await reply.locator(".bubble").inner_text()
        session_id = await page.evaluate("localStorage.getItem('chatd.session_id')")
        recorded = (await server.sessions.get(session_id)).messages[-1].content
        assert shown.strip() == recorded.strip() and len(recorded) > 20  # nothing lost, nothing doubled
        await page.screenshot(path=SCREENSHOTS / "chat-resumed.png")
        watch.assert_clean(origin, expected_errors=("WebSocket",))
        await page.close()


async def test_dashboard_shows_redis_and_its_replica(browser, tiny, redis_with_replica):
    """With sessions in a Redis that has a replica, the dashboard names the mode and nodes, and counts the turns
    acknowledged once the replica held them."""
    primary, _ = redis_with_replica
    # (the WAIT timeout of a machine under load: the replica acknowledges every turn, however busy the test run)
    settings = Settings(port=0, redis_url=primary.url, redis_wait_timeout_ms=10_000)
    async with ChatServer(settings, load=lambda: tiny) as redis_server:
        await redis_server.wait_ready()
        async with ChatClient(await connect(redis_server.url)) as client:
            session_id = (await client.open_session()).session_id
            await (await client.chat(session_id, "Hello.", max_new_tokens=4)).result()
        origin = f"http://127.0.0.1:{redis_server.port}"
        page, watch = await open_page(browser, origin, "/dashboard")
        summary = page.locator("#summary")
        await expect(summary).to_contain_text("Redis: mode, primaries / replicas")
        await expect(summary).to_contain_text("single, 1 / 0")
        await expect(summary).to_contain_text("2 / 0 (waiting for 1)")  # the session and its turn
        watch.assert_clean(origin)
        await page.close()
