"""``cacherouter web --scripted`` in a real headless browser: Debian's Chromium driven by Selenium through
Debian's ChromeDriver, against the real Starlette app on a free 127.0.0.1 port, running the real agent, gateway and
tool subprocesses with the scripted models and the offline DeepSeek cache model.

Where the browser or Selenium is missing, the browser test is skipped and says why. The screenshot lands in the
test's tmp dir (its path is printed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import make_repo

from cacherouter.chat import SCRIPTED_LABEL, build_chat
from cacherouter.gateway import Gateway, GatewayConfig
from cacherouter.mainview import MainView
from cacherouter.web import WebChat, create_app
from tvcache.server.runner import AppThread

from browser_support import chromium, missing_browser

MESSAGES = ("Weather report for a city text=Paris", "Stock price for a ticker symbol text=<b>ACME</b>")

try:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover - the tests are skipped then; missing_browser() says why
    pass

needs_browser = pytest.mark.skipif(missing_browser() is not None, reason=str(missing_browser()))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AppThread]:
    root = make_repo(tmp_path / "repo")
    with Gateway(GatewayConfig(root=root)) as gateway:
        view = MainView.from_registry(gateway.registry, ("base",))
        setup = build_chat(gateway, view=view, scripted=True, sessions_dir=None)
        web = WebChat(setup, setup.agent.new_session(view))
        with AppThread(create_app(web)) as thread:
            yield thread


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    with chromium(tmp_path / "chromium-profile", window="1400,1500") as driver:
        yield driver


@needs_browser
def test_web_ui_in_chromium(server: AppThread, browser: Any, tmp_path: Path) -> None:
    wait = WebDriverWait(browser, 30, poll_frequency=0.05)
    browser.get(f"{server.url}/")
    wait.until(lambda d: d.find_element(By.ID, "mode").text == "SCRIPTED")
    for count, message in enumerate(MESSAGES, start=1):
        box = browser.find_element(By.ID, "message")
        box.send_keys(message)
        browser.find_element(By.ID, "send").click()
        wait.until(lambda d, n=count: d.find_element(By.TAG_NAME, "body").get_attribute("data-turns") == str(n))
        wait.until(lambda d: d.find_element(By.ID, "send").is_enabled())

    state = httpx.get(f"{server.url}/api/state", timeout=10).json()
    assert state["mode"] == "scripted"
    assert browser.find_element(By.ID, "banner").text == SCRIPTED_LABEL
    assert browser.find_element(By.ID, "cache-label").text == "SCRIPTED"
    assert browser.find_element(By.ID, "session").text == state["session"]
    assert [turn["query"] for turn in state["turns"]] == list(MESSAGES)

    # The transcript: each message and answer as the server recorded it, rendered as text (the <b> stays literal).
    for turn in state["turns"]:
        item = browser.find_element(By.CSS_SELECTOR, f'#transcript li[data-turn="{turn["index"]}"]')
        assert item.find_element(By.CSS_SELECTOR, ".msg.user .text").text == turn["query"]
        assert item.find_element(By.CSS_SELECTOR, ".msg.agent .text").text == turn["answer"]
        assert turn["path"] == "tools"
    assert "city_weather:Paris" in state["turns"][0]["answer"]
    assert "stock_price:<b>ACME</b>" in state["turns"][1]["answer"]
    assert browser.find_elements(By.CSS_SELECTOR, "#transcript b") == []

    # Each tool call: name, router target, arguments and result as the server reports them.
    routed = []
    for turn in state["turns"]:
        assert turn["calls"]
        for call in turn["calls"]:
            node = browser.find_element(
                By.CSS_SELECTOR, f'#transcript li[data-turn="{turn["index"]}"] [data-call="{call["id"]}"]'
            )
            assert node.find_element(By.CSS_SELECTOR, ".call-name").text == call["name"]
            assert node.find_element(By.CSS_SELECTOR, ".call-result").text == call["result"].strip()
            assert call["ok"] is True
            if call["router"]:
                assert node.find_element(By.CSS_SELECTOR, ".call-routed").text == call["routed_to"]
                assert call["arguments"] == {"task": turn["query"]}
                routed.append(call["routed_to"])
    assert routed == ["city_weather", "stock_price"]  # both outside the core view, reached through the router

    # The per-request cache table: one row per model request, figures equal to the server's.
    requests = [request for turn in state["turns"] for request in turn["requests"]]
    rows = browser.find_elements(By.CSS_SELECTOR, "#requests tbody tr")
    assert len(rows) == len(requests) == state["totals"]["requests"]
    for row, request in zip(rows, requests, strict=True):
        assert row.get_attribute("data-request") == str(request["index"])
        assert row.find_element(By.CSS_SELECTOR, "[data-field=channel]").text == request["channel"]
        assert int(row.find_element(By.CSS_SELECTOR, "[data-field=prompt]").text) == request["prompt_tokens"]
        assert int(row.find_element(By.CSS_SELECTOR, "[data-field=cached]").text) == request["cached_tokens"]
        assert row.find_element(By.CSS_SELECTOR, "[data-field=cost]").text == f"{request['cost']:.1f}"
    assert {"triage", "main", "router"} <= {request["channel"] for request in requests}
    assert requests[0]["cached_tokens"] == 0  # a fresh offline cache claims no hit on the first request
    assert sum(r["cached_tokens"] for r in state["turns"][1]["requests"]) > 0  # the second turn reuses the prefix
    totals = browser.find_element(By.ID, "totals")
    assert int(totals.find_element(By.CSS_SELECTOR, "[data-field=prompt]").text) == state["totals"]["prompt_tokens"]
    assert int(totals.find_element(By.CSS_SELECTOR, "[data-field=cached]").text) == state["totals"]["cached_tokens"]
    shown = totals.find_element(By.CSS_SELECTOR, "[data-field=hit]").text
    assert shown == f"{100 * state['totals']['hit_rate']:.1f}%"
    assert totals.find_element(By.CSS_SELECTOR, "[data-field=cost]").text == f"{state['totals']['cost']:.1f}"

    screenshot = tmp_path / "cacherouter-web.png"
    assert browser.save_screenshot(str(screenshot))
    print(f"web UI screenshot: {screenshot}")
    # Nothing failed in the page: no script error, no request refused, nothing blocked by the CSP.
    assert [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"] == []


def test_chat_endpoint_refuses_cross_site_and_malformed_requests(server: AppThread) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        page = http.get("/")
        assert page.status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        # A cross-site form can only send text/plain or form bodies: refused before any agent turn runs.
        assert http.post("/api/chat", content="message=hi", headers={"Content-Type": "text/plain"}).status_code == 415
        refused = http.post("/api/chat", json={"message": "hi"}, headers={"Origin": "http://evil.example"})
        assert refused.status_code == 403
        assert http.post("/api/chat", json={"message": "  "}).status_code == 400
        assert http.post("/api/chat", json=["not", "an", "object"]).status_code == 400
        assert http.get("/api/state", headers={"Host": "rebound.example"}).status_code == 400  # DNS rebinding
        assert http.get("/api/state").json()["turns"] == []


def test_each_request_reports_its_relative_input_cost(server: AppThread) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        state = http.post("/api/chat", json={"message": MESSAGES[0]}).json()["state"]
    requests = state["turns"][0]["requests"]
    for request in requests:  # DeepSeek's offline cache model: a hit costs 1/30 of an uncached input token
        miss = request["prompt_tokens"] - request["cached_tokens"]
        assert request["cost"] == pytest.approx(miss + request["cached_tokens"] / 30)
    assert state["totals"]["cost"] == pytest.approx(sum(r["cost"] for r in requests))
